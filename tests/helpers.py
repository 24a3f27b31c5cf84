"""Builders shared by the tests and by fuzz/make_corpus.py (import it as ``helpers``)."""
from __future__ import annotations

import importlib.util
import json
import re
import struct
from typing import Any, Dict, Optional, Union

Header = Union[Dict[str, Any], str, bytes]


def raw_file(header: Header, data: bytes = b"", length: Optional[int] = None, *,
             padding: bytes = b" ", align: int = 8, prefix: Optional[bytes] = None) -> bytes:
    """The bytes of a safetensors file: ``<u64 LE length><header><padding><data>``.

    A dict header is written as compact JSON; a str or bytes header is used verbatim, so
    it can hold invalid JSON, duplicate keys, ``-0``... The knobs break the layout on
    purpose:

    - `length`: the value of the length prefix (default: the padded header's length);
    - `padding`: the byte that pads the header to a multiple of `align` (``b"\\0"`` for
      NUL padding); `align=1` leaves the header unpadded;
    - `prefix`: bytes written in place of the whole 8-byte prefix (a short, big-endian
      or otherwise broken one); `length` is then ignored.
    """
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode("utf-8")
    header += padding * (-len(header) % align)
    if prefix is None:
        prefix = struct.pack("<Q", len(header) if length is None else length)
    return prefix + header + data


def entry(dtype: str = "F32", shape=(1,), offsets=(0, 4)) -> Dict[str, Any]:
    """One tensor's header entry."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# What an example needs beyond fastst's own dependencies, by what it imports...
FRAMEWORK_OF_IMPORT = {"torch": "torch", "fastst.torch": "torch", "jax": "jax",
                       "fastst.flax": "jax", "fastst.jax": "jax", "fastst.dask": "dask",
                       "dask": "dask", "fsspec": "fsspec"}
# ... by the URLs it opens (fsspec serves them), and by the checksums it writes (xxhash)
URL = re.compile(r"""["'](?:memory|s3|gs|https?)://""")
CHECKSUM = re.compile(r"""["']xxh3_(?:64|128)["']""")


def imported_modules(code: str) -> list:
    """The modules that the Python `code` imports (``import a, b as c``, ``from a import
    b``), by name."""
    names = []
    for line in code.splitlines():
        statement = line.strip()
        if statement.startswith("import "):
            names += [part.split(" as ")[0].strip() for part in statement[7:].split(",")]
        elif statement.startswith("from ") and " import " in statement:
            names.append(statement[5:].split(" import ")[0].strip())
    return names


def missing_frameworks(code: str) -> list:
    """The optional packages that the example `code` needs and this Python lacks."""
    imported = [name for full in imported_modules(code) for name in (full, full.split(".")[0])]
    needed = {FRAMEWORK_OF_IMPORT[name] for name in imported if name in FRAMEWORK_OF_IMPORT}
    if URL.search(code):
        needed.add("fsspec")
    if CHECKSUM.search(code):
        needed.add("xxhash")
    return sorted(name for name in needed if importlib.util.find_spec(name) is None)
