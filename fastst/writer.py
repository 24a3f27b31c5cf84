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

Below them, the plan every writer writes through: ``spec_of_array`` and
``WriteSpec`` describe a tensor, ``plan_write`` places them and builds the header
(a ``WritePlan``), ``write_atomically`` puts a plan in place of a file.

Examples
--------
A dtype NumPy has no type for, written from its packed bytes:

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
import threading
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ._core import (DTYPES, MAX_ALIGN, SafetensorError, SafetensorNotImplementedError,
                    SafetensorTypeError, TensorInfo, WritePlan, WriteSpec, numpy_dtype,
                    plan_write, spec_of_array, write_array_at)
from ._format.checksums import checksum_metadata, digests_in_file, reserved_checksums
from ._format.lowlevel import TensorSpec, deserialize, serialize, serialize_file
from ._frameworks.specs import Declared, declared_specs, piece_of, specs_of
from ._handles.edit import update_metadata
from ._io.files import AtomicFile, PathLike, write_atomically
from ._io.source import as_source

__all__ = ["MAX_ALIGN", "PendingFile", "StreamWriter", "TensorRegion", "TensorSpec", "WritePlan", "WriteSpec",
           "declared_specs", "deserialize", "plan_write", "save_file_from", "serialize",
           "serialize_file", "spec_of_array", "specs_of", "update_metadata", "write_atomically"]

SHOWN_GAPS = 4   # tensors, and ranges per tensor, listed when some are left unwritten
NUMPY_NAMES = {row.code: row.numpy for row in DTYPES}    # header code -> its NumPy dtype's


class StreamWriter:
    """A safetensors file declared whole, then filled in any order, in pieces.

    Every tensor is declared first: the header and every tensor's place are
    computed at once, and the file is preallocated beside `filename` under a
    temporary name, then filled by

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

    Parameters
    ----------
    filename : str or bytes or os.PathLike or URL
        The file to write.
    specs : mapping or iterable
        Every tensor, as a mapping ``name -> (dtype, shape)`` or as
        ``(name, dtype, shape)`` triples; a dtype is a header code
        (``"F32"``), a NumPy dtype or a torch dtype (see
        ``declared_specs``).
    metadata : mapping of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk at ``close``.
    header_padding : int, default 0
        Bytes of spaces reserved after the header (see ``fastst.save_file``).
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum, computed from the file at ``close``.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``): the bytes of ``save_file(...,
        align=align)``.

    Attributes
    ----------
    name : str
        The target's path (or URL, its credentials hidden), as messages give it.

    Raises
    ------
    SafetensorError
        When the declared tensors are not valid (a name twice, a bad shape);
        `SafetensorTypeError` for a dtype with no code.
    OSError
        When the file cannot be created (its directory is missing, no
        permission, no room to preallocate it).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.writer import StreamWriter
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> with StreamWriter(path, {"x": ("F32", (4, 2)), "y": (np.int8, (3,))}) as writer:
    ...     writer.write("x", np.ones((2, 2), np.float32), start_row=2)   # rows 2 and 3
    ...     writer.write("x", np.zeros((2, 2), np.float32))               # rows 0 and 1
    ...     writer.view("y")[:] = [7, 8, 9]                               # in place
    >>> fastst.load_file(path)["x"][:, 0].tolist(), fastst.load_file(path)["y"].tolist()
    ([0.0, 0.0, 1.0, 1.0], [7, 8, 9])

    A tensor left unwritten: nothing is saved.

    >>> writer = StreamWriter(path, {"z": ("I8", (2,))})
    >>> writer.close()
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorError: ...: not written, so not saved: tensor 'z' bytes [0, 2)
    """

    def __init__(self, filename: PathLike, specs: Declared,
                 metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
                 header_padding: int = 0, checksum: Optional[str] = None,
                 storage_options: Optional[Mapping[str, Any]] = None,
                 align: Optional[int] = None) -> None:
        self._file: Optional[AtomicFile] = None
        self._upload = as_source(filename, storage_options, writing=True).spool()
        if self._upload is not None:
            filename = self._upload.path
        try:
            declared = declared_specs(specs)
            planned = metadata if checksum is None else reserved_checksums(declared, metadata,
                                                                           checksum)
            self._plan = plan_write(declared, planned, header_padding=header_padding,
                                    align=align)
        except SafetensorError as error:   # the same error, naming the file
            self.abort()
            raise type(error)(f"{self._target(filename)}: {error}") from None
        except BaseException:
            self.abort()
            raise
        self._checksum = checksum
        self._specs, self._metadata, self._align = declared, metadata, align
        self._fsync = fsync
        self._lock = threading.Lock()
        self._written: Dict[str, List[List[int]]] = {name: [] for name in self._plan.names()}
        self._maps: List[mmap.mmap] = []
        try:
            self._file = AtomicFile(filename, self._plan.total_size)
            self.name = self._file.target if self._upload is None else self._upload.label
            self._plan.write_prefix(self._file.fd, self.name)
        except BaseException:
            self.abort()
            raise

    def _target(self, filename: PathLike) -> str:
        return os.fsdecode(filename) if self._upload is None else self._upload.label

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

    def __reduce__(self) -> Tuple[Any, ...]:
        raise TypeError(f"{self.name}: a StreamWriter cannot be pickled: it owns the file it "
                        f"fills in this process; pass another process writer.region(name) "
                        f"(or writer.detach() to hand the whole file over)")

    @property
    def closed(self) -> bool:
        """Whether the writer is done: committed, aborted or detached."""
        return self._file is None

    def names(self) -> List[str]:
        """The declared tensors' names, in file order.

        Returns
        -------
        list of str
        """
        return self._plan.names()

    def info(self, name: str) -> TensorInfo:
        """Tensor `name` as declared: dtype code, shape, data offsets, array shape.

        Returns
        -------
        TensorInfo

        Raises
        ------
        TensorNotFoundError
            When no tensor `name` was declared.
        """
        return self._plan.info(name, self.name)

    def write(self, name: str, array: Any, start_row: int = 0) -> None:
        """Write `array` as tensor `name` whole, or as its rows from `start_row` on.

        Parameters
        ----------
        name : str
            A declared tensor.
        array : array_like
            A NumPy array (or anything with the buffer protocol, or a CPU
            tensor NumPy can view: torch's) of the tensor's NumPy dtype, whose
            rows have the tensor's row shape; either byte order.
        start_row : int, default 0
            The row of the tensor where `array`'s first row goes.

        Raises
        ------
        TensorNotFoundError
            When no tensor `name` was declared.
        SafetensorTypeError
            When the array's dtype is not the tensor's.
        SafetensorIndexError
            When the rows reach outside the tensor.
        SafetensorError
            When the writer is closed, or the row shape is not the tensor's.
        OSError
            When the write fails.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.writer import StreamWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> with StreamWriter(path, {"x": ("I16", (3,))}) as writer:
        ...     writer.write("x", np.array([5, 6], np.int16), start_row=1)
        ...     writer.write("x", np.array([4], np.int16))
        >>> fastst.load_file(path)["x"].tolist()
        [4, 5, 6]
        """
        piece, bits_of = piece_of(self.name, name, array)
        fd = self._open_fd()
        self._mark(name, self._plan.write_rows(fd, name, start_row, piece, self.name, bits_of))

    def write_bytes(self, name: str, data: Any, start: int = 0) -> None:
        """Write the raw bytes of `data` at byte `start` of tensor `name`: for
        dtypes the caller has no array type for (F4, F6, float8 without ml_dtypes).

        Parameters
        ----------
        name : str
            A declared tensor.
        data : bytes-like object
            Any C-contiguous buffer.
        start : int, default 0
            The byte of the tensor where `data` goes.

        Raises
        ------
        TensorNotFoundError
            When no tensor `name` was declared.
        SafetensorError
            When the bytes reach outside the tensor, or the writer is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.writer import StreamWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> with StreamWriter(path, {"f4": ("F4", (4,))}) as writer:   # 4 values, 2 bytes
        ...     writer.write_bytes("f4", bytes([0x21, 0x43]))
        >>> fastst.load_file(path)["f4"].tolist()
        [33, 67]
        """
        fd = self._open_fd()
        self._mark(name, self._plan.write_bytes(fd, name, start, data, self.name))

    def view(self, name: str) -> np.ndarray:
        """A writable array over tensor `name`'s bytes in the file, to fill in place.

        A shared map of the file, as ``np.lib.format.open_memmap`` gives: what
        is written to the array is written to the file. The tensor counts as
        written once the view is taken. The view stays a window onto the file
        after ``close``: drop it first if later writes to the array must not
        reach the file.

        Parameters
        ----------
        name : str
            A declared tensor.

        Returns
        -------
        numpy.ndarray
            Of the tensor's NumPy dtype and array shape.

        Raises
        ------
        TensorNotFoundError
            When no tensor `name` was declared.
        SafetensorError
            When NumPy cannot hold the tensor's shape, or the writer is closed.
        SafetensorNotImplementedError
            When the file system cannot map the file for writing.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.writer import StreamWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> with StreamWriter(path, {"x": (np.float64, (2, 2))}) as writer:
        ...     x = writer.view("x")
        ...     x[:] = np.eye(2)
        >>> del x
        >>> fastst.load_file(path)["x"].tolist()
        [[1.0, 0.0], [0.0, 1.0]]
        """
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
        """For each tensor not fully written, its unwritten byte ranges.

        Returns
        -------
        dict of str to list of (int, int)
            ``[begin, end)`` byte ranges, relative to each tensor's start;
            empty once every tensor is written.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.writer import StreamWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> writer = StreamWriter(path, {"x": ("F32", (4,))})
        >>> writer.write("x", np.ones(2, np.float32), start_row=1)
        >>> writer.unwritten()
        {'x': [(0, 4), (12, 16)]}
        >>> writer.abort()
        """
        gaps = {}
        with self._lock:
            for name, ranges in self._written.items():
                begin, end = self._plan.info(name, self.name).data_offsets
                missing = _gaps(ranges, end - begin)
                if missing:
                    gaps[name] = missing
        return gaps

    def close(self) -> None:
        """Commit: rename the filled file over the target (flushed to disk first
        with `fsync`, checksums computed first with `checksum`, uploaded after
        for a URL). Closing again does nothing.

        Raises
        ------
        SafetensorError
            When some tensor is not fully written, naming the byte ranges left
            unwritten: the file is removed, and any old file stays as it was.
        OSError
            When the file cannot be renamed or flushed.
        """
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
                           header_size=self._plan.data_start - 8, align=self._align)
        final.write_prefix(fd, self.name)

    def region(self, name: str) -> TensorRegion:
        """A picklable target for tensor `name`'s bytes in the temporary file, that
        another process sharing the file system fills.

        The tensor counts as written once the region is taken, as with
        `view`: filling it is the taker's job (see `detach`).

        Parameters
        ----------
        name : str
            A declared tensor.

        Returns
        -------
        TensorRegion

        Raises
        ------
        TensorNotFoundError
            When no tensor `name` was declared.
        SafetensorError
            When NumPy cannot hold the tensor's shape, or the writer is closed.

        Examples
        --------
        See `detach`.
        """
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
        (through regions, from other processes).

        The writer closes; the returned `PendingFile` commits the file (renames
        it over the target) or aborts it. This is how ``fastst.dask`` writes
        chunks from many workers.

        Returns
        -------
        PendingFile

        Raises
        ------
        SafetensorNotImplementedError
            With `checksum`, whose digests are computed at `close`, or for a
            URL.
        SafetensorError
            When the writer is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.writer import StreamWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> import pickle
        >>> writer = StreamWriter(path, {"x": ("I32", (4,))})
        >>> region = pickle.loads(pickle.dumps(writer.region("x")))   # as a worker gets it
        >>> pending = writer.detach()
        >>> region[0:2] = np.array([1, 2], np.int32)
        >>> region.write(np.array([3, 4], np.int32), 2)
        >>> pending.commit()
        >>> fastst.load_file(path)["x"].tolist()
        [1, 2, 3, 4]
        """
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
        """Drop the file being written; any old file stays as it was. Aborting a
        closed writer does nothing."""
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

    Parameters
    ----------
    path : str
        The temporary file being written.
    target : str
        The file it will become, as messages name it.
    name : str
        The tensor.
    dtype : str
        Its header dtype code.
    shape : tuple of int
        Its NumPy array shape.
    offset : int
        Where its bytes start in the file.
    size : int
        Its bytes.

    Examples
    --------
    See ``StreamWriter.detach``.
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
        (the whole tensor when it has no axis).

        Parameters
        ----------
        array : array_like
            Rows of the tensor's dtype and row shape.
        start_row : int, default 0
            The row where `array`'s first row goes.

        Raises
        ------
        SafetensorTypeError
            When the array's dtype is not the tensor's.
        SafetensorError
            When the rows do not fit the tensor, or the file is gone
            (committed or aborted).
        OSError
            When the write fails.
        """
        self._write(*piece_of(self.target, self.name, array), start_row)

    def _write(self, piece: np.ndarray, bits_of: Optional[str], start_row: Any) -> None:
        piece = self._checked(piece, bits_of, start_row)
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
        piece, bits_of = piece_of(self.target, self.name, array)
        block = (end - first, *self.shape[1:]) if self.shape else ()
        if piece.shape != block:
            raise SafetensorError(f"{self.target}: tensor {self.name!r}: the block of rows "
                                  f"{first}:{end} has shape {block}, but its piece has shape "
                                  f"{piece.shape}")
        self._write(piece, bits_of, first)

    def _checked(self, piece: np.ndarray, bits_of: Optional[str], start_row: Any
                 ) -> np.ndarray:
        """`piece`, checked to fit, as the C-ordered array of the tensor's dtype to
        write; the bits of a dtype NumPy lacks (see ``piece_of``) stay as they are."""
        where = f"{self.target}: tensor {self.name!r}"
        code = bits_of or spec_of_array(self.name, np.empty(0, piece.dtype)).dtype
        if code != self.dtype:
            got = piece.dtype if bits_of is None else NUMPY_NAMES[bits_of]
            raise SafetensorTypeError(f"{where} is {self.dtype}: its pieces must be "
                                      f"{NUMPY_NAMES[self.dtype]} arrays, got {got} at row "
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
        piece = np.ascontiguousarray(piece)
        return piece if bits_of else piece.astype(numpy_dtype(self.dtype), copy=False)

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
    """A ``StreamWriter``'s temporary file, handed over by ``StreamWriter.detach``,
    for whoever finishes it to commit or abort.

    It pickles as its path, its target and whether to flush it to disk, so
    that the process that sees the last piece written commits it.

    Parameters
    ----------
    temp : str
        The temporary file.
    target : str
        The file it becomes when committed.
    fsync : bool, default False
        Flush it, and its directory, to disk at commit.

    Examples
    --------
    See ``StreamWriter.detach``.
    """

    __slots__ = ("temp", "target", "fsync")

    def __init__(self, temp: str, target: str, *, fsync: bool = False) -> None:
        self.temp, self.target, self.fsync = temp, target, fsync

    def __reduce__(self) -> Tuple[Any, ...]:
        return _pending_file, (self.temp, self.target, self.fsync)

    def commit(self) -> None:
        """Rename the file over the target (flushed to disk first with `fsync`, and
        the directory after).

        Raises
        ------
        SafetensorError
            When the file is gone: committed or aborted already.
        """
        try:
            AtomicFile.written(self.temp, self.target).commit(fsync=self.fsync)
        except FileNotFoundError:
            raise SafetensorError(f"{self.target}: the file being written is gone "
                                  f"(committed or aborted already)") from None

    def abort(self) -> None:
        """Remove the file; any old file at the target stays as it was. Aborting
        again does nothing."""
        AtomicFile.written(self.temp, self.target).abort()

    def __repr__(self) -> str:
        return f"<fastst.writer.PendingFile {self.target!r}>"


def _pending_file(temp: str, target: str, fsync: bool) -> PendingFile:
    return PendingFile(temp, target, fsync=fsync)


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


def save_file_from(specs: Declared, tensors: Any, filename: PathLike,
                   metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False,
                   header_padding: int = 0, checksum: Optional[str] = None,
                   storage_options: Optional[Mapping[str, Any]] = None,
                   align: Optional[int] = None) -> None:
    """Save tensors produced one at a time, holding one in memory at once.

    Why `specs` as well: a safetensors file starts with its header, which gives
    every tensor's dtype, shape and byte range, so every tensor's dtype and
    shape must be known before the first data byte has a place; without them
    the writer would have to hold every tensor (or write the data twice).
    ``specs_of(open_file)`` gives them for a copy of a file.

    The file is written as `StreamWriter` writes it: atomically, and identical
    to ``save_file`` of the same tensors (`checksum` included); to a URL,
    through a local spool, uploaded when complete.

    Parameters
    ----------
    specs : mapping or iterable
        Every tensor, as a mapping ``name -> (dtype, shape)`` or as
        ``(name, dtype, shape)`` triples (see ``declared_specs``).
    tensors : iterable of (str, array) or mapping
        ``(name, tensor)`` pairs, in any order, or a lazy mapping (anything
        with ``keys()`` and ``[name]``, such as an open file), read one name at
        a time in file order; from a mapping only the declared tensors are
        taken, so that specs can pick some tensors of a file.
    filename : str or bytes or os.PathLike or URL
        The file to write.
    metadata : mapping of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk before returning.
    header_padding : int, default 0
        Bytes of spaces reserved after the header (see ``fastst.save_file``).
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).

    Raises
    ------
    SafetensorError
        When a tensor is produced twice, or a declared one is never
        produced (nothing is saved then), or a tensor does not match its
        declaration (`SafetensorTypeError` for its dtype).
    OSError
        When the file cannot be written.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.writer import save_file_from
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> specs = {f"layer{i}": ("F32", (2,)) for i in range(3)}
    >>> produced = ((name, np.full(2, i, np.float32)) for i, name in enumerate(specs))
    >>> save_file_from(specs, produced, path)
    >>> fastst.load_file(path)["layer2"].tolist()
    [2.0, 2.0]
    """
    with StreamWriter(filename, specs, metadata, fsync=fsync, header_padding=header_padding,
                      checksum=checksum, storage_options=storage_options,
                      align=align) as writer:
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
