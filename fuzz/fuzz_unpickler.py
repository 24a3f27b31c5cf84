"""libFuzzer target for fastst.convert's restricted unpickler and checkpoint readers.

Each input is the ``data.pkl`` of a would-be torch checkpoint, or (when it starts as
a zip archive or a ``.npy`` file does) a whole checkpoint file. The target

* unpickles a ``data.pkl`` with ``fastst.convert._torch_pickle.loads``;
* packs it into a torch-style zip archive (``archive/data.pkl``, ``archive/byteorder``
  and four storages ``archive/data/0`` to ``3`` of 64 bytes) and converts that with
  ``fastst.convert.torch_to_safetensors``; a whole file is converted with
  ``fastst.convert.convert`` (torch zip, ``.npz`` or ``.npy``, by its contents); a
  converted file must then load with ``fastst.load_file`` and hold the tensors the
  report counts.

``SafetensorError`` is the only exception expected. Any other exception, a crash, a
hang, a memory blow-up, or the marker file appearing (the seeds hold pickles that
would create it through ``os.system``, ``eval`` and ``exec``) is a finding. So is
an input that costs more than its size justifies, as the converter promises
bounded work (``AssertionError`` from the target):

* more than ``CPU_SECONDS`` of CPU time for the input;
* a peak RSS that grows by more than ``MEMORY_GROWTH_MIB`` on the input; under
  libFuzzer the address space is also capped (``ADDRESS_SPACE_MIB`` past what the
  process holds at its start), so that a large allocation fails at once, and a
  refusal caused by a ``MemoryError`` counts as a finding too;
* a converted file larger than the default bound of the converter (8 times the
  input plus 16 MiB).

Seeds come from ``seeds()``: hand-written hostile pickles and files (among them
the denial-of-service inputs found in review: a tuple DAG as a dict key, a view
with zero strides, a zip whose directory lies about its sizes, an ``.npz`` of
zeros, and their siblings), then the pickles of small state dicts written by
torch (when it is installed). Run it with
``python fuzz/fuzz_unpickler.py fuzz/corpus-unpickler -runs=100000 -max_len=4096``
after writing the seeds with ``python fuzz/fuzz_unpickler.py --write-seeds
fuzz/corpus-unpickler``. Without atheris the module still imports, so tests can call
``TestOneInput`` directly.
"""
from __future__ import annotations

import io
import os
import pickle
import resource
import struct
import sys
import tempfile
import time
import zipfile
from typing import Iterator, Tuple

import ml_dtypes  # noqa: F401
import numpy as np  # noqa: F401

try:
    import atheris
except ImportError:  # the target can still be driven by hand, without coverage
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["fastst"]):
        import fastst
        from fastst.convert import convert, torch_to_safetensors
        from fastst.convert._output import DEFAULT_MAX_EXPANSION, EXPANSION_ALLOWANCE
        from fastst.convert._torch_pickle import loads
else:
    import fastst
    from fastst.convert import convert, torch_to_safetensors
    from fastst.convert._output import DEFAULT_MAX_EXPANSION, EXPANSION_ALLOWANCE
    from fastst.convert._torch_pickle import loads

from fastst import SafetensorError

SCRATCH = tempfile.mkdtemp(prefix="fastst-fuzz-unpickler-")
MARKER = os.path.join(SCRATCH, "marker")
STORAGE_BYTES = 64
CPU_SECONDS = 2.0           # per input: the slowest seen take half a second
MEMORY_GROWTH_MIB = 256     # growth of the peak RSS on one input
ADDRESS_SPACE_MIB = 2048    # under libFuzzer: address space past the start's
FILE_STARTS = (b"PK\x03\x04", b"\x93NUMPY")   # a whole checkpoint file, not a data.pkl


def _archive(data: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", data)
        archive.writestr("archive/byteorder", "little")
        for key in range(4):
            archive.writestr(f"archive/data/{key}", bytes(range(key, key + STORAGE_BYTES)))
    return buffer.getvalue()


def TestOneInput(data: bytes) -> None:
    cpu, peak = time.thread_time(), _peak_rss_mib()
    _convert(data)
    spent = time.thread_time() - cpu
    assert spent <= CPU_SECONDS, f"an input of {len(data)} bytes took {spent:.1f} s of CPU"
    grown = _peak_rss_mib() - peak
    assert grown <= MEMORY_GROWTH_MIB, f"an input of {len(data)} bytes took {grown} MiB more"
    assert not os.path.exists(MARKER), "an input ran code"


def _convert(data: bytes) -> None:
    """Convert `data`: a refusal must be a SafetensorError, not caused by an
    allocation that failed."""
    whole_file = data.startswith(FILE_STARTS)
    if not whole_file:
        try:
            loads(data)
        except SafetensorError as error:
            _not_out_of_memory(error)
    src = os.path.join(SCRATCH, "input.pt")
    dst = os.path.join(SCRATCH, "output.safetensors")
    with open(src, "wb") as fh:
        fh.write(data if whole_file else _archive(data))
    try:
        reports = convert(src, dst) if whole_file else [torch_to_safetensors(src, dst)]
    except SafetensorError as error:
        _not_out_of_memory(error)
        assert not os.path.exists(dst) or os.path.getmtime(dst) <= os.path.getmtime(src)
        return
    limit = DEFAULT_MAX_EXPANSION * os.path.getsize(src) + EXPANSION_ALLOWANCE
    assert os.path.getsize(dst) <= limit, f"{os.path.getsize(dst)} bytes written, over {limit}"
    assert len(fastst.load_file(dst)) == reports[0].tensors
    os.unlink(dst)


def _not_out_of_memory(error: SafetensorError) -> None:
    assert "MemoryError" not in str(error), f"refused only once memory ran out: {error}"


def _peak_rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


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


def _tensor(numel: bytes, size: bytes, stride: bytes) -> bytes:
    """The data.pkl of {"w": a float32 tensor of storage "0"}: each argument is the
    pickle of an int or a tuple of ints (for the storage's size, the tensor's
    size and stride)."""
    return (b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n"
            b"((X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
            b"X\x03\x00\x00\x00cpu" + numel + b"tQK\x00" + size + stride +
            b"\x89ccollections\nOrderedDict\n)RtRs.")


def _int(value: int) -> bytes:
    """The pickle of a non-negative int below 2**31 (BININT)."""
    return b"J" + struct.pack("<i", value)


def _dag(levels: int) -> bytes:
    """A tuple of two tuples of two ... (`levels` deep) of 1, in 2 bytes a level: the
    memo (DUP) shares each level, so that it unfolds to 2**levels leaves."""
    return b"K\x01" + b"2\x86" * levels


def _lying_zip() -> bytes:
    """A checkpoint whose storage member, deflated, really holds 4 KiB; its central
    directory entry says 3.6 GB (72 MB compressed: within 100x), and the tensor
    reads all of it."""
    count = 900_000_000
    pkl = _tensor(_int(count), _int(count) + b"\x85", b"K\x01\x85")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("archive/data.pkl", pkl)
        archive.writestr("archive/data/0", bytes(4096), compress_type=zipfile.ZIP_DEFLATED)
    data = bytearray(buffer.getvalue())
    entry = data.rindex(b"PK\x01\x02")        # the storage's, written last
    struct.pack_into("<II", data, entry + 20, 4 * count // 50, 4 * count)
    return bytes(data)


def _npz(arrays: dict, compressed: bool = True) -> bytes:
    import numpy
    buffer = io.BytesIO()
    (numpy.savez_compressed if compressed else numpy.savez)(buffer, **arrays)
    return buffer.getvalue()


def _npz_lying_header() -> bytes:
    """An .npz whose member's header declares 10**12 floats, holding 16 bytes."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000,), }"
    header += b" " * (117 - len(header)) + b"\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("a.npy", b"\x93NUMPY\x01\x00v\x00" + header + bytes(16))
    return buffer.getvalue()


def _denial_of_service() -> Iterator[Tuple[str, bytes]]:
    """Inputs of a few bytes that once cost hours or gigabytes, and their
    siblings, at sizes that fit the fuzzer's inputs (the tests build them larger)."""
    yield "dos-hash-bomb", b"\x80\x02}" + _dag(64) + b"K\x00s."
    yield "dos-expanded", _tensor(b"K\x01", _int(100_000) * 2 + b"\x86", b"K\x00K\x00\x86")
    yield "dos-lying-zip", _lying_zip()
    import numpy
    yield "dos-npz-zeros", _npz({"z": numpy.zeros(1 << 19, numpy.float32)})
    yield "dos-npz-lying-header", _npz_lying_header()
    # a version 2 header of 4 GiB: NumPy reads that much before checking its bound
    yield "dos-npy-header-length", b"\x93NUMPY\x02\x00\xf0\xff\xff\xff" + bytes(50)
    modulus = sys.hash_info.modulus
    yield "dos-int-key-collisions", b"\x80\x02}(" + b"".join(
        b"\x8a\x09" + (modulus * k + 7).to_bytes(9, "little") + b"N" for k in range(1, 200)
    ) + b"u."
    yield "dos-memo-collisions", b"(l" + b"".join(
        b"p%d\n" % (modulus * k) for k in range(1, 100)) + b"."
    yield "dos-set-of-dags", b"\x80\x02c__builtin__\nset\n" + _dag(64) + b"\x85R."
    yield "dos-device-dag", (b"\x80\x02ctorch\ndevice\nX\x03\x00\x00\x00cpu" + _dag(64) +
                             b"\x86R.")
    yield "dos-message-of-a-dag", b"\x80\x02ctorch\nSize\n" + _dag(64) + b"\x85R."
    pairs = b"(" + b"".join(
        b"X\x02\x00\x00\x00%02dN\x86" % k for k in range(100)) + b"l"
    yield "dos-repeated-ordered-dict", (b"\x80\x02ccollections\nOrderedDict\nq\x00" + pairs +
                                        b"\x85q\x01" + b"h\x00h\x01R0" * 100 + b"N.")
    yield "dos-repeated-bytearray", (b"\x80\x02c__builtin__\nbytearray\nq\x00C\xff" +
                                     bytes(255) + b"\x85q\x01" + b"h\x00h\x01R0" * 100 +
                                     b"N.")


def seeds() -> Iterator[Tuple[str, bytes]]:
    """(name, data.pkl or whole file) pairs: hostile pickles and files, then torch's
    own pickles when it is here."""
    yield from _hostile()
    yield from _denial_of_service()
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
    _cap_address_space()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


def _cap_address_space() -> None:
    """Let the address space grow by ADDRESS_SPACE_MIB at most: an input that
    allocates more fails at once, with a MemoryError the target reports."""
    try:
        with open("/proc/self/status") as status:
            held = int([line for line in status if line.startswith("VmSize:")][0].split()[1])
    except OSError:
        return
    limit = (held << 10) + (ADDRESS_SPACE_MIB << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    main()
