"""Handles on one safetensors file: a ``NumpyHandle`` (the compiled Reader's
methods: NumPy arrays, views of the file's map or fresh memory), a
``VerifyingHandle`` that checks each tensor's checksum on its first read, and a
``FrameworkHandle`` whose tensors pass through a framework adapter's converter,
chosen once at opening. ``open_handle`` opens one on a Source; a handle pickles by
opening its Source again, which must hold the same version of the file.
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, Iterator, List, Literal,
                    Optional, Protocol, Set, Tuple, Union, overload, runtime_checkable)

from ._adapters import NUMPY_FRAMEWORKS, converter as framework_converter
from ._core import DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, TensorInfo
from ._files import PathLike
from ._slicing import Converter, SafeSlice, T
from ._source import Buffer, FileObject, Identity, LocalFile, Source, identity_of

if TYPE_CHECKING:   # none of these is imported when fastst is
    import numpy.typing as npt

__all__ = ["ArrayHandle", "Backend", "FrameworkHandle", "Handle", "NumpyHandle", "Openable",
           "ReadableFile", "VerifyingHandle", "open_handle"]

Backend = Literal["mmap", "pread"]


class ReadableFile(Protocol):
    """A binary file object that safe_open reads by byte ranges."""
    def seek(self, offset: int, whence: int = ..., /) -> int: ...
    def read(self, size: int = ..., /) -> bytes: ...


Openable = Union[PathLike, ReadableFile]   # a path (or URL string), or a file object
FileIdentity = Tuple[Union[str, bytes], int, int, int, int]   # path, dev, inode, size, mtime


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

    _origin: Optional[Source] = None

    @property
    def origin(self) -> Source:
        """Where the handle's bytes are: the Source it was opened on (see
        ``fastst._source``), which a pickled handle opens again."""
        if self._origin is None:   # opened with the Reader's own methods
            self._origin = _origin_of(self)
        return self._origin

    @origin.setter
    def origin(self, source: Source) -> None:
        self._origin = source

    def __enter__(self) -> NumpyHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_slice(self, name: str) -> SafeSlice[npt.NDArray[Any]]:
        """A lazy handle on tensor `name` that NumPy indexing reads from."""
        return SafeSlice(self, name)

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled, a handle opens its Source again (see ``_reopened``)."""
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


def _pickled(reader: NumpyHandle, framework: str, device: Any) -> Tuple[Any, ...]:
    """How a handle pickles: the function that opens it again (``_reopened``) and its
    arguments: the Source, the version of the file read (its ``Identity``), the
    header's length, the framework, the device, and the class of the reader (a
    NumpyHandle, or a subclass such as one that verifies)."""
    if reader.closed:
        raise SafetensorError(f"{reader.source}: file is closed; a closed handle cannot be "
                              f"pickled")
    seen = identity_of(reader)
    if seen is None:
        raise SafetensorError(f"{reader.source}: {reader.origin.cannot_reopen()}")
    return (_reopened, (reader.origin, seen, reader.data_start - 8, framework, device,
                        type(reader)))


def _origin_of(reader: Reader) -> Source:
    """The Source of a Reader opened by its own methods, as far as it tells: a local
    file (its path and backend), else one that cannot be opened again."""
    if reader.backend in ("mmap", "pread") and reader.file_identity is not None:
        return LocalFile(reader.file_identity[0], reader.backend)
    return Buffer(None) if reader.backend == "buffer" else FileObject(None)


def _reopened(source: Source, seen: Identity, header_size: int, framework: str, device: Any,
              reader_class: type = None) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """A pickled handle, unpickled: its Source opened again, as before. A file that
    is not the one pickled (replaced, rewritten, resized) is refused."""
    convert = None if framework in NUMPY_FRAMEWORKS else framework_converter(framework, device)
    reader = (reader_class or NumpyHandle)()
    # the header's length is known: a longer one is not the same file
    source.reopen(reader, seen, max_header_size=header_size, what="file",
                  since="the handle was pickled", remedy="open it again to read the new file")
    reader.origin = source
    return reader if convert is None else FrameworkHandle(reader, convert, (framework, device))


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


class VerifyingHandle(NumpyHandle):
    """A NumpyHandle that checks each tensor's checksum the first time the tensor
    is read (``safe_open(..., verify=True)``); a partial read (rows, a slice)
    checks the whole tensor first. A file without checksums is refused, and so is
    one whose checksums leave some tensor out, at opening: verifying it could not
    keep its promise. (``verify_file`` checks the other tensors of such a file and
    names each one left out as an error.)"""

    def open_file(self, filename: Any, backend: str = "mmap", *,
                  max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        super().open_file(filename, backend, max_header_size=max_header_size)
        self._take_checksums()

    def open_ranges(self, source: str, size: int, fetch: Any, *,
                    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    identity: Any = None) -> None:
        super().open_ranges(source, size, fetch, max_header_size=max_header_size,
                            identity=identity)
        self._take_checksums()

    def _take_checksums(self) -> None:
        from ._checksums import checksums_of, some_tensors, without_checksum   # on use

        names = self.offset_keys()
        found = checksums_of(self.metadata(), names, self.source)
        if found is None:
            raise SafetensorError(f"{self.source}: verify=True, but the file has no "
                                  f"checksums (save it with checksum='xxh3_64')")
        self.algorithm, self.digests = found
        missing = without_checksum(names, self.digests)
        if missing:
            raise SafetensorError(f"{self.source}: verify=True, but {some_tensors(missing)} "
                                  f"{'has' if len(missing) == 1 else 'have'} no checksum "
                                  f"(the file's checksums cover {len(names) - len(missing)} "
                                  f"of its {len(names)} tensors)")
        self.verified: Set[str] = set()

    def check(self, name: str, array: Optional[npt.NDArray[Any]] = None) -> None:
        """Check tensor `name` (its bytes `array`, else read now) unless done before."""
        if name in self.verified:
            return
        from ._checksums import digest_of, mismatch   # imported with the handle's first check

        if array is None:
            array = NumpyHandle.get_tensor(self, name)
        actual = digest_of(array, self.algorithm)
        if actual != self.digests[name]:
            raise SafetensorError(f"{self.source}: tensor {name!r}: "
                                  + mismatch(self.algorithm, self.digests[name], actual))
        self.verified.add(name)

    def get_tensor(self, name: str, *, out: Optional[npt.NDArray[Any]] = None
                   ) -> npt.NDArray[Any]:
        array: npt.NDArray[Any] = super().get_tensor(name, out=out)
        self.check(name, array)
        return array

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.get_tensor(name)

    def get_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def copy_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        arrays: Dict[str, npt.NDArray[Any]] = super().copy_tensors()
        for name, array in arrays.items():
            self.check(name, array)
        return arrays

    def read_into(self, arrays: Dict[str, npt.NDArray[Any]]) -> None:
        super().read_into(arrays)
        for name, array in arrays.items():
            self.check(name, array)

    def read_rows(self, name: str, first: int, last: int) -> npt.NDArray[Any]:
        self.check(name)
        rows: npt.NDArray[Any] = super().read_rows(name, first, last)
        return rows

    def gather_rows(self, name: str, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather_rows(name, rows)
        return gathered

    def gather(self, name: str, rows: Any, out: Optional[npt.NDArray[Any]] = None
               ) -> npt.NDArray[Any]:
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather(name, rows, out)
        return gathered


@overload
def open_handle(source: Source, convert: None = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None) -> NumpyHandle: ...
@overload
def open_handle(source: Source, convert: Converter[T], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None) -> FrameworkHandle[T]: ...
@overload
def open_handle(source: Source, convert: Optional[Converter[Any]], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]: ...
def open_handle(source: Source, convert: Optional[Converter[Any]] = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """One safetensors file where `source` says, its tensors passed through
    `convert` (a framework's converter, see ``fastst._adapters``) or NumPy arrays
    when it is None; with `verify`, each tensor's checksum is checked on its first
    read. `opened_as`, the (framework, device) `convert` is for, lets a
    FrameworkHandle pickle."""
    reader = VerifyingHandle() if verify else NumpyHandle()
    source.open(reader, max_header_size=max_header_size)
    reader.origin = source
    return reader if convert is None else FrameworkHandle(reader, convert, opened_as)
