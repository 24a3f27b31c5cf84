"""Writing a converted file through ``fastst.writer.StreamWriter``: every tensor
declared up front, then its bytes produced one tensor at a time, in chunks, in
file order, each chunk written as it comes: memory holds one chunk (or, for a
strided view, one tensor), never the file."""
from __future__ import annotations

import zlib
from typing import Callable, Dict, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..writer import StreamWriter

__all__ = ["Declared", "write_declared"]

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
                   progress: Progress = None) -> Dict[str, int]:
    """Write `tensors` to `filename` atomically; returns each tensor's CRC-32 as
    written."""
    by_name = {tensor.name: tensor for tensor in tensors}
    checksums: Dict[str, int] = {}
    declared = [(tensor.name, tensor.code, tensor.shape) for tensor in tensors]
    with StreamWriter(filename, declared, metadata, fsync=fsync) as writer:
        for name in writer.names():
            checksums[name] = _fill(writer, by_name[name], progress)
    return checksums


def _fill(writer: StreamWriter, tensor: Declared, progress: Progress) -> int:
    checksum = position = 0
    for chunk in tensor.chunks():
        writer.write_bytes(tensor.name, chunk, position)
        checksum = zlib.crc32(chunk, checksum)
        position += len(chunk)
        if progress is not None:
            progress(len(chunk))
    if position != tensor.nbytes:
        raise AssertionError(f"tensor {tensor.name!r}: {position} bytes for {tensor.nbytes}")
    return checksum
