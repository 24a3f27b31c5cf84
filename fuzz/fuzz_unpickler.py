"""libFuzzer target for fastst.convert's restricted unpickler.

Each input is the ``data.pkl`` of a would-be torch checkpoint. The target

* unpickles it with ``fastst.convert._torch_pickle.loads``;
* packs it into a torch-style zip archive (``archive/data.pkl``, ``archive/byteorder``
  and four storages ``archive/data/0`` to ``3`` of 64 bytes) and converts that with
  ``fastst.convert.torch_to_safetensors``; a converted file must then load with
  ``fastst.load_file`` and hold the tensors the report counts.

``SafetensorError`` is the only exception expected. Any other exception, a crash, a
hang, a memory blow-up, or the marker file appearing (the seeds hold pickles that
would create it through ``os.system``, ``eval`` and ``exec``) is a finding.

Seeds come from ``seeds()``: the pickles of small state dicts written by torch (when
it is installed) and hand-written hostile pickles. Run it with
``python fuzz/fuzz_unpickler.py fuzz/corpus-unpickler -runs=100000 -max_len=4096``
after writing the seeds with ``python fuzz/fuzz_unpickler.py --write-seeds
fuzz/corpus-unpickler``. Without atheris the module still imports, so tests can call
``TestOneInput`` directly.
"""
from __future__ import annotations

import io
import os
import pickle
import sys
import tempfile
import zipfile
from typing import Iterator, Tuple

import ml_dtypes  # noqa: F401
import numpy as np  # noqa: F401
import orjson  # noqa: F401

try:
    import atheris
except ImportError:  # the target can still be driven by hand, without coverage
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["fastst"]):
        import fastst
        from fastst.convert import torch_to_safetensors
        from fastst.convert._torch_pickle import loads
else:
    import fastst
    from fastst.convert import torch_to_safetensors
    from fastst.convert._torch_pickle import loads

from fastst import SafetensorError

SCRATCH = tempfile.mkdtemp(prefix="fastst-fuzz-unpickler-")
MARKER = os.path.join(SCRATCH, "marker")
STORAGE_BYTES = 64


def _archive(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", data)
        archive.writestr("archive/byteorder", "little")
        for key in range(4):
            archive.writestr(f"archive/data/{key}", bytes(range(key, key + STORAGE_BYTES)))
    return buffer.getvalue()


def TestOneInput(data: bytes) -> None:
    try:
        loads(data)
    except SafetensorError:
        pass
    src = os.path.join(SCRATCH, "input.pt")
    dst = os.path.join(SCRATCH, "output.safetensors")
    with open(src, "wb") as fh:
        fh.write(_archive(data))
    try:
        report = torch_to_safetensors(src, dst)
    except SafetensorError:
        assert not os.path.exists(dst) or os.path.getmtime(dst) <= os.path.getmtime(src)
    else:
        assert len(fastst.load_file(dst)) == report.tensors
        os.unlink(dst)
    assert not os.path.exists(MARKER), "an input ran code"


def _hostile() -> Iterator[Tuple[str, bytes]]:
    command = f"touch {MARKER}".encode()
    size = len(command).to_bytes(4, "little")
    yield "os-system", b"\x80\x02cos\nsystem\nX" + size + command + b"\x85R."
    code = f"open({MARKER!r}, 'w')".encode()
    yield "eval", b"\x80\x02c__builtin__\neval\nX" + len(code).to_bytes(4, "little") + code + \
        b"\x85R."
    yield "copyreg", (b"\x80\x02ccopyreg\n_reconstructor\ncos\nsystem\nc__builtin__\nobject\n"
                      b"X" + size + command + b"\x87R.")
    yield "tensor", (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n"
                     b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
                     b"X\x03\x00\x00\x00cpuK\x10tQK\x00K\x04K\x04\x86K\x04K\x01\x86\x89"
                     b"ccollections\nOrderedDict\n)RtRs.")


def seeds() -> Iterator[Tuple[str, bytes]]:
    """(name, data.pkl) pairs: hostile pickles, then torch's own when it is here."""
    yield from _hostile()
    try:
        import torch
    except ImportError:
        return
    states = {
        "flat": {"a": torch.ones(2, 3), "b": torch.arange(4)},
        "views": {"t": torch.randn(3, 4).t(), "s": torch.arange(8.0)[2:6]},
        "dtypes": {"bf": torch.ones(2, dtype=torch.bfloat16),
                   "f8": torch.zeros(2, dtype=torch.float8_e4m3fn),
                   "u16": torch.zeros(2, dtype=torch.uint16),
                   "c": torch.ones(1, dtype=torch.complex64)},
        "nested": {"model": {"w": torch.ones(1)}, "epoch": 2, "opt": [{"lr": 0.1}]},
    }
    for name, state in states.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
            pkl = [n for n in archive.namelist() if n.endswith("/data.pkl")][0]
            yield name, archive.read(pkl)
    yield "plain", pickle.dumps({"x": [1, 2.5, "s", None, (True, b"b")]}, protocol=2)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        os.makedirs(sys.argv[2], exist_ok=True)
        for name, data in seeds():
            with open(os.path.join(sys.argv[2], name), "wb") as fh:
                fh.write(data)
        return
    if atheris is None:
        sys.exit("fuzz_unpickler.py needs atheris: pip install atheris")
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
