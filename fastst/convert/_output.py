"""Writing a converted file through ``fastst.writer.StreamWriter``: every tensor
declared up front, then its bytes produced one tensor at a time, in chunks, in
file order, each chunk written as it comes: memory holds one chunk (or, for a
strided view, one tensor), never the file."""
from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .. import SafetensorError, safe_open
from ..writer import StreamWriter
from ._torch_files import ByteRange

__all__ = ["Declared", "write_declared", "verify_written"]

Progress = Optional[Callable[[int], None]]


class Declared(NamedTuple):
    """A tensor to write: its header entry, and a function that yields its bytes
    (C order, little-endian) as buffers, chunk after chunk."""
    name: str
    code: str
    shape: Tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterator[memoryview]]


def write_declared(filename: str, tensors: Sequence[Declared],
                   metadata: Optional[Mapping[str, str]], *, fsync: bool = False,
                   progress: Progress = None) -> None:
    """Write `tensors` to `filename` atomically."""
    by_name = {tensor.name: tensor for tensor in tensors}
    declared = [(tensor.name, tensor.code, tensor.shape) for tensor in tensors]
    with StreamWriter(filename, declared, metadata, fsync=fsync) as writer:
        for name in writer.names():
            _fill(writer, by_name[name], progress)


def _fill(writer: StreamWriter, tensor: Declared, progress: Progress) -> None:
    position = 0
    for chunk in tensor.chunks():
        writer.write_bytes(tensor.name, chunk, position)
        position += len(chunk)
        if progress is not None:
            progress(len(chunk))
    if position != tensor.nbytes:
        raise AssertionError(f"tensor {tensor.name!r}: {position} bytes for {tensor.nbytes}")


def verify_written(filename: str, tensors: Sequence[Declared]) -> None:
    """Read every tensor of `filename` back and compare it, chunk by chunk, with
    the bytes its source gives again: a SafetensorError names the first that
    differs. Memory: two chunks (or one strided tensor and a chunk)."""
    with safe_open(filename, backend="pread") as reader:
        if set(reader.keys()) != {tensor.name for tensor in tensors}:
            raise SafetensorError(f"{filename}: does not hold the tensors written to it")
        starts = {tensor.name: reader.data_start + reader.info(tensor.name).data_offsets[0]
                  for tensor in tensors}
    buffer = np.empty(0, np.uint8)
    with open(filename, "rb", buffering=0) as written:
        whole_file = ByteRange(written.fileno(), 0, os.fstat(written.fileno()).st_size)
        for tensor in tensors:
            position = starts[tensor.name]
            for chunk in tensor.chunks():
                source = np.frombuffer(chunk, np.uint8)
                if buffer.size < source.size:
                    buffer = np.empty(source.size, np.uint8)
                back = buffer[:source.size]
                whole_file.read_into(position, back.data)
                if not np.array_equal(back, source):
                    raise SafetensorError(
                        f"{filename}: tensor {tensor.name!r} differs from its source from "
                        f"byte {position - starts[tensor.name]} on")
                position += source.size
