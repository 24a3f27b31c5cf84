"""Writing from explicit specs: each tensor given as (name, dtype code, shape,
source), so that any framework's tensors, and dtypes NumPy lacks, go through the
same plan and the same output loop.

Three ways in, all byte-identical to ``save_file`` for the same tensors:

* ``serialize`` / ``serialize_file`` / ``deserialize`` / ``TensorSpec``: the
  reference's low-level API (``safetensors.serialize`` and friends), raw pointers
  and all; ``serialize`` also takes a list of ``WriteSpec``, which needs none.
* ``StreamWriter``: declare every tensor, then fill the file in any order, in
  pieces, or in place through a writable view; the file appears atomically.
* ``save_file_from``: specs plus a producer of tensors, one at a time.

>>> import numpy as np, fastst
>>> packed = np.array([0x21, 0x43], dtype=np.uint8)      # four 4-bit floats
>>> data = fastst.writer.serialize([fastst.writer.WriteSpec("f4", "F4", (4,), packed)])
>>> fastst.load(data)["f4"].tolist()
[33, 67]
"""
from __future__ import annotations

import bisect
import mmap
import operator
import os
import sys
import threading
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._core import (
    DTYPES, Reader, SafetensorError, SafetensorNotImplementedError, SafetensorTypeError,
    TensorInfo, WritePlan, WriteSpec, numpy_dtype, plan_write, spec_of_array,
)
from ._core import write_array_at
from ._files import AtomicFile, PathLike, copy_range, write_atomically
from ._handle import is_url
from .integrity import (CHECKSUM_KEY, checksum_metadata, digests_in_file, plan_with_checksums,
                        reserved_checksums)

__all__ = ["PendingFile", "StreamWriter", "TensorRegion", "TensorSpec", "WritePlan", "WriteSpec",
           "declared_specs",
           "deserialize", "plan_write", "save_file_from", "serialize", "serialize_file", "spec_of_array",
           "specs_of", "update_metadata", "write_atomically"]

UINT64_MAX = (1 << 64) - 1
# torch-style dtype name (the reference's TensorSpec spelling) -> header code
_CODE_OF_TORCH_NAME = {row.torch: row.code for row in DTYPES if row.torch is not None}
_PACKED_PAIRS = {row.code for row in DTYPES if row.bits == 4}   # torch stores two per byte

# ---------------------------------------------------------------------------
# The reference's low-level API
# ---------------------------------------------------------------------------


class TensorSpec:
    """One tensor for ``serialize`` / ``serialize_file``, as ``safetensors.TensorSpec``.

    ``TensorSpec(*, dtype, shape, data_ptr, data_len)``: `dtype` is a torch-style
    name ("float32", "bfloat16", "float4_e2m1fn_x2") and is kept as its header code
    ("F32"); `shape` is the header shape, except for ``float4_e2m1fn_x2``, whose
    storage shape (two values a byte) has its last axis doubled, as the reference does.

    UNSAFE, as in the reference: `data_ptr` is a raw address of `data_len` bytes that
    the caller must keep valid and unchanged until every ``serialize`` call using
    this spec has returned. A wrong address crashes the interpreter. A list of
    ``WriteSpec`` holding the arrays themselves needs no pointer.
    """

    __slots__ = ("_dtype", "_shape", "_data_ptr", "_data_len")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int,
                 data_len: int) -> None:
        if type(dtype) is not str:
            raise TypeError(f"argument 'dtype': {type(dtype).__name__!r} object is not an "
                            f"instance of 'str'")
        dims = _unsigned_dims(shape)
        self._data_ptr = _unsigned("data_ptr", data_ptr)
        self._data_len = _unsigned("data_len", data_len)
        code = _CODE_OF_TORCH_NAME.get(dtype)
        if code is None:
            raise SafetensorError(f"Unknown dtype {dtype!r}. Supported dtypes: "
                                  f"{', '.join(_CODE_OF_TORCH_NAME)}")
        if code in _PACKED_PAIRS and dims:
            dims[-1] = _unsigned("shape", dims[-1] * 2)
        self._dtype, self._shape = code, dims

    dtype = property(operator.attrgetter("_dtype"),
                     doc='The header dtype code, e.g. ``"F32"`` (str).')
    data_ptr = property(operator.attrgetter("_data_ptr"),
                        doc="The raw address of the tensor's bytes (int).")
    data_len = property(operator.attrgetter("_data_len"),
                        doc="The number of bytes at `data_ptr` (int).")

    @property
    def shape(self) -> List[int]:
        """The header shape (for float4 pairs, the last axis doubled)."""
        return list(self._shape)

    def __repr__(self) -> str:
        return (f"TensorSpec(dtype={self._dtype!r}, shape={self._shape!r}, "
                f"data_ptr={self._data_ptr}, data_len={self._data_len})")


def _unsigned(what: str, value: Any) -> int:
    number = operator.index(value)
    if number < 0:
        raise OverflowError(f"argument {what!r}: can't convert negative int to unsigned")
    if number > UINT64_MAX:
        raise OverflowError(f"argument {what!r}: int too big to convert")
    return number


def _unsigned_dims(shape: Any) -> List[int]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
        raise TypeError(f"argument 'shape': {type(shape).__name__!r} object is not a "
                        f"sequence of integers")
    return [_unsigned("shape", dim) for dim in shape]


def serialize(tensor_dict: Union[Mapping[str, TensorSpec], Iterable[WriteSpec]],
              metadata: Optional[Dict[str, str]] = None, *, header_padding: int = 0,
              checksum: Optional[str] = None) -> bytes:
    """The bytes of a safetensors file holding the tensors described, as
    ``safetensors.serialize``: `tensor_dict` maps names to ``TensorSpec`` (raw
    pointers, see its warning), or is a list of ``WriteSpec`` (arrays).
    `header_padding` reserves room for later metadata edits (``update_metadata``);
    `checksum` is that of ``fastst.save``."""
    return plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding).to_bytes()


def serialize_file(tensor_dict: Union[Mapping[str, TensorSpec], Iterable[WriteSpec]],
                   filename: PathLike, metadata: Optional[Dict[str, str]] = None, *,
                   fsync: bool = False, header_padding: int = 0,
                   checksum: Optional[str] = None) -> None:
    """Write the tensors described to `filename`, atomically (see ``save_file``),
    as ``safetensors.serialize_file``. A failure to write is a SafetensorError, as
    there, with the OSError as its cause. `header_padding` reserves room for later
    metadata edits (``update_metadata``); `checksum` is that of ``fastst.save``."""
    plan = plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding)
    try:
        write_atomically(plan, filename, fsync=fsync)
    except OSError as error:
        raise SafetensorError(f"{os.fsdecode(filename)}: cannot write: {error}") from error


def deserialize(bytes: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """Every tensor of a safetensors buffer, in buffer order, as
    ``[(name, {"dtype": code, "shape": [...], "data": bytearray}), ...]``, as
    ``safetensors.deserialize``. The header is validated in full first."""
    reader = Reader()
    reader.open_buffer(bytes)
    try:
        data, start = memoryview(bytes).cast("B"), reader.data_start
        out = []
        for name in reader.offset_keys():
            info = reader.info(name)
            begin, end = info.data_offsets
            out.append((name, {"dtype": info.dtype, "shape": info.shape,
                               "data": bytearray(data[start + begin:start + end])}))
        return out
    finally:
        reader.close()


def _write_specs(tensor_dict: Any) -> List[WriteSpec]:
    if not isinstance(tensor_dict, Mapping):
        if isinstance(tensor_dict, (str, bytes)) or not hasattr(tensor_dict, "__iter__"):
            raise TypeError(f"tensor_dict must be a dict of str to TensorSpec, got "
                            f"{type(tensor_dict).__name__}")
        return list(tensor_dict)
    specs = []
    for name, spec in tensor_dict.items():
        if type(name) is not str:
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"tensor {name!r}: expected a fastst.TensorSpec, got "
                            f"{type(spec).__name__}")
        specs.append(WriteSpec(name, spec.dtype, spec.shape,
                               _bytes_at(name, spec.data_ptr, spec.data_len)))
    return specs


def _bytes_at(name: str, address: int, length: int) -> np.ndarray:
    """The `length` bytes at a raw address, as a uint8 array (not copied)."""
    if length == 0:
        return np.empty(0, np.uint8)
    if address == 0:
        raise SafetensorError(f"tensor {name!r}: data_ptr is NULL but data_len is {length}")
    import ctypes
    return np.frombuffer(memoryview((ctypes.c_char * length).from_address(address)).cast("B"),
                         dtype=np.uint8)


# ---------------------------------------------------------------------------
# Declare, then fill: the streaming writer
# ---------------------------------------------------------------------------

Declared = Union[Mapping[str, Tuple[Any, Sequence[int]]], Iterable[Tuple[str, Any, Sequence[int]]]]
SHOWN_GAPS = 4   # tensors, and ranges per tensor, listed when some are left unwritten


class StreamWriter:
    """A safetensors file declared whole, then filled in any order, in pieces.

    ``StreamWriter(filename, specs, metadata=None, *, fsync=False, header_padding=0,
    checksum=None)``:
    `specs` declares every tensor, as a mapping ``name -> (dtype, shape)`` or as
    ``(name, dtype, shape)`` triples, a dtype being a header code ("F32"), a NumPy
    dtype, or a torch dtype. The header and every tensor's place are computed at
    once; the file is preallocated beside `filename` under a temporary name, and
    filled by

    * ``write(name, array, start_row=0)``: a whole tensor, or rows
      ``[start_row, start_row + len(array))`` of it, from a NumPy array, anything
      with the buffer protocol, or a CPU tensor NumPy can view (torch);
    * ``write_bytes(name, data, start=0)``: raw bytes at a byte offset of a
      tensor, for dtypes the caller has no array type for;
    * ``view(name)``: a writable NumPy array over the tensor's bytes in the file
      (a shared map, as ``np.lib.format.open_memmap``) to fill in place; the
      tensor counts as written once the view is taken;
    * ``region(name)``: a picklable ``TensorRegion`` that other processes sharing
      the file system write rows to (dask workers); with ``detach()``, which hands
      the file over as a ``PendingFile`` for them to commit.

    Each piece is checked (name, dtype, row shape, range) before any byte is
    written. ``close()`` (or leaving the ``with`` block) renames the file over
    `filename` atomically, flushed to disk first with `fsync`; when a tensor is
    not fully written, or the block ends by an exception, or ``abort()`` is
    called, the temporary file is removed, any old file stays as it was, and
    ``close`` raises a SafetensorError naming the byte ranges left unwritten.

    The bytes are those ``save_file`` writes for the same tensors and metadata,
    whatever order the pieces came in. Memory stays bounded by the pieces the
    caller holds: nothing is buffered. With `checksum` (see ``fastst.save``) the
    header is written with room for the digests, every tensor is hashed from the
    file at ``close``, and the header is rewritten with them, before the rename:
    the bytes are still those of ``save_file(..., checksum=...)``.

    A view stays a window onto the file after ``close``: drop it first if later
    writes to the array must not reach the file.

    `filename` may be an fsspec URL (with `storage_options`): the file is then
    filled on local disk (in ``tempfile.gettempdir()``, which needs room for it)
    and uploaded at ``close``, as ``save_file`` uploads (on S3 and GCS in parts,
    the object appearing whole or not at all); an aborted writer uploads nothing.
    """

    def __init__(self, filename: PathLike, specs: Declared,
                 metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
                 header_padding: int = 0, checksum: Optional[str] = None,
                 storage_options: Optional[Mapping[str, Any]] = None) -> None:
        self._file: Optional[AtomicFile] = None
        self._upload = _spooled_upload(filename, storage_options)
        if self._upload is not None:
            filename = self._upload.path
        try:
            declared = declared_specs(specs)
            planned = metadata if checksum is None else reserved_checksums(declared, metadata,
                                                                           checksum)
            self._plan = plan_write(declared, planned, header_padding=header_padding)
        except SafetensorError as error:   # the same error, naming the file
            self.abort()
            raise type(error)(f"{self._target(filename)}: {error}") from None
        except BaseException:
            self.abort()
            raise
        self._checksum = checksum
        self._specs, self._metadata = declared, metadata
        self._fsync = fsync
        self._lock = threading.Lock()
        self._written: Dict[str, List[List[int]]] = {name: [] for name in self._plan.names()}
        self._maps: List[mmap.mmap] = []
        try:
            self._file = AtomicFile(filename, self._plan.total_size)
            self.name = self._file.target if self._upload is None else self._upload.url
            self._plan.write_prefix(self._file.fd, self.name)
        except BaseException:
            self.abort()
            raise

    def _target(self, filename: PathLike) -> str:
        return os.fsdecode(filename) if self._upload is None else self._upload.url

    def __enter__(self) -> "StreamWriter":
        return self

    def __exit__(self, exc_type: Any, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_file", None) is not None or getattr(self, "_upload", None):
            self.abort()

    @property
    def closed(self) -> bool:
        return self._file is None

    def names(self) -> List[str]:
        """The declared tensors, in file order."""
        return self._plan.names()

    def info(self, name: str) -> TensorInfo:
        """Tensor `name` as declared: dtype code, shape, data_offsets, array_shape."""
        return self._plan.info(name, self.name)

    def write(self, name: str, array: Any, start_row: int = 0) -> None:
        """Write `array` as tensor `name` whole, or as its rows from `start_row` on."""
        piece = _as_array(self.name, name, array)
        fd = self._open_fd()
        self._mark(name, self._plan.write_rows(fd, name, start_row, piece, self.name))

    def write_bytes(self, name: str, data: Any, start: int = 0) -> None:
        """Write the raw bytes of `data` at byte `start` of tensor `name`."""
        fd = self._open_fd()
        self._mark(name, self._plan.write_bytes(fd, name, start, data, self.name))

    def view(self, name: str) -> np.ndarray:
        """A writable array over tensor `name`'s bytes in the file, to fill in place."""
        fd = self._open_fd()
        info = self._plan.info(name, self.name)
        if info.array_shape is None:
            raise SafetensorError(f"{self.name}: tensor {name!r}: shape {info.shape} cannot "
                                  f"be a NumPy array; write its bytes with write_bytes")
        begin, end = info.data_offsets
        dtype = numpy_dtype(info.dtype)
        if end == begin:
            array = np.zeros(info.array_shape, dtype)
        else:
            start = self._plan.data_start + begin
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            try:
                mapped = mmap.mmap(fd, end - begin + start - aligned, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
            except (OSError, ValueError) as error:
                raise SafetensorNotImplementedError(
                    f"{self.name}: tensor {name!r}: this file cannot be mapped for "
                    f"writing ({error}); use write()") from None
            self._maps.append(mapped)
            # frombuffer holds an export of the map, so that close() cannot unmap it
            # while the caller still holds the array.
            array = np.frombuffer(mapped, dtype, (end - begin) // dtype.itemsize,
                                  start - aligned).reshape(info.array_shape)
        self._mark(name, (0, end - begin))
        return array

    def unwritten(self) -> Dict[str, List[Tuple[int, int]]]:
        """For each tensor not fully written, its unwritten byte ranges."""
        gaps = {}
        with self._lock:
            for name, ranges in self._written.items():
                begin, end = self._plan.info(name, self.name).data_offsets
                missing = _gaps(ranges, end - begin)
                if missing:
                    gaps[name] = missing
        return gaps

    def close(self) -> None:
        """Commit: rename the filled file over the target. Raises, and removes the
        file, when some tensor is not fully written. Closing again does nothing."""
        if self._file is None:
            return
        gaps = self.unwritten()
        if gaps:
            self.abort()
            raise SafetensorError(f"{self.name}: not written, so not saved: "
                                  f"{_describe_gaps(gaps)}")
        self._release_maps(flush=self._fsync)
        if self._checksum is not None:
            try:
                self._write_checksums(self._file.fd, self._checksum)
            except BaseException:
                self.abort()
                raise
        file, self._file = self._file, None
        file.commit(fsync=self._fsync)
        if self._upload is not None:
            self._upload.upload()

    def _write_checksums(self, fd: int, algorithm: str) -> None:
        """Hash every tensor from the file, then write the final header, with the
        digests, over the one of the same length written at the start."""
        digests = digests_in_file(fd, self._plan, algorithm)
        final = plan_write(self._specs, checksum_metadata(self._metadata, digests, algorithm),
                           header_size=self._plan.data_start - 8)
        final.write_prefix(fd, self.name)

    def region(self, name: str) -> TensorRegion:
        """A picklable target for tensor `name`'s bytes in the temporary file, that
        another process sharing the file system fills (see ``TensorRegion``); the
        tensor counts as written once the region is taken, as with ``view``."""
        fd = self._open_fd()
        os.fstat(fd)    # the file is still there
        info = self._plan.info(name, self.name)
        if info.array_shape is None:
            raise SafetensorError(f"{self.name}: tensor {name!r}: shape {info.shape} cannot "
                                  f"be a NumPy array; write its bytes with write_bytes")
        begin, end = info.data_offsets
        region = TensorRegion(self._file.temp, self.name, name, info.dtype, info.array_shape,
                              self._plan.data_start + begin, end - begin)
        self._mark(name, (0, end - begin))
        return region

    def detach(self) -> PendingFile:
        """Hand the temporary file over, as it is, to whoever finishes filling it
        (through regions, from other processes): the writer closes, and the
        returned ``PendingFile`` commits the file (renames it over the target) or
        aborts it. Not with `checksum`, whose digests are computed at ``close``."""
        if self._checksum is not None or self._upload is not None:
            raise SafetensorNotImplementedError(
                f"{self.name}: a file with checksums, or for a URL, is committed by "
                f"close(), not detached")
        self._open_fd()
        self._release_maps(flush=True)
        file, self._file = self._file, None
        os.close(file.fd)
        file.fd = -1
        return PendingFile(file.temp, file.target, fsync=self._fsync)

    def abort(self) -> None:
        """Drop the file being written; any old file stays as it was."""
        file, self._file = self._file, None
        if file is not None:
            self._release_maps(flush=False)
            file.abort()
        if self._upload is not None:
            self._upload.discard()

    def _open_fd(self) -> int:
        file = self._file
        if file is None:
            raise SafetensorError(f"{self.name}: the writer is closed")
        return file.fd

    def _mark(self, name: str, written: Tuple[int, int]) -> None:
        begin, end = written
        if begin == end:
            return
        with self._lock:
            _add_range(self._written[name], begin, end)

    def _release_maps(self, *, flush: bool) -> None:
        for mapped in self._maps:
            if flush:
                mapped.flush()
            try:
                mapped.close()
            except BufferError:   # the caller still holds a view: it keeps the map
                pass
        self._maps = []

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._written)} tensors"
        return f"<fastst.StreamWriter {self.name!r} ({state})>"


class TensorRegion:
    """Where one declared tensor's bytes go in a ``StreamWriter``'s temporary file,
    as ``StreamWriter.region`` gives it: the file's path, the tensor's byte offset,
    dtype and shape. It pickles as those, so that processes which share the file
    system (dask workers) write rows of the tensor in parallel, each write opening
    the file and writing with ``pwrite``, after checking the piece's dtype, row
    shape and range.

    ``region[first:last] = rows`` (or ``region[first:last, :, ...]``, as
    ``dask.array.store`` writes, whole rows only) is ``region.write(rows, first)``.
    """

    __slots__ = ("path", "target", "name", "dtype", "shape", "offset", "size")

    def __init__(self, path: str, target: str, name: str, dtype: str,
                 shape: Tuple[int, ...], offset: int, size: int) -> None:
        self.path, self.target, self.name = path, target, name
        self.dtype, self.shape = dtype, tuple(shape)
        self.offset, self.size = offset, size

    def __reduce__(self) -> Tuple[Any, ...]:
        return TensorRegion, (self.path, self.target, self.name, self.dtype, self.shape,
                              self.offset, self.size)

    def write(self, array: Any, start_row: int = 0) -> None:
        """Write `array` as rows ``[start_row, start_row + len(array))`` of the tensor
        (the whole tensor when it has no axis)."""
        piece = self._checked(_as_array(self.target, self.name, array), start_row)
        rows = len(piece) if self.shape else 1
        row_bytes = self.size // self.shape[0] if self.shape and self.shape[0] else self.size
        if piece.nbytes != rows * row_bytes:
            raise SafetensorError(f"{self.target}: tensor {self.name!r}: a piece of "
                                  f"{piece.nbytes} bytes does not fill {rows} rows")
        self._write_at(piece, self.offset + start_row * row_bytes)

    def __setitem__(self, index: Any, array: Any) -> None:
        """``region[first:last] = rows``: `rows` must fill the rows selected, all of
        them (a chunk of a dask array must have the shape of its block)."""
        first, end = self._rows(index if isinstance(index, tuple) else (index,))
        piece = _as_array(self.target, self.name, array)
        block = (end - first, *self.shape[1:]) if self.shape else ()
        if piece.shape != block:
            raise SafetensorError(f"{self.target}: tensor {self.name!r}: the block of rows "
                                  f"{first}:{end} has shape {block}, but its piece has shape "
                                  f"{piece.shape}")
        self.write(piece, first)

    def _checked(self, piece: np.ndarray, start_row: Any) -> np.ndarray:
        where = f"{self.target}: tensor {self.name!r}"
        expected = numpy_dtype(self.dtype)
        if spec_of_array(self.name, np.empty(0, piece.dtype)).dtype != self.dtype:
            raise SafetensorTypeError(f"{where} is {self.dtype}: its pieces must be "
                                      f"{expected} arrays, got {piece.dtype} at row "
                                      f"{start_row}")
        start = operator.index(start_row)
        if not self.shape:
            if piece.shape or start:
                raise SafetensorError(f"{where} has no axis: write it whole, got a piece "
                                      f"of shape {piece.shape} at row {start}")
        elif piece.shape[1:] != self.shape[1:] or not 0 <= start <= start + len(piece) \
                <= self.shape[0]:
            raise SafetensorError(f"{where} has shape {self.shape}: a piece of shape "
                                  f"{piece.shape} does not fit at row {start}")
        return np.ascontiguousarray(piece).astype(expected, copy=False)

    def _rows(self, index: Tuple[Any, ...]) -> Tuple[int, int]:
        """The first row and the row past the last of an index of slices that
        selects whole rows ((0, 0) for a tensor without axis)."""
        if not self.shape:
            if index not in ((), (Ellipsis,)):
                raise SafetensorError(f"{self.target}: tensor {self.name!r} has no axis: "
                                      f"write it whole, got index {index!r}")
            return 0, 0
        if len(index) > len(self.shape) or not all(isinstance(part, slice) for part in index):
            raise SafetensorError(f"{self.target}: tensor {self.name!r}: a region takes "
                                  f"slices of rows, got index {index!r}")
        for axis, part in enumerate(index):
            start, stop, step = part.indices(self.shape[axis])
            if step != 1 or (axis and (start, stop) != (0, self.shape[axis])):
                raise SafetensorError(f"{self.target}: tensor {self.name!r}: a region is "
                                      f"written in whole rows; index {index!r} cuts axis "
                                      f"{axis}")
        if not index:
            return 0, self.shape[0]
        start, stop, _ = index[0].indices(self.shape[0])
        return start, max(start, stop)

    def _write_at(self, piece: np.ndarray, position: int) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SafetensorError(f"{self.target}: tensor {self.name!r}: the file being "
                                  f"written is gone (committed or aborted)") from None
        try:
            write_array_at(fd, piece, position, self.target)
        finally:
            os.close(fd)

    def __repr__(self) -> str:
        return (f"<fastst.writer.TensorRegion {self.name!r} {self.dtype} {list(self.shape)} "
                f"of {self.target!r}>")


class PendingFile:
    """A ``StreamWriter``'s temporary file handed over by ``StreamWriter.detach``:
    its path, its target, and whether to flush it to disk. It pickles as those,
    so that the process that sees the last piece written commits it."""

    __slots__ = ("temp", "target", "fsync")

    def __init__(self, temp: str, target: str, *, fsync: bool = False) -> None:
        self.temp, self.target, self.fsync = temp, target, fsync

    def __reduce__(self) -> Tuple[Any, ...]:
        return _pending_file, (self.temp, self.target, self.fsync)

    def commit(self) -> None:
        """Rename the file over the target (flushed to disk first with `fsync`, and
        the directory after)."""
        try:
            AtomicFile.written(self.temp, self.target).commit(fsync=self.fsync)
        except FileNotFoundError:
            raise SafetensorError(f"{self.target}: the file being written is gone "
                                  f"(committed or aborted already)") from None

    def abort(self) -> None:
        """Remove the file; any old file at the target stays as it was."""
        AtomicFile.written(self.temp, self.target).abort()

    def __repr__(self) -> str:
        return f"<fastst.writer.PendingFile {self.target!r}>"


def _pending_file(temp: str, target: str, fsync: bool) -> PendingFile:
    return PendingFile(temp, target, fsync=fsync)


def _spooled_upload(filename: Any, storage_options: Optional[Mapping[str, Any]]) -> Any:
    """A SpooledUpload for a URL (see ``fastst.remote``), None for a path."""
    if not is_url(filename):
        if storage_options:
            raise SafetensorError("storage_options apply to URLs only")
        return None
    from .remote import SpooledUpload   # a capability: imported when used

    return SpooledUpload(filename, storage_options)


def declared_specs(specs: Declared) -> List[WriteSpec]:
    """WriteSpecs without sources from a mapping ``name -> (dtype, shape)`` or
    ``(name, dtype, shape)`` triples (a dtype: header code, NumPy or torch dtype)."""
    items = specs.items() if isinstance(specs, Mapping) else specs
    declared = []
    for item in items:
        if isinstance(specs, Mapping):
            name, (dtype, shape) = item[0], _pair(item)
        else:
            name, dtype, shape = _triple(item)
        code, shape = _code_and_shape(name, dtype, shape)
        declared.append(WriteSpec(name, code, shape, None))
    return declared


def _pair(item: Any) -> Tuple[Any, Any]:
    try:
        dtype, shape = item[1]
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"tensor {item[0]!r}: declare it as (dtype, shape), got "
                                  f"{type(item[1]).__name__}") from None
    return dtype, shape


def _triple(item: Any) -> Tuple[Any, Any, Any]:
    if isinstance(item, WriteSpec):
        return item.name, item.dtype, item.shape
    try:
        name, dtype, shape = item
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"declare each tensor as (name, dtype, shape), got "
                                  f"{type(item).__name__}") from None
    return name, dtype, shape


def _code_and_shape(name: Any, dtype: Any, shape: Any) -> Tuple[str, Any]:
    """The header code and shape a declared dtype stands for."""
    if isinstance(dtype, str) and dtype.isupper():
        return dtype, shape    # header codes are upper case; plan_write says if it is unknown
    text = str(dtype)
    if text.startswith("torch."):
        code = _CODE_OF_TORCH_NAME.get(text[len("torch."):])
        if code in _PACKED_PAIRS and len(shape):
            shape = (*shape[:-1], shape[-1] * 2)
        if code is not None:
            return code, shape
    try:
        code = spec_of_array(str(name), np.empty(0, np.dtype(dtype))).dtype
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"tensor {name!r}: dtype {dtype!r} has no safetensors "
                                  f"code") from None
    return code, shape


def _as_array(target: str, name: str, data: Any) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return data
    if isinstance(data, np.generic):
        return np.asarray(data)
    torch = sys.modules.get("torch")     # a torch tensor means torch is imported
    if torch is not None and isinstance(data, torch.Tensor):
        return _torch_as_numpy(torch, data)
    try:
        return np.asarray(memoryview(data))
    except TypeError:
        pass
    if hasattr(data, "__array__") or hasattr(data, "__dlpack__"):
        try:
            return np.asarray(data)
        except (TypeError, ValueError, RuntimeError) as error:
            raise SafetensorTypeError(
                f"{target}: tensor {name!r}: NumPy cannot view this "
                f"{type(data).__name__} ({error}); write its raw bytes with write_bytes") from None
    raise SafetensorTypeError(f"{target}: tensor {name!r}: expected an array or a buffer, got "
                              f"{type(data).__name__}")


def _torch_as_numpy(torch: Any, tensor: Any) -> np.ndarray:
    """A NumPy array over a torch tensor's bytes (copied to the CPU if need be), of
    the NumPy dtype its code surfaces as: bfloat16 and float8 become ml_dtypes arrays,
    which NumPy cannot make from torch itself."""
    code = _CODE_OF_TORCH_NAME.get(str(tensor.dtype).replace("torch.", "", 1))
    if code is None or code in _PACKED_PAIRS:
        return np.asarray(tensor)      # NumPy's own error says why it cannot
    tensor = tensor.detach().cpu()
    same_width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    raw = tensor.view(same_width[tensor.element_size()]).numpy()
    return raw.view(numpy_dtype(code))


def _add_range(ranges: List[List[int]], begin: int, end: int) -> None:
    """Merge [begin, end) into sorted, disjoint, non-touching `ranges`."""
    i = bisect.bisect_left(ranges, [begin])
    if i > 0 and ranges[i - 1][1] >= begin:
        i -= 1
    j = i
    while j < len(ranges) and ranges[j][0] <= end:
        begin, end = min(begin, ranges[j][0]), max(end, ranges[j][1])
        j += 1
    ranges[i:j] = [[begin, end]]


def _gaps(ranges: List[List[int]], size: int) -> List[Tuple[int, int]]:
    gaps, position = [], 0
    for begin, end in ranges:
        if begin > position:
            gaps.append((position, begin))
        position = end
    if position < size:
        gaps.append((position, size))
    return gaps


def _describe_gaps(gaps: Dict[str, List[Tuple[int, int]]]) -> str:
    parts = []
    for name in list(gaps)[:SHOWN_GAPS]:
        ranges = gaps[name]
        shown = ", ".join(f"[{begin}, {end})" for begin, end in ranges[:SHOWN_GAPS])
        more = f" and {len(ranges) - SHOWN_GAPS} more" if len(ranges) > SHOWN_GAPS else ""
        parts.append(f"tensor {name!r} bytes {shown}{more}")
    more = f"; and {len(gaps) - SHOWN_GAPS} more tensors" if len(gaps) > SHOWN_GAPS else ""
    return "; ".join(parts) + more


# ---------------------------------------------------------------------------
# Write from a producer
# ---------------------------------------------------------------------------


def save_file_from(specs: Declared, tensors: Any, filename: PathLike,
                   metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
                   header_padding: int = 0, checksum: Optional[str] = None,
                   storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Save tensors produced one at a time, holding one in memory at once.

    `tensors` is an iterable of ``(name, tensor)`` pairs, in any order, or a lazy
    mapping (anything with ``keys()`` and ``[name]``, such as an open file), read
    one name at a time in file order; from a mapping only the declared tensors
    are taken, so that specs can pick some tensors of a file. Why `specs` as well: a safetensors file
    starts with its header, which gives every tensor's dtype, shape and byte range,
    so every tensor's dtype and shape must be known before the first data byte has
    a place; without them the writer would have to hold every tensor (or write the
    data twice). ``specs_of(open_file)`` gives them for a copy of a file.

    The file is written as ``StreamWriter`` writes it: atomically, and identical to
    ``save_file`` of the same tensors (`checksum` included); to a URL, through a
    local spool, uploaded when complete.
    """
    with StreamWriter(filename, specs, metadata, fsync=fsync, header_padding=header_padding,
                      checksum=checksum, storage_options=storage_options) as writer:
        if hasattr(tensors, "keys") and hasattr(tensors, "__getitem__"):
            available = set(tensors.keys())
            for name in writer.names():
                if name in available:
                    writer.write(name, tensors[name])
            return
        seen = set()
        for item in tensors:
            name, tensor = item
            if name in seen:
                raise SafetensorError(f"{writer.name}: tensor {name!r} is produced twice")
            seen.add(name)
            writer.write(name, tensor)


def specs_of(source: Any) -> List[WriteSpec]:
    """The declared specs of every tensor of an open file (a ``safe_open`` or core
    Reader), in its buffer order: what ``save_file_from`` needs to copy it."""
    specs = []
    for name in source.offset_keys():
        info = source.info(name)
        specs.append(WriteSpec(name, info.dtype, info.shape, None))
    return specs


# ---------------------------------------------------------------------------
# Metadata edits
# ---------------------------------------------------------------------------


def update_metadata(filename: PathLike, metadata: Optional[Mapping[str, str]], *,
                    fsync: bool = False, header_padding: int = 0, in_place: bool = True) -> bool:
    """Replace the ``__metadata__`` of a safetensors file (None removes it).

    When the new header, with `header_padding` bytes to spare, fits in the old
    header's room (a header may end in spaces, which ``header_padding`` on the
    writers reserves), only the header bytes are rewritten, in place: the
    tensors are not touched. Otherwise the file is rewritten atomically: the new
    header with `header_padding` spaces of room for later edits, then the tensor
    bytes copied in bounded memory. Returns True when the edit was made in place.

    An in-place edit is one write of the header bytes, not atomic: a reader, or
    a crash, in the middle of it may see a header part old, part new. Where that
    matters, pass ``in_place=False`` for an atomic rewrite.

    The tensors' checksums (``fastst.integrity``), which describe bytes the edit
    does not change, are kept unless `metadata` gives that key itself.
    """
    reader = Reader()
    reader.open_file(filename, "pread")
    try:
        metadata = _keeping_checksums(reader.metadata(), metadata)
        specs = specs_of(reader)
        old_room = reader.data_start - 8
        plan = plan_write(specs, metadata, keep_order=True)
        _check_same_layout(reader, plan, specs)
        if in_place and len(plan.prefix.rstrip(b" ")) - 8 + header_padding <= old_room:
            _rewrite_header(plan_write(specs, metadata, keep_order=True, header_size=old_room),
                            filename, fsync)
            return True
        plan = plan_write(specs, metadata, keep_order=True, header_padding=header_padding)
        _rewrite_file(plan, reader, filename, fsync)
        return False
    finally:
        reader.close()


def _keeping_checksums(old: Optional[Mapping[str, str]],
                       new: Optional[Mapping[str, str]]) -> Optional[Mapping[str, str]]:
    if old is None or CHECKSUM_KEY not in old or (new is not None and CHECKSUM_KEY in new):
        return new
    return {**(new or {}), CHECKSUM_KEY: old[CHECKSUM_KEY]}


def _check_same_layout(reader: Reader, plan: WritePlan, specs: List[WriteSpec]) -> None:
    for spec in specs:
        if plan.info(spec.name).data_offsets != reader.info(spec.name).data_offsets:
            raise SafetensorError(f"{reader.source}: tensor {spec.name!r}: its bytes are not "
                                  f"where a rewritten header would place them")


def _rewrite_header(plan: WritePlan, filename: PathLike, fsync: bool) -> None:
    fd = os.open(filename, os.O_WRONLY | os.O_CLOEXEC)
    try:
        plan.write_prefix(fd, os.fsdecode(filename))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite_file(plan: WritePlan, reader: Reader, filename: PathLike, fsync: bool) -> None:
    data_size = plan.total_size - plan.data_start
    file = AtomicFile(filename, plan.total_size)
    try:
        plan.write_prefix(file.fd, file.target)
        source = os.open(filename, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(source).st_size != reader.data_start + data_size:
                raise SafetensorError(f"{reader.source}: the file changed while its "
                                      f"metadata was being edited")
            copy_range(source, reader.data_start, file.fd, plan.data_start, data_size)
        finally:
            os.close(source)
    except BaseException:
        file.abort()
        raise
    file.commit(fsync=fsync)
