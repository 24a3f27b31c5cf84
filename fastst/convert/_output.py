"""Writing a converted file: every tensor declared up front (a ``StreamedFile``:
the write plan of their header), then its bytes produced one tensor at a time, in
chunks, in file order, each chunk written as it comes: memory holds one chunk (and,
for a strided view, the bytes of the storage it spans), never the file. What may be
written at all is bounded first, by an OutputBudget."""
from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .._core import Reader, SafetensorError, plan_write
from .._io.files import write_atomically
from .._io.limits import DEFAULT_MAX_EXPANSION, EXPANSION_ALLOWANCE
from ._torch_files import ByteRange

__all__ = ["TensorToWrite", "OutputBudget", "Reporter", "StreamedFile", "write_declared",
           "verify_written", "DEFAULT_MAX_EXPANSION", "EXPANSION_ALLOWANCE"]

Progress = Optional[Callable[[int], None]]
OnPhase = Optional[Callable[[str], None]]
HEADER_ENTRY_BYTES = 64             # about what a tensor adds to the header, past its name


class TensorToWrite(NamedTuple):
    """A tensor to write: its header entry, and a function that yields its bytes
    (C order, little-endian) as buffers, chunk after chunk; `origin` says where
    they come from (shape, strides, storage), for messages."""
    name: str
    code: str
    shape: Tuple[int, ...]
    nbytes: int
    chunks: Callable[[], Iterator[memoryview]]
    origin: str = ""


class OutputBudget:
    """The bytes a conversion may write: `max_expansion` times the bytes its input
    files hold, plus EXPANSION_ALLOWANCE (None: no bound). A checkpoint holds every
    byte its tensors are made of, so a real one converts to about its own size; a
    tensor viewed with zero strides (``expand``) or a compressed member can stand
    for far more bytes than the file holds, and is refused past the budget before
    anything is reserved on disk."""

    def __init__(self, input_bytes: int, max_expansion: Optional[float]) -> None:
        if max_expansion is not None and not (isinstance(max_expansion, (int, float))
                                              and 0 < max_expansion < float("inf")):
            raise SafetensorError(f"max_expansion must be a positive number or None, got "
                                  f"{max_expansion!r}")
        self.input_bytes, self.max_expansion = input_bytes, max_expansion
        self.limit = None if max_expansion is None else \
            int(max_expansion * input_bytes) + EXPANSION_ALLOWANCE
        self.spent = 0

    @classmethod
    def of_files(cls, paths: Sequence[str], max_expansion: Optional[float]) -> OutputBudget:
        return cls(sum(os.stat(path).st_size for path in paths), max_expansion)

    def left(self) -> Optional[int]:
        return None if self.limit is None else self.limit - self.spent

    def spend(self, source: str, tensors: Sequence[TensorToWrite],
              metadata: Optional[Mapping[str, str]], files: int = 1) -> None:
        """Count the bytes of writing `tensors` (and `metadata` in each of `files`)
        from `source`, or refuse them, naming the largest tensor."""
        total = sum(tensor.nbytes + HEADER_ENTRY_BYTES + len(tensor.name) for tensor in tensors)
        total += files * sum(len(key) + len(value) + 8 for key, value in (metadata or {}).items())
        if self.limit is not None and self.spent + total > self.limit:
            largest = max(tensors, key=lambda tensor: tensor.nbytes, default=None)
            named = "" if largest is None else (
                f"; the largest tensor, {largest.name!r} ({_origin(largest)}), is "
                f"{largest.nbytes} bytes")
            allowed = f"the {self.limit}" if not self.spent else \
                f"the {self.limit - self.spent} left of the {self.limit}"
            raise SafetensorError(
                f"{source}: converting it would write {total} bytes, more than {allowed} "
                f"allowed for {self.input_bytes} bytes of input ({self.max_expansion:g} x "
                f"the input + {EXPANSION_ALLOWANCE >> 20} MiB){named}. Pass "
                f"max_expansion=None (fastst convert --max-expansion none), or a larger "
                f"ratio, to convert it anyway")
        self.spent += total


def _origin(tensor: TensorToWrite) -> str:
    return tensor.origin or f"shape {list(tensor.shape)}"


class Reporter:
    """What a conversion tells of its work as it goes: each number of bytes done
    (written, then read back and compared) to `progress`, and the name of each phase
    as it begins ("reading", "writing", "verifying"...) to `on_phase`."""

    def __init__(self, progress: Progress = None, on_phase: OnPhase = None) -> None:
        self.progress, self.on_phase = progress, on_phase

    def __call__(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress(nbytes)

    def phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


class StreamedFile:
    """A converted file to write: the plan of its header (`tensors` declared, with
    `metadata`), and the tensors' bytes, produced chunk by chunk as it is written
    (what ``fastst._io.files.write_atomically`` and ``fastst._format.index.write_files`` take
    of a plan: its ``total_size`` and ``write_to``)."""

    def __init__(self, tensors: Sequence[TensorToWrite], metadata: Optional[Mapping[str, str]],
                 progress: Reporter, align: Optional[int] = None) -> None:
        self.tensors = {tensor.name: tensor for tensor in tensors}
        self.plan = plan_write([(tensor.name, tensor.code, tensor.shape) for tensor in tensors],
                               metadata, align=align)
        self.total_size = self.plan.total_size
        self.progress = progress

    def write_to(self, fd: int, target: str) -> None:
        self.progress.phase("writing")
        self.plan.write_prefix(fd, target)
        for name in self.plan.names():
            self._fill(fd, self.tensors[name], target)

    def _fill(self, fd: int, tensor: TensorToWrite, target: str) -> None:
        position = 0
        for chunk in tensor.chunks():
            self.plan.write_bytes(fd, tensor.name, position, chunk, target)
            position += len(chunk)
            self.progress(len(chunk))
        if position != tensor.nbytes:
            raise SafetensorError(f"tensor {tensor.name!r}: its source gave {position} bytes "
                                  f"of the {tensor.nbytes} it declares")


def write_declared(filename: str, tensors: Sequence[TensorToWrite],
                   metadata: Optional[Mapping[str, str]], *, fsync: bool = False,
                   progress: Reporter, align: Optional[int] = None) -> None:
    """Write `tensors` to `filename` atomically (aligned: see ``plan_write``)."""
    write_atomically(StreamedFile(tensors, metadata, progress, align), filename, fsync=fsync)


def verify_written(filename: str, tensors: Sequence[TensorToWrite], progress: Reporter,
                   label: Optional[str] = None) -> None:
    """Read every tensor of `filename` back and compare it, chunk by chunk, with
    the bytes its source gives again: a SafetensorError names the first that
    differs (and the file as `label`: the target of a file not yet in place).
    Memory: two chunks (or one strided tensor and a chunk)."""
    progress.phase("verifying")
    label = label or filename
    reader = Reader()
    reader.uses_ml_dtypes = False     # only the header is read here: no array is made
    reader.open_file(filename, "pread")
    try:
        if set(reader.keys()) != {tensor.name for tensor in tensors}:
            raise SafetensorError(f"{label}: does not hold the tensors written to it")
        starts = {tensor.name: reader.data_start + reader.info(tensor.name).data_offsets[0]
                  for tensor in tensors}
    finally:
        reader.close()
    buffer = np.empty(0, np.uint8)
    with open(filename, "rb", buffering=0) as written:
        whole_file = ByteRange(written.fileno(), 0, os.fstat(written.fileno()).st_size,
                               label, "the converted file")
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
                        f"{label}: tensor {tensor.name!r} differs from its source from "
                        f"byte {position - starts[tensor.name]} on")
                position += source.size
                progress(source.size)
