"""safe_open: a validated file whose tensors come out as NumPy arrays, or, through
a framework adapter's converter chosen once at opening, as torch or JAX tensors."""
from __future__ import annotations

import importlib
import os
import re
from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, Iterator, List, Literal,
                    Mapping, Optional, Protocol, Sequence, Tuple, TypeGuard, Union, cast, overload,
                    runtime_checkable)

from ._core import DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, TensorInfo
from ._files import PathLike
from ._slicing import Converter, SafeSlice, T

if TYPE_CHECKING:   # none of these is imported when fastst is
    import jax  # type: ignore[import-not-found, unused-ignore]
    import numpy.typing as npt
    import torch  # type: ignore[import-not-found, unused-ignore]

__all__ = ["ArrayHandle", "FrameworkHandle", "Handle", "NumpyHandle", "Openable", "ReadableFile",
           "file_changed", "is_checkpoint_path", "is_remote", "is_url", "open_file",
           "open_remote", "safe_open", "stamp"]

Backend = Literal["mmap", "pread"]


class ReadableFile(Protocol):
    """A binary file object that safe_open reads by byte ranges."""
    def seek(self, offset: int, whence: int = ..., /) -> int: ...
    def read(self, size: int = ..., /) -> bytes: ...


Openable = Union[PathLike, ReadableFile]   # a path (or URL string), or a file object
FileIdentity = Tuple[Union[str, bytes], int, int, int, int]   # path, dev, inode, size, mtime
NUMPY_FRAMEWORKS = ("np", "numpy")
URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")   # scheme://..., for fsspec
# framework name -> the fastst module that adapts NumPy arrays to it (imported on use)
ADAPTERS = {"pt": "torch", "torch": "torch", "pytorch": "torch", "jax": "jax", "flax": "jax"}


@runtime_checkable
class Handle(Protocol[T]):
    """What ``safe_open`` returns, for one file (a ``FrameworkHandle`` or
    ``NumpyHandle``) or for a sharded checkpoint (a
    ``fastst.checkpoint.ShardedHandle``): the reading methods they share, each
    tensor a `T`. ``metadata()`` is a file's ``__metadata__`` (str to str) or a
    checkpoint index's ``metadata`` (whose ``total_size`` is an int)."""

    def get_tensor(self, name: str, /) -> T: ...
    def __getitem__(self, name: str, /) -> T: ...
    def get_tensors(self) -> Dict[str, T]: ...
    def get_slice(self, name: str, /) -> SafeSlice[T]: ...
    def gather(self, name: str, rows: Any, /) -> T: ...
    def info(self, name: str, /) -> TensorInfo: ...
    def keys(self) -> List[str]: ...
    def offset_keys(self) -> List[str]: ...
    def metadata(self) -> Optional[Dict[str, Any]]: ...
    @property
    def source(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: object, /) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def __enter__(self) -> Handle[T]: ...
    def __exit__(self, *exc_info: object) -> None: ...


@runtime_checkable
class ArrayHandle(Handle["npt.NDArray[Any]"], Protocol):
    """What ``safe_open(..., framework="np")`` returns, a ``NumpyHandle`` for one
    file or a ``fastst.checkpoint.NumpyShardedHandle`` for a sharded checkpoint:
    the methods of ``Handle`` and the NumPy-only ones."""

    def get_tensor(self, name: str, /, *, out: Optional[npt.NDArray[Any]] = None
                   ) -> npt.NDArray[Any]: ...
    def copy_tensors(self) -> Dict[str, npt.NDArray[Any]]: ...
    def read_into(self, arrays: Dict[str, npt.NDArray[Any]], /) -> None: ...
    def read_rows(self, name: str, first: int, last: int, /) -> npt.NDArray[Any]: ...
    def gather_rows(self, name: str, rows: npt.NDArray[Any], /) -> npt.NDArray[Any]: ...
    def gather(self, name: str, rows: Any, /, out: Optional[npt.NDArray[Any]] = None
               ) -> npt.NDArray[Any]: ...
    def __enter__(self) -> ArrayHandle: ...


class NumpyHandle(Reader):
    """An open safetensors file whose tensors are NumPy arrays: zero-copy views of
    the file's private map (backend ``"mmap"``), or fresh memory read when asked
    (backend ``"pread"``). What ``safe_open(..., framework="np")`` returns.

    Its reading methods are the compiled Reader's own: ``get_tensor``,
    ``get_tensors``, ``copy_tensors``, ``read_into``, ``read_rows``,
    ``gather`` (rows of a tensor, into ``out=`` when given), ``gather_rows``,
    ``info``, ``keys``, ``offset_keys``, ``metadata``, and the mapping protocol
    (``f[name]``, ``name in f``, ``len(f)``, iteration). It pickles by reopening
    the same file, which must not have changed.
    """

    storage_options: Optional[Dict[str, Any]] = None   # a URL's, to reopen it when unpickled

    def __enter__(self) -> NumpyHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_slice(self, name: str) -> SafeSlice[npt.NDArray[Any]]:
        """A lazy handle on tensor `name` that NumPy indexing reads from."""
        return SafeSlice(self, name)

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled, a handle reopens the same file (see ``_reopened``), or the same
        URL (see ``_reopened_url``)."""
        return _pickled(self, "np", "cpu")

    def __repr__(self) -> str:
        return _describe(self)


class FrameworkHandle(Generic[T]):
    """An open safetensors file whose tensors come out as another framework's
    (torch, JAX): each NumPy array the file gives passes through the converter
    chosen when the file was opened. What ``safe_open(..., framework="pt")`` (or
    ``"jax"``) returns.
    """

    def __init__(self, reader: NumpyHandle, convert: Converter[T],
                 opened_as: Optional[Tuple[str, Any]] = None) -> None:
        self._reader = reader
        self._convert = _naming_the_file(convert, reader.source)
        # a converter may take a whole file at once (CUDA: one stream, one allocation)
        self._convert_file: Optional[Callable[[NumpyHandle], Dict[str, T]]] = getattr(
            convert, "convert_file", None)
        self._infos: Dict[str, TensorInfo] = {}   # filled as tensors are asked for
        self._opened_as = opened_as               # (framework, device), for pickling

    def get_tensor(self, name: str, *, out: None = None) -> T:
        """The tensor `name`, as the framework's tensor."""
        if out is not None:
            raise TypeError("out= takes NumPy arrays; open the file with framework='np'")
        array = self._reader.get_tensor(name)
        return self._convert(array, name, self._info(name))

    def __getitem__(self, name: str) -> T:
        return self.get_tensor(name)

    def gather(self, name: str, rows: Any, *, out: None = None) -> T:
        """Rows `rows` of tensor `name`'s first axis, as the framework's tensor (see
        ``NumpyHandle.gather``)."""
        if out is not None:
            raise TypeError("out= takes NumPy arrays; open the file with framework='np'")
        return self._convert(self._reader.gather(name, rows), name, self._info(name))

    def get_tensors(self) -> Dict[str, T]:
        """Every tensor, in buffer order."""
        # a subclass of NumpyHandle (one that verifies checksums) reads tensor by tensor
        if (self._convert_file is not None and type(self._reader) is NumpyHandle
                and self._reader.backend in ("mmap", "pread")):
            return self._convert_file(self._reader)
        convert = self._convert
        return {name: convert(array, name, self._info(name))
                for name, array in self._reader.get_tensors().items()}

    def _info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            info = self._infos[name] = self._reader.info(name)
        return info

    def get_slice(self, name: str) -> SafeSlice[T]:
        """A lazy handle on tensor `name`: indexing reads the part it selects."""
        return SafeSlice(self._reader, name, self._convert)

    def keys(self) -> List[str]:
        """Tensor names, sorted."""
        return self._reader.keys()

    def offset_keys(self) -> List[str]:
        """Tensor names in buffer order."""
        return self._reader.offset_keys()

    def metadata(self) -> Optional[Dict[str, str]]:
        """The ``__metadata__`` str->str map, or None when the file has none."""
        return self._reader.metadata()

    def info(self, name: str) -> TensorInfo:
        """What the header says of tensor `name` (see ``fastst.TensorInfo``)."""
        return self._info(name)

    @property
    def source(self) -> str:
        return self._reader.source

    @property
    def backend(self) -> str:
        return self._reader.backend

    @property
    def file_identity(self) -> Optional[FileIdentity]:
        """The opened file's (path, st_dev, st_ino, st_size, st_mtime_ns)."""
        return self._reader.file_identity

    @property
    def closed(self) -> bool:
        return self._reader.closed

    def close(self) -> None:
        self._reader.close()

    def __len__(self) -> int:
        return len(self._reader)

    def __contains__(self, name: object) -> bool:
        return name in self._reader

    def __iter__(self) -> Iterator[str]:
        return iter(self._reader)

    def __enter__(self) -> FrameworkHandle[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled, a handle reopens the same file (see ``_reopened``)."""
        if self._opened_as is None:
            raise SafetensorError(f"{self.source}: only a handle from safe_open can be pickled")
        return _pickled(self._reader, *self._opened_as)

    def __repr__(self) -> str:
        return _describe(self._reader)


def _pickled(reader: Reader, framework: str, device: Any) -> Tuple[Any, ...]:
    """How a handle pickles: the function that opens it again (``_reopened`` for a
    file, ``_reopened_url`` for a URL) and its arguments: the file's identity (path,
    device, inode, size, mtime; or URL, size, ETag, modification time), the
    backend (or a URL's storage_options), the header's length, the framework, the
    device, and the class of the reader (a NumpyHandle, or a subclass such as one
    that verifies)."""
    if reader.closed:
        raise SafetensorError(f"{reader.source}: file is closed; a closed handle cannot be "
                              f"pickled")
    identity = reader.file_identity
    ranged = reader.backend == "ranges"
    if identity is None:
        raise SafetensorError(
            f"{reader.source}: a handle on a file object cannot be pickled; open a path or "
            f"a URL instead" if ranged else f"{reader.source}: a handle on a buffer cannot "
            f"be pickled; save the buffer to a file and open that")
    opening = getattr(reader, "storage_options", None) if ranged else reader.backend
    return (_reopened_url if ranged else _reopened,
            (identity, opening, reader.data_start - 8, framework, device, type(reader)))


def _reopened(identity: FileIdentity, backend: Backend, header_size: int, framework: str,
              device: Any, reader_class: type = NumpyHandle
              ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """A pickled handle, unpickled: the same file opened again, as before. A file
    that is not the one pickled (replaced, rewritten, resized) is refused."""
    path = identity[0]
    _check_same_file(path, identity, stamp(os.stat(path)))
    convert = None if framework in NUMPY_FRAMEWORKS else framework_converter(framework, device)
    reader = reader_class()
    # the header's length is known: a longer one is not the same file
    reader.open_file(path, backend, max_header_size=header_size)
    try:
        _check_same_file(path, identity, reader.file_identity[1:])
    except SafetensorError:
        reader.close()
        raise
    return reader if convert is None else FrameworkHandle(reader, convert, (framework, device))


def _reopened_url(identity: Tuple[Any, ...], storage_options: Optional[Dict[str, Any]],
                  header_size: int, framework: str, device: Any, reader_class: type
                  ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """A pickled handle on a URL, unpickled: the URL opened again, which must still
    name the same object (size, ETag, modification time)."""
    from .remote import reopen_reader    # a capability: imported when used

    convert = None if framework in NUMPY_FRAMEWORKS else framework_converter(framework, device)
    reader = reader_class()
    reopen_reader(reader, identity, storage_options, header_size)
    reader.storage_options = storage_options
    return reader if convert is None else FrameworkHandle(reader, convert, (framework, device))


def stamp(info: os.stat_result) -> Tuple[int, int, int, int]:
    """What tells one version of a file from another: its st_dev, st_ino, st_size
    and st_mtime_ns (a handle's ``file_identity`` after the path)."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _check_same_file(path: Union[str, bytes], identity: FileIdentity,
                     now: Tuple[int, ...]) -> None:
    if tuple(now) != tuple(identity[1:]):
        raise file_changed(path, identity, now, "the handle was pickled",
                           "open it again to read the new file")


def file_changed(path: Union[str, bytes], identity: Sequence[Any], now: Tuple[int, ...],
                 since: str, remedy: str) -> SafetensorError:
    """The error for a file whose ``stamp`` is `now` (empty: the file is gone) where
    `identity` (a ``file_identity``) was seen `since` some event; `remedy` says
    what to do."""
    return SafetensorError(
        f"{os.fsdecode(path)}: file changed since {since} (device, inode, size, mtime "
        f"{tuple(identity[1:])}, now {tuple(now) or 'missing'}); {remedy}")


def _naming_the_file(convert: Converter[T], source: str) -> Converter[T]:
    """`convert`, with the file's name put before the errors it raises (an
    adapter knows the tensor, not the file)."""
    def converted(array: npt.NDArray[Any], name: str, info: TensorInfo) -> T:
        try:
            return convert(array, name, info)
        except SafetensorError as error:
            raise type(error)(f"{source}: {error}") from None
    return converted


def _describe(reader: Reader) -> str:
    state = "closed" if reader.closed else f"{len(reader)} tensors"
    return f"<fastst.safe_open {reader.source!r} ({state})>"


@overload
def safe_open(filename: Openable, framework: Literal["np", "numpy"] = "np",
              device: Literal["cpu"] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> ArrayHandle: ...
@overload
def safe_open(filename: Openable, framework: Literal["pt", "torch", "pytorch"],
              device: Union[str, int, torch.device] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> Handle[torch.Tensor]: ...
@overload
def safe_open(filename: Openable, framework: Literal["jax", "flax"],
              device: Union[str, jax.Device] = "cpu", *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None) -> Handle[jax.Array]: ...
def safe_open(filename: Openable,
              framework: Literal["np", "numpy", "pt", "torch", "pytorch", "jax", "flax"] = "np",
              device: Any = "cpu", *, backend: Literal["mmap", "pread"] = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              storage_options: Optional[Mapping[str, Any]] = None
              ) -> Union[ArrayHandle, Handle[Any]]:
    """Open a safetensors file lazily: validate its header, map it, and hand out
    its tensors, zero-copy where the framework allows.

    Parameters
    ----------
    filename : str, bytes, os.PathLike, URL or binary file object
        A ``.safetensors`` file, or a sharded checkpoint: its directory or its
        ``*.index.json``, opened as one handle over all its shards (a
        ``fastst.checkpoint.ShardedHandle``, whose ``metadata()`` is the index's).
        Or an fsspec URL (``s3://``, ``gs://``, ``http(s)://``, ``memory://``...),
        or a binary file object with ``seek`` and ``read``: the header is read
        first, then only the byte ranges asked for, into fresh memory (backend
        ``"ranges"``; see ``fastst.remote``).
    framework : {"np", "numpy", "pt", "torch", "pytorch", "jax", "flax"}
        ``"np"``/``"numpy"`` (default): NumPy arrays, from a ``NumpyHandle``.
        ``"pt"``/``"torch"``/``"pytorch"``: ``torch.Tensor``s (``fastst.torch``).
        ``"jax"``/``"flax"``: ``jax.Array``s (``fastst.jax``).
        torch and JAX tensors come from a ``FrameworkHandle``, with the same
        reading methods; only these import their framework. For typing, the
        result is an ``ArrayHandle`` for NumPy and a ``Handle`` of the
        framework's tensors otherwise: what one file's handle and a sharded
        checkpoint's have in common.
    device : str, int, torch.device or jax.Device
        ``"cpu"`` (default; the only one for NumPy), or where the framework should
        put the tensors (``"cuda:0"``, ``0``, ``"gpu"``...).
    backend : {"mmap", "pread"}
        ``"mmap"`` (default) maps the file privately: arrays are views, writable,
        and writes never reach the file. ``"pread"`` reads each tensor into fresh
        memory when asked, for files that may change while open. URLs and file objects
        are always read by ranges into fresh memory, whatever `backend` says.
    max_header_size : int
        Largest header accepted, in bytes (100,000,000 by default).
    verify : bool
        Check each tensor's checksum (see ``fastst.integrity``) the first time it
        is read; a file without checksums is refused, and so is one whose
        checksums leave a tensor out (naming it). For a sharded checkpoint, each
        shard is checked so as its tensors are read.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system (credentials,
        ``client_kwargs``, timeouts...).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path, framework="np") as f:
    ...     f.keys(), f.get_tensor("w").sum(), f.get_slice("w")[1].tolist()
    (['w'], np.float32(2.0), [0.0, 1.0])
    """
    if framework in NUMPY_FRAMEWORKS:
        _check_numpy_device(device)
        convert = None
    else:
        convert = framework_converter(framework, device)
    if storage_options and not is_url(filename):
        raise SafetensorError(f"storage_options apply to URLs only, not to "
                              f"{_shown_target(filename)}")
    if is_checkpoint_path(filename):
        from .checkpoint import open_checkpoint   # a capability: imported when used

        return open_checkpoint(cast(PathLike, filename), convert, backend=backend,
                               max_header_size=max_header_size, verify=verify,
                               opened_as=(framework, device), storage_options=storage_options)
    if is_remote(filename):
        return open_remote(filename, convert, max_header_size=max_header_size, verify=verify,
                           storage_options=storage_options, opened_as=(framework, device))
    path = cast(PathLike, filename)   # neither a URL nor a file object
    return open_file(path, convert, backend=backend, max_header_size=max_header_size,
                     verify=verify, opened_as=(framework, device))


@overload
def open_file(filename: PathLike, convert: None = None, *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              opened_as: Optional[Tuple[str, Any]] = None) -> NumpyHandle: ...
@overload
def open_file(filename: PathLike, convert: Converter[T], *, backend: Backend = "mmap",
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
              opened_as: Optional[Tuple[str, Any]] = None) -> FrameworkHandle[T]: ...
@overload
def open_file(filename: PathLike, convert: Optional[Converter[Any]], *,
              backend: Backend = "mmap", max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
              verify: bool = False, opened_as: Optional[Tuple[str, Any]] = None
              ) -> Union[NumpyHandle, FrameworkHandle[Any]]: ...
def open_file(filename: PathLike, convert: Optional[Converter[Any]] = None, *,
              backend: Backend = "mmap", max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
              verify: bool = False, opened_as: Optional[Tuple[str, Any]] = None
              ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """One safetensors file, its tensors passed through `convert` (a framework's
    converter, see ``framework_converter``) or NumPy arrays when it is None; with
    `verify`, each tensor's checksum is checked on its first read. `opened_as`, the
    (framework, device) `convert` is for, lets a FrameworkHandle pickle."""
    reader = NumpyHandle() if not verify else _verifying_handle()
    reader.open_file(filename, backend, max_header_size=max_header_size)
    return reader if convert is None else FrameworkHandle(reader, convert, opened_as)


def is_url(target: Any) -> TypeGuard[str]:
    """Whether `target` is a URL string (``scheme://...``), opened through fsspec."""
    return isinstance(target, str) and URL.match(target) is not None


def is_remote(target: Any) -> bool:
    """Whether `target` is read by byte ranges: a URL or a binary file object (one
    with ``seek`` and ``read``)."""
    if isinstance(target, (str, bytes, os.PathLike)):
        return is_url(target)
    return callable(getattr(target, "seek", None)) and callable(getattr(target, "read", None))


@overload
def open_remote(target: Openable, convert: None = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                storage_options: Optional[Mapping[str, Any]] = None,
                opened_as: Optional[Tuple[str, Any]] = None) -> NumpyHandle: ...
@overload
def open_remote(target: Openable, convert: Converter[T], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                storage_options: Optional[Mapping[str, Any]] = None,
                opened_as: Optional[Tuple[str, Any]] = None) -> FrameworkHandle[T]: ...
@overload
def open_remote(target: Openable, convert: Optional[Converter[Any]], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                storage_options: Optional[Mapping[str, Any]] = None,
                opened_as: Optional[Tuple[str, Any]] = None
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]: ...
def open_remote(target: Openable, convert: Optional[Converter[Any]] = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                storage_options: Optional[Mapping[str, Any]] = None,
                opened_as: Optional[Tuple[str, Any]] = None
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """A URL or a file object, read by byte ranges (see ``fastst.remote``)."""
    from .remote import open_reader    # a capability: imported when used

    if isinstance(target, str) and target.endswith(".index.json"):
        raise SafetensorError(f"{target}: a sharded checkpoint's index; open it with "
                              f"safe_open, which reads the shards beside it")
    reader = NumpyHandle() if not verify else _verifying_handle()
    open_reader(reader, target, storage_options=storage_options,
                max_header_size=max_header_size)
    reader.storage_options = dict(storage_options) if storage_options else None
    return reader if convert is None else FrameworkHandle(reader, convert, opened_as)


def _verifying_handle() -> NumpyHandle:
    from .integrity import VerifyingHandle     # imported on use: it is rarely asked for
    return VerifyingHandle()


def is_checkpoint_path(filename: Any) -> bool:
    """Whether `filename` names a sharded checkpoint: a directory or an
    ``*.index.json`` (see ``fastst.checkpoint``), or the URL of an index."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    path = os.fsdecode(filename)
    return path.endswith(".index.json") or (not is_url(path) and os.path.isdir(path))


# What a shard's name may not hold, whatever the scheme: a path separator, '%' (a
# server decodes escapes: '%2e%2e%2f' is '../'), '?' or '#' (they end a URL's path),
# a control character.
NOT_IN_SHARD_NAMES = re.compile(r"[/\\%?#\x00-\x1f\x7f]")
SHARD_NAME_RULE = ("a .safetensors file name in the index's folder (no '/', '\\', '%', '?', "
                   "'#' or control character, and no leading '.')")


def is_plain_shard_name(name: str) -> bool:
    """Whether `name`, as an ``*.index.json`` gives a shard, names a ``.safetensors``
    file in the index's own folder, on disk and behind any URL alike (see
    ``SHARD_NAME_RULE``)."""
    return (name.endswith(".safetensors") and not name.startswith(".")
            and NOT_IN_SHARD_NAMES.search(name) is None)


def _shown_target(target: Any) -> str:
    if isinstance(target, (str, bytes, os.PathLike)):
        return f"the path {os.fsdecode(target)!r}"
    return f"a {type(target).__name__}"


def framework_converter(framework: str, device: Any) -> Converter[Any]:
    """The converter of `framework`'s adapter for `device`: a function of
    (NumPy array, tensor name, TensorInfo) that returns the framework's tensor."""
    module = ADAPTERS.get(framework) if isinstance(framework, str) else None
    if module is None:
        raise SafetensorError(
            f"unknown framework {framework!r}; use 'np', 'pt' (torch) or 'jax'/'flax'")
    converter: Converter[Any] = importlib.import_module(f"fastst.{module}").converter(device)
    return converter


def _check_numpy_device(device: Any) -> None:
    if device != "cpu":
        raise SafetensorError(f"NumPy arrays live on the CPU; device must be 'cpu', "
                              f"got {device!r}")
