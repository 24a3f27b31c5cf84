"""Builders shared by the tests and by fuzz/make_corpus.py (import it as ``helpers``),
a runner of hostile inputs in a bounded child process, a runner of a fresh Python with
the switch to fastst turned on, and a poll for a condition to come true."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import time
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


BOUNDED_PRELUDE = """
import resource, signal
import numpy, fastst, fastst.convert
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past RLIMIT_FSIZE fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size}, {file_size}))
try:
    with open("/proc/self/status") as status:
        held = int([line for line in status if line.startswith("VmSize:")][0].split()[1]) << 10
    resource.setrlimit(resource.RLIMIT_AS, (held + {memory}, held + {memory}))
except OSError:     # no /proc: the address space is left as it is
    pass
"""


def run_bounded(code: str, *, timeout: float = 30, memory: int = 1 << 30,
                file_size: int = 64 << 20) -> str:
    """Run `code` in a fresh interpreter whose address space may grow by `memory`
    bytes past what it holds once fastst is imported (where /proc tells), whose
    files may not grow past `file_size` bytes (a larger write, or reservation,
    fails with EFBIG), killed after `timeout` seconds; its stdout. An
    AssertionError says when it ran out of time or did not exit cleanly."""
    result = bounded_ending(code, timeout=timeout, memory=memory, file_size=file_size)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def bounded_ending(code: str, *, timeout: float = 30, memory: int = 1 << 30,
                   file_size: int = 64 << 20) -> subprocess.CompletedProcess:
    """Run `code` as ``run_bounded`` does, and return how it ended, whatever that was
    (a signal: a negative returncode); an AssertionError where it ran out of time."""
    script = BOUNDED_PRELUDE.format(memory=memory, file_size=file_size) + textwrap.dedent(code)
    try:
        return subprocess.run([sys.executable, "-"], input=script, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout} s") from None


# The file that pip installs beside fastst and Python reads as it starts: it turns the
# switch on when FASTST_PATCH_SAFETENSORS=1 (see setup.py).
SWITCH_PTH = pathlib.Path(__file__).resolve().parent.parent / "fastst-safetensors.pth"
# How a Python is started, by name: without the switch, with the variable set, and with
# the call first
SWITCH_WAYS: Dict[str, Dict[str, Any]] = {"off": {}, "variable": {"variable": "1"},
                                          "call": {"call": True}}


def switched_python(code: str, site: pathlib.Path, *, variable: Optional[str] = None,
                    call: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh Python that first reads the package's .pth file (copied
    into the folder `site`) as Python reads those of site-packages, with
    FASTST_PATCH_SAFETENSORS set to `variable` (None: unset), and
    ``fastst.patch_safetensors()`` called next if `call`; how it ended. An
    AssertionError where it ran out of time."""
    site.mkdir(exist_ok=True)
    shutil.copy(SWITCH_PTH, site)
    prelude = f"import site; site.addsitedir({str(site)!r})\n"
    if call:
        prelude += "import fastst; fastst.patch_safetensors()\n"
    try:
        return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                              env=switch_environment(variable), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout} s") from None


def switch_environment(variable: Optional[str]) -> Dict[str, str]:
    """This process's environment, with FASTST_PATCH_SAFETENSORS set to `variable`
    (None: unset)."""
    env = {name: value for name, value in os.environ.items()
           if name != "FASTST_PATCH_SAFETENSORS"}
    if variable is not None:
        env["FASTST_PATCH_SAFETENSORS"] = variable
    return env


# What an example needs beyond fastst's own dependencies, by what it imports...
FRAMEWORK_OF_IMPORT = {"torch": "torch", "fastst.torch": "torch", "jax": "jax",
                       "fastst.flax": "jax", "fastst.jax": "jax", "fastst.dask": "dask",
                       "dask": "dask", "fsspec": "fsspec",
                       "safetensors": "safetensors"}   # the reference: no free-threaded wheel
# ... by the URLs it opens (fsspec serves them), and by the checksums it writes (xxhash)
URL = re.compile(r"""["'](?:memory|s3|gs|https?)://""")
CHECKSUM = re.compile(r"""["']xxh3_(?:64|128)["']""")


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Whether `condition()` became true within `timeout` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


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


def frameworks_needed(code: str) -> list:
    """The optional packages that the example `code` needs."""
    imported = [name for full in imported_modules(code) for name in (full, full.split(".")[0])]
    needed = {FRAMEWORK_OF_IMPORT[name] for name in imported if name in FRAMEWORK_OF_IMPORT}
    if URL.search(code):
        needed.add("fsspec")
    if CHECKSUM.search(code):
        needed.add("xxhash")
    return sorted(needed)


def missing_frameworks(code: str) -> list:
    """The optional packages that the example `code` needs and this Python lacks."""
    return [name for name in frameworks_needed(code) if importlib.util.find_spec(name) is None]


def libfuzzer_runs(output: str) -> int:
    """The inputs libFuzzer says it ran ("Done N runs"; it may run a few past -runs)."""
    done = re.search(r"Done (\d+) runs", output)
    return int(done.group(1)) if done else 0
