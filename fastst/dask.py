"""Dask arrays over the tensors of a safetensors file, and dask arrays written to one.

- ``from_safetensors(source, name=None, chunks="auto")``: a lazy ``dask.array``
  per tensor, each chunk a range of rows read in one ``pread`` (or one ranged
  request, for a URL) when the graph runs.
- ``to_safetensors(arrays, path)``: every chunk written in parallel, straight to
  its place in the file, which appears atomically when all are written.

The graphs hold how to reopen the file (its path, or URL and storage options, and
its identity: device, inode, size, modification time), tensor names and row
ranges: no open file. They pickle small and run on ``dask.distributed`` workers,
which must see the same file system as the client (for a URL, the same store).
Each worker process keeps the files it has opened, so that a chunk costs one read,
not a header parse; a file changed after the graph was built is refused with a
SafetensorError when a chunk of it is read.

This module imports dask; ``import fastst`` does not import it.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> from fastst.dask import from_safetensors, to_safetensors
>>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
>>> fastst.save_file({"x": np.arange(12.0).reshape(6, 2)}, path)
>>> x = from_safetensors(path, "x", chunks=4)
>>> x.chunks, float(x.sum().compute())
(((4, 2), (2,)), 66.0)
>>> to_safetensors({"y": x * 2}, path)
>>> fastst.load_file(path)["y"][-1].tolist()
[20.0, 22.0]
"""
from __future__ import annotations

import pickle
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import dask
import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph
from dask.utils import parse_bytes

from ._api import safe_open
from ._core import DTYPES, SafetensorError, SafetensorNotImplementedError, SafetensorTypeError
from ._core import numpy_dtype
from ._io.files import PathLike
from ._io.source import Source, as_source, identity_of
from .writer import PendingFile, StreamWriter

__all__ = ["from_safetensors", "open_files_kept", "to_safetensors"]

Chunks = Union[str, int, Sequence[Any], Mapping[int, Any]]
SUB_BYTE = {row.code for row in DTYPES if row.bits < 8}
OPEN_FILES_KEPT = 32     # open files each process keeps for the chunks it reads


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def from_safetensors(source: Any, name: Union[str, Sequence[str], None] = None,
                     chunks: Chunks = "auto", *, backend: Optional[str] = None,
                     storage_options: Optional[Mapping[str, Any]] = None
                     ) -> Union[da.Array, Dict[str, da.Array]]:
    """Tensors of a safetensors file as lazy dask arrays.

    Parameters
    ----------
    source : str or os.PathLike
        A ``.safetensors`` file, a sharded checkpoint (its directory or
        ``*.index.json``: each tensor is read from its shard), or a URL that
        ``safe_open`` opens (with `storage_options`).
    name : str, sequence of str or None
        One tensor (a dask array is returned), several, or None for every tensor
        (a dict name -> dask array, in the file's order).
    chunks : "auto" or int or str or tuple or dict
        How the first axis is cut: ``"auto"`` (dask's ``array.chunk-size``), an
        int (rows a chunk), a size such as ``"64 MiB"``, or dask's per-axis forms
        (a tuple, ``{0: 1000}``, explicit row counts ``((500, 500, 24),)``).
        Only the first axis is cut; every other axis is whole in each chunk
        (see Notes). Rechunk the array for other cuts.
    backend : "pread" or "mmap" or None, default None
        How workers read a local file: ``"pread"`` (the default for paths)
        reads each chunk into fresh memory; ``"mmap"`` maps the file in each
        worker. None for a URL lets ``safe_open`` choose.
    storage_options : mapping, optional
        Passed to ``safe_open`` for a URL (credentials, endpoint...).

    Returns
    -------
    dask.array.Array or dict of str to dask.array.Array
        One array when `name` is a str, else a dict name -> array, in the
        order given (or the file's). bfloat16 and float8 tensors come as
        ml_dtypes arrays.

    Raises
    ------
    TensorNotFoundError
        When a name is not a tensor of the file.
    SafetensorNotImplementedError
        For a sub-byte tensor (F4, F6), which packs several values a byte, or
        a file no other process can open again (a file object).
    SafetensorError
        For a tensor without an axis (read those with ``safe_open``), or
        `chunks` that cut another axis or do not fit the shape.
    SafetensorTypeError
        When `name` is not a str, a list of them or None.
    FileNotFoundError
        When the file does not exist.

    Notes
    -----
    Why only the first axis is cut: the file stores a tensor row after row, so
    a range of whole rows is one contiguous run of bytes, one read; a chunk
    that cut another axis would be a strided gather of many small pieces.

    Each chunk is read when the graph runs, by the process that runs its task;
    the graph holds how to reopen the file, the tensor's name and the chunk's
    rows, never an open file. Names are deterministic: the same file and chunks
    give the same keys, a changed file new ones.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.dask import from_safetensors
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> x, y = np.arange(12.0).reshape(6, 2), np.arange(6, dtype=np.int32)
    >>> fastst.save_file({"x": x, "y": y}, path)
    >>> arrays = from_safetensors(path, chunks="16 B")          # 16 bytes of rows a chunk
    >>> arrays["x"].chunks, arrays["y"].chunks
    (((1, 1, 1, 1, 1, 1), (2,)), ((4, 2),))
    >>> float(arrays["x"][:, 1].sum().compute())
    36.0
    """
    with _open(source, backend, storage_options) as handle:
        names = handle.offset_keys() if name is None else _names(handle.source, name)
        if hasattr(handle, "shard_file"):
            arrays = _from_shards(handle, names, chunks, backend, storage_options)
        else:
            opening = _opening(handle)
            arrays = {each: _tensor_array(handle, opening, each, chunks) for each in names}
    return arrays[name] if isinstance(name, str) else arrays


def _names(source: str, name: Any) -> List[str]:
    names = [name] if isinstance(name, str) else list(name) \
        if isinstance(name, (list, tuple)) else None
    if names is None or not all(isinstance(each, str) for each in names):
        raise SafetensorTypeError(f"{source}: name must be a tensor name, a list of them or "
                                  f"None, got {name!r}")
    return names


def _from_shards(checkpoint: Any, names: List[str], chunks: Chunks, backend: Optional[str],
                 storage_options: Optional[Mapping[str, Any]]) -> Dict[str, da.Array]:
    """A sharded checkpoint's tensors, each read from its shard (each shard opened once)."""
    by_shard: Dict[str, Tuple[Source, List[str]]] = {}
    for each in names:
        shard = checkpoint.shard_source(each)
        by_shard.setdefault(shard.label, (shard, []))[1].append(each)
    found: Dict[str, da.Array] = {}
    for shard, tensors in by_shard.values():
        found.update(from_safetensors(shard, tensors, chunks, backend=backend))
    return {each: found[each] for each in names}


def _open(target: Any, backend: Optional[str],
          storage_options: Optional[Mapping[str, Any]]) -> Any:
    return safe_open(as_source(target, storage_options, backend=backend or "pread"), "np")


def _opening(handle: Any) -> bytes:
    """How to reopen `handle`'s file anywhere: the handle pickled (its path or URL,
    backend, and the file's identity, checked when it is unpickled)."""
    try:
        return pickle.dumps(handle)
    except (pickle.PicklingError, TypeError, AttributeError, SafetensorError) as error:
        raise SafetensorNotImplementedError(
            f"{handle.source}: this file cannot be reopened by another process ({error}), "
            f"so it cannot back a dask array") from None


def _tensor_array(handle: Any, opening: bytes, name: str, chunks: Chunks) -> da.Array:
    info = handle.info(name)
    where = f"{handle.source}: tensor {name!r}"
    if info.dtype in SUB_BYTE:
        raise SafetensorNotImplementedError(
            f"{where} is {info.dtype}, which packs several values a byte: a dask array "
            f"of it is not supported; read it with safe_open")
    if info.array_shape is None:
        raise SafetensorError(f"{where}: shape {info.shape} cannot be a NumPy array")
    shape = tuple(info.array_shape)
    if not shape:
        raise SafetensorError(f"{where} has no axis: its chunks are ranges of rows; read "
                              f"it with safe_open")
    dtype = numpy_dtype(info.dtype)
    row_chunks = _row_chunks(chunks, shape, dtype, where)
    key = f"safetensors-{name}-{tokenize(opening, name, row_chunks)}"
    trailing = (0,) * (len(shape) - 1)
    graph, first = {}, 0
    for block, rows in enumerate(row_chunks):
        graph[(key, block, *trailing)] = (read_chunk, Chunk(opening, name, first, first + rows))
        first += rows
    return da.Array(HighLevelGraph.from_collections(key, graph, dependencies=()), key,
                    chunks=(row_chunks, *((size,) for size in shape[1:])),
                    meta=np.empty((0,) * len(shape), dtype))


def _row_chunks(chunks: Chunks, shape: Tuple[int, ...], dtype: np.dtype,
                where: str) -> Tuple[int, ...]:
    """The rows of each chunk, from dask's forms of `chunks`, other axes whole."""
    whole = (-1,) * (len(shape) - 1)
    limit = None
    try:
        if isinstance(chunks, str) and chunks != "auto":
            limit, spec = parse_bytes(chunks), ("auto", *whole)
        elif isinstance(chunks, (str, int, np.integer)):
            spec = (chunks, *whole)
        elif isinstance(chunks, Mapping):
            spec = (chunks.get(0, "auto"), *(chunks.get(axis, -1) for axis in range(1, len(shape))))
        else:
            spec = tuple(chunks)
        first = spec[0] if spec else None
        if isinstance(first, (int, np.integer)) and not (first == -1 or first > 0):
            raise ValueError("rows a chunk must be positive, or -1 for all")
        normalized = normalize_chunks(spec, shape, limit=limit, dtype=dtype)
    except (TypeError, ValueError, ZeroDivisionError) as error:
        raise SafetensorError(f"{where}: chunks {chunks!r} do not fit shape {shape}: "
                              f"{error}") from None
    for axis, blocks in enumerate(normalized[1:], 1):
        if len(blocks) > 1:
            raise SafetensorError(f"{where}: chunks {chunks!r} cut axis {axis}; chunks cut "
                                  f"the first axis only (ranges of whole rows, one read "
                                  f"each): rechunk the array to cut others")
    return tuple(int(rows) for rows in normalized[0])


class Chunk:
    """One chunk's task argument: how to reopen the file, the tensor, its rows."""

    __slots__ = ("opening", "name", "first", "last")

    def __init__(self, opening: bytes, name: str, first: int, last: int) -> None:
        self.opening, self.name, self.first, self.last = opening, name, first, last

    def __reduce__(self) -> Tuple[Any, ...]:
        return Chunk, (self.opening, self.name, self.first, self.last)

    def __repr__(self) -> str:
        return f"Chunk({self.name!r}, rows [{self.first}, {self.last}))"


def read_chunk(chunk: Chunk) -> np.ndarray:
    """Rows ``[chunk.first, chunk.last)`` of the chunk's tensor, through this
    process's open file (opened, and checked to be the same file, on first use)."""
    return kept_open(chunk.opening).read_rows(chunk.name, chunk.first, chunk.last)


class OpenFile:
    """A file a process keeps open for dask arrays, opened by the first chunk that
    needs it while the others that need it wait."""

    __slots__ = ("opening", "lock", "handle")

    def __init__(self, opening: bytes) -> None:
        self.opening, self.lock, self.handle = opening, threading.Lock(), None

    def get(self) -> Any:
        with self.lock:
            if self.handle is None:
                self.handle = pickle.loads(self.opening)   # refuses a file that changed
                return self.handle
        _check_unchanged(self.handle, self.opening)
        return self.handle


_open_files: "OrderedDict[bytes, OpenFile]" = OrderedDict()
_open_files_lock = threading.Lock()


def kept_open(opening: bytes) -> Any:
    """The file a dask array reads, opened once per process and kept (the most
    recent ``OPEN_FILES_KEPT``); a local file is checked, at each later use, to
    be the one the array was made from (one ``stat``)."""
    with _open_files_lock:
        kept = _open_files.get(opening)
        if kept is None:
            kept = _open_files[opening] = OpenFile(opening)
            while len(_open_files) > OPEN_FILES_KEPT:
                # not closed: another thread may be reading through it; it closes when dropped
                _open_files.popitem(last=False)
        else:
            _open_files.move_to_end(opening)
    return kept.get()


def open_files_kept() -> List[str]:
    """The files this process holds open for dask arrays, oldest first.

    Each process (a worker, or the client with the threaded scheduler) opens
    a file on the first chunk it reads of it, and keeps the 32 most recent
    open, so that a chunk costs one read, not a header parse.

    Returns
    -------
    list of str
        Their paths (or URLs).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.dask import from_safetensors, open_files_kept
    >>> path = os.path.join(tempfile.mkdtemp(), "kept.safetensors")
    >>> fastst.save_file({"x": np.ones((4, 2))}, path)
    >>> float(from_safetensors(path, "x", chunks=2).sum().compute())
    8.0
    >>> path in open_files_kept()
    True
    """
    with _open_files_lock:
        return [kept.handle.source for kept in _open_files.values() if kept.handle is not None]


def _check_unchanged(handle: Any, opening: bytes) -> None:
    seen = identity_of(handle)
    if handle.backend not in ("mmap", "pread") or seen is None:
        return     # a URL is held to its version by each request
    now = handle.origin.identity()
    if now is None or now.version != seen.version:
        with _open_files_lock:
            _open_files.pop(opening, None)
        raise seen.changed(now, "file", "the dask array was made",
                           "call from_safetensors again to read the new file")


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def to_safetensors(arrays: Union[da.Array, Mapping[str, Any]], path: PathLike,
                   metadata: Optional[Mapping[str, str]] = None, *,
                   name: Optional[str] = None, compute: bool = True, fsync: bool = False,
                   header_padding: int = 0, align: Optional[int] = None,
                   **compute_kwargs: Any) -> Any:
    """Write dask arrays as the tensors of one safetensors file, chunks in parallel.

    Parameters
    ----------
    arrays : mapping of str to dask array, or dask array
        NumPy arrays are taken too (as one-chunk dask arrays).
    path : str or os.PathLike
        The file to write (a local path, which every worker must see).
    metadata : mapping of str to str, optional
        The header's ``__metadata__``.
    name : str, optional
        The tensor's name when `arrays` is one array.
    compute : bool
        True (default): write now, with the current scheduler, and return None.
        False: return a ``dask.delayed`` value that writes when computed.
    fsync : bool, default False
        Flush the file and its directory to disk at commit (as for
        ``StreamWriter``).
    header_padding : int, default 0
        Bytes of spaces reserved after the header (as for ``StreamWriter``).
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).
    **compute_kwargs
        Passed to ``dask.compute`` when `compute` is True (``scheduler=`` ...).

    Returns
    -------
    None or dask.delayed.Delayed
        None when `compute` is True; else the delayed value that writes the
        file when computed.

    Raises
    ------
    SafetensorNotImplementedError
        When `path` is a URL: workers write in place, to a local file.
    SafetensorTypeError
        When one array is given without `name`, or a dict with it, or a name
        is not a str; when a dtype has no safetensors code.
    SafetensorError
        When an array's shape is not known (``nan`` chunks).
    OSError
        When the file cannot be written; the old file stays.

    Notes
    -----
    The header is written first, from each array's dtype and shape, beside
    `path` under a temporary name. Then each chunk's task writes its rows at
    their byte offset in that file (a ``pwrite``), in whichever process runs it:
    on ``dask.distributed``, workers must share the file system with the client.
    A chunk must hold whole rows (every axis but the first whole), so that it is
    one contiguous write; arrays cut along other axes are rechunked to whole
    rows first (a chunk then holds its rows in full). When every chunk is
    written, the file is renamed over `path`; the bytes are those ``save_file``
    writes for the same arrays.

    When a chunk fails, the temporary file is removed and any old file at `path`
    stays as it was. With ``compute=False`` the caller computes the result: if
    that fails, the old file stays as it was too, but the temporary file beside
    it (``.<name>.<random>.fastst-tmp``) is left for the caller to remove.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> import dask.array as da
    >>> from fastst.dask import to_safetensors
    >>> path = os.path.join(tempfile.mkdtemp(), "out.safetensors")
    >>> x = da.arange(12.0, chunks=5).reshape(6, 2)
    >>> to_safetensors({"x": x, "n": np.ones(3)}, path, metadata={"by": "dask"})
    >>> fastst.load_file(path)["x"][-1].tolist()
    [10.0, 11.0]
    >>> write = to_safetensors(x * 2, path, name="double", compute=False)
    >>> write.compute()
    >>> list(fastst.load_file(path))
    ['double']
    """
    if as_source(path, writing=True).local_path is None:
        raise SafetensorNotImplementedError(
            f"{path}: to_safetensors writes local files (its workers write in place); "
            f"write locally, then upload")
    named = _named_arrays(arrays, name)
    declared = {key: (array.dtype, array.shape) for key, array in named.items()}
    writer = StreamWriter(path, declared, metadata, fsync=fsync, header_padding=header_padding,
                          align=align)
    try:
        regions = [writer.region(key) for key in named]
    except BaseException:
        writer.abort()
        raise
    pending = writer.detach()
    try:
        stored = da.store(list(named.values()), regions, lock=False, compute=False) \
            if named else []
    except BaseException:
        pending.abort()
        raise
    if not compute:
        return dask.delayed(_commit, pure=False)(pending, stored)
    try:
        dask.compute(stored, **compute_kwargs)
    except BaseException:
        pending.abort()
        raise
    pending.commit()
    return None


def _commit(pending: PendingFile, stored: Any) -> None:
    """The last task: every chunk is written, the file takes its name."""
    pending.commit()


def _named_arrays(arrays: Any, name: Optional[str]) -> Dict[str, da.Array]:
    if not isinstance(arrays, Mapping):
        if name is None:
            raise SafetensorTypeError("one array needs a name: to_safetensors(array, path, "
                                      "name=...), or pass a dict of name -> array")
        arrays = {name: arrays}
    elif name is not None:
        raise SafetensorTypeError("name= names one array; a dict names its own")
    named = {}
    for key, array in arrays.items():
        if type(key) is not str:
            raise SafetensorTypeError(f"tensor names must be str, got {type(key).__name__}")
        named[key] = _whole_rows(key, array if isinstance(array, da.Array) else da.asarray(array))
    return named


def _whole_rows(name: str, array: da.Array) -> da.Array:
    """`array`, rechunked where need be so that each chunk holds whole rows."""
    if any(np.isnan(size) for size in array.shape):
        raise SafetensorError(f"tensor {name!r}: shape {array.shape} is not known; call "
                              f"compute_chunk_sizes() on the array first")
    if all(len(blocks) == 1 for blocks in array.chunks[1:]):
        return array
    return array.rechunk({axis: -1 for axis in range(1, array.ndim)})
