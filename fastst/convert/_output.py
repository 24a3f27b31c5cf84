"""Writing a converted file: every tensor declared up front as a TensorSpec, then
its bytes produced one tensor at a time, in chunks, while the file is written.

The seam: ``write_declared(filename, tensors, metadata)`` takes Declared tensors
(name, code, shape, nbytes, chunks) and writes them through ``fastst.writer``'s
plan (placeholder sources give the header and the buffer order) and
``write_atomically``. A streaming writer with declare-then-fill can take its
place here without any change to the callers.
"""
from __future__ import annotations

import os
import zlib
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..writer import TensorSpec, plan_write, write_atomically

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


class _FilledPlan:
    """What ``write_atomically`` needs of a plan (total_size, write_to), with the
    tensors' bytes produced while they are written."""

    def __init__(self, tensors: Sequence[Declared], metadata: Optional[Mapping[str, str]],
                 progress: Progress) -> None:
        placeholders: Dict[int, Declared] = {}
        specs = []
        for tensor in tensors:
            # no memory: NumPy broadcasts one byte to the tensor's size
            stand_in = np.broadcast_to(np.zeros((), np.uint8), (tensor.nbytes,))
            placeholders[id(stand_in)] = tensor
            specs.append(TensorSpec(tensor.name, tensor.code, tensor.shape, stand_in))
        plan = plan_write(specs, metadata)
        self.prefix = plan.prefix
        self.total_size = plan.total_size
        self.order: List[Declared] = [placeholders[id(source)] for source in plan.sources]
        self.checksums: Dict[str, int] = {}
        self._progress = progress

    def write_to(self, fd: int, target: str = "<file>") -> None:
        _write_all(fd, memoryview(self.prefix))
        for tensor in self.order:
            checksum = 0
            written = 0
            for chunk in tensor.chunks():
                _write_all(fd, chunk)
                checksum = zlib.crc32(chunk, checksum)
                written += len(chunk)
                if self._progress is not None:
                    self._progress(len(chunk))
            if written != tensor.nbytes:
                raise AssertionError(f"{tensor.name}: {written} bytes for {tensor.nbytes}")
            self.checksums[tensor.name] = checksum


def _write_all(fd: int, data: memoryview) -> None:
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    while len(view):
        view = view[os.write(fd, view):]


def write_declared(filename: str, tensors: Sequence[Declared],
                   metadata: Optional[Mapping[str, str]], *, fsync: bool = False,
                   progress: Progress = None) -> Dict[str, int]:
    """Write `tensors` to `filename` atomically; returns each tensor's CRC-32 as
    written."""
    plan = _FilledPlan(tensors, metadata, progress)
    write_atomically(plan, filename, fsync=fsync)  # type: ignore[arg-type]
    return plan.checksums
