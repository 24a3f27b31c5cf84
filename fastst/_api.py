"""The public reading and writing API over the compiled core."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from . import _core
from ._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError
from ._files import write_atomically

if TYPE_CHECKING:   # numpy.typing costs milliseconds to import
    import numpy.typing as npt

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

_NUMPY_FRAMEWORKS = ("np", "numpy")
# framework name -> the fastst module that adapts NumPy views to it (imported on use)
_ADAPTERS = {"pt": "torch", "torch": "torch", "pytorch": "torch", "jax": "jax", "flax": "jax"}


class safe_open(_core.Reader):
    """Open a safetensors file lazily: validate its header, map it, and hand out
    zero-copy NumPy views of its tensors.

    Parameters
    ----------
    filename : str, bytes or os.PathLike
    framework : {"np", "numpy"}
    device : {"cpu"}
    backend : {"mmap", "pread"}
        ``"mmap"`` (default) maps the file privately: arrays are views, writable,
        and writes never reach the file. ``"pread"`` reads each tensor into fresh
        memory when asked, for files that may change while open.
    max_header_size : int
        Largest header accepted, in bytes (100,000,000 by default).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path, framework="np") as f:
    ...     f.keys(), f.get_tensor("w").sum()
    (['w'], np.float32(2.0))
    """

    def __new__(cls, filename: PathLike, framework: str = "np", *args: Any,
                **kwargs: Any) -> "safe_open":
        if cls is safe_open and framework not in _NUMPY_FRAMEWORKS:
            cls = _FrameworkHandle
        return super().__new__(cls)

    def __init__(self, filename: PathLike, framework: str = "np", device: Any = "cpu", *,
                 backend: str = "mmap",
                 max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        _check_numpy_device(device)
        self.open_file(filename, backend, max_header_size=max_header_size)

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_slice(self, name: str) -> "SafeSlice":
        """A lazy handle on tensor `name` that NumPy indexing reads from."""
        dtype_code, shape, _, array_shape = self.info(name)
        return SafeSlice(self, name, dtype_code, shape, array_shape)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self)} tensors"
        return f"<fastst.safe_open {self.source!r} ({state})>"


class _FrameworkHandle(safe_open):
    """A safe_open whose tensors come out as another framework's (torch, jax): the
    NumPy views pass through that framework's adapter module.

    The adapter's ``converter(device)`` returns ``convert(array, name, entry)``:
    `entry` is the handle's ``info`` lookup (name -> header dtype code, shape,
    offsets, NumPy shape), for the dtypes a NumPy array cannot tell apart (packed
    sub-byte tensors are uint8)."""

    def __init__(self, filename: PathLike, framework: str = "np", device: Any = "cpu", *,
                 backend: str = "mmap",
                 max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        adapter = _adapter(framework)
        self._convert = adapter.converter(device)
        self.open_file(filename, backend, max_header_size=max_header_size)

    def get_tensor(self, name: str, *, out: Any = None) -> Any:
        if out is not None:
            raise TypeError("out= takes NumPy arrays; open the file with framework='np'")
        return self._convert(super().get_tensor(name), name, self.info)

    def __getitem__(self, name: str) -> Any:
        return self.get_tensor(name)

    def get_tensors(self) -> Dict[str, Any]:
        convert, entry = self._convert, self.info
        return {name: convert(array, name, entry) for name, array in super().get_tensors().items()}

    def get_slice(self, name: str) -> "SafeSlice":
        slice_ = super().get_slice(name)
        slice_._convert = self._convert
        return slice_


def _adapter(framework: str) -> Any:
    module = _ADAPTERS.get(framework)
    if module is None:
        raise SafetensorError(
            f"unknown framework {framework!r}; use 'np', 'pt' (torch) or 'jax'/'flax'")
    import importlib
    return importlib.import_module(f"fastst.{module}")


def _check_numpy_device(device: Any) -> None:
    if device != "cpu":
        raise SafetensorError(f"NumPy arrays live on the CPU; device must be 'cpu', "
                              f"got {device!r}")


class SafeSlice:
    """One tensor of an open file, read through NumPy basic indexing.

    ``f.get_slice(name)[index]`` returns exactly ``f.get_tensor(name)[index]``: with
    the default mmap backend it is a view that touches only the pages the index
    reaches.
    """

    def __init__(self, reader: safe_open, name: str, dtype_code: str, shape: List[int],
                 array_shape: Optional[Tuple[int, ...]]) -> None:
        self._reader = reader
        self._name = name
        self._dtype_code = dtype_code
        self._shape = shape
        self._array_shape = array_shape   # differs from `shape` for packed sub-byte dtypes
        self._convert: Optional[Callable[[npt.NDArray[Any], str, Callable[[str], Any]], Any]] = None

    def get_shape(self) -> List[int]:
        """The tensor's shape as the header states it (a list of ints)."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The tensor's header dtype code, e.g. ``"F32"``."""
        return self._dtype_code

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self._shape)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def dtype(self) -> np.dtype:
        return _core.numpy_dtype(self._dtype_code)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return int(self._shape[0])

    def __getitem__(self, index: Any) -> Any:
        array = self._select(index)
        if self._convert is None:
            return array
        return self._convert(array, self._name, self._reader.info)

    def _select(self, index: Any) -> npt.NDArray[Any]:
        if self._array_shape is None:   # get_tensor says why
            return _core.Reader.get_tensor(self._reader, self._name)
        if _core.dtype_bits(self._dtype_code) < 8:
            if _check_packed_index(self._name, self._dtype_code, self._shape,
                                   self._array_shape, index):
                index = Ellipsis   # the whole tensor, however many axes the index named
        if self._reader.backend == "pread":
            gathered = _gather_rows(self._reader, self._name, index, self._array_shape)
            if gathered is not None:
                return gathered
            rows = _rows_needed(index, self._array_shape)
            if rows is not None:
                first, last, local_index = rows
                part: npt.NDArray[Any] = self._reader.read_rows(self._name, first, last)
                return part[local_index]  # type: ignore[no-any-return]
        result: npt.NDArray[Any] = _core.Reader.get_tensor(self._reader, self._name)[index]
        return result

    def __repr__(self) -> str:
        return f"<fastst.SafeSlice {self._name!r} {self._dtype_code} {self._shape}>"


def _check_packed_index(name: str, code: str, shape: List[int], array_shape: Tuple[int, ...],
                        index: Any) -> bool:
    """Sub-byte tensors surface as packed bytes: indices may select along the
    leading axes, but not inside the packed last axis (nor inside a tensor packed
    flat, whose axes do not survive packing). True when the index selects everything."""
    parts = index if isinstance(index, tuple) else (index,)
    if all(_selects_everything(part) for part in parts):
        return True
    if (len(array_shape) != len(shape) or len(parts) >= len(shape)
            or any(part is Ellipsis for part in parts)):
        raise SafetensorError(
            f"tensor {name!r} ({code}) is stored packed; index only its leading axes")
    return False


def _selects_everything(part: Any) -> bool:
    return part is Ellipsis or (isinstance(part, slice) and part == slice(None))


def _gather_rows(reader: safe_open, name: str, index: Any,
                 shape: Tuple[int, ...]) -> Optional[npt.NDArray[Any]]:
    """An index led by a 1-d integer array, followed by basic indices only: read
    just the rows it names (a data-loader gather). None when it is not one."""
    parts = index if isinstance(index, tuple) else (index,)
    head, rest = parts[0] if parts else None, parts[1:]
    if not (isinstance(head, np.ndarray) and head.ndim == 1 and head.dtype.kind in "iu"
            and shape and not any(isinstance(part, (np.ndarray, list)) for part in rest)):
        return None
    rows = _rows_in_range(head, shape[0])
    if rows is None:
        return None     # NumPy raises the IndexError
    gathered: npt.NDArray[Any] = reader.gather_rows(name, rows)
    return gathered[(slice(None),) + rest] if rest else gathered


def _rows_needed(index: Any, shape: Tuple[int, ...]) -> Optional[Tuple[int, int, Any]]:
    """For an index whose first part selects along axis 0 (an int, a slice or an
    integer array), the rows [first, last) it touches and the same index relative
    to them; None when the whole tensor is needed (or NumPy must raise the error)."""
    parts = index if isinstance(index, tuple) else (index,)
    if not shape or not parts:
        return None
    head, rest, n = parts[0], parts[1:], shape[0]
    if isinstance(head, slice):
        rows = range(*head.indices(n))
        if not rows:
            return 0, 0, (slice(0, 0),) + rest
        first, last = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
        stop = rows.stop - first
        return first, last, (slice(rows.start - first, stop if stop >= 0 else None,
                                   rows.step),) + rest
    if isinstance(head, (int, np.integer)) and not isinstance(head, (bool, np.bool_)):
        row = int(head) + n if head < 0 else int(head)
        if not 0 <= row < n:
            return None
        return row, row + 1, (0,) + rest
    if isinstance(head, np.ndarray) and head.dtype.kind in "iu" and head.size:
        rows_array = _rows_in_range(head, n)
        if rows_array is None:
            return None
        first, last = int(rows_array.min()), int(rows_array.max()) + 1
        return first, last, (rows_array - first,) + rest
    return None


def _rows_in_range(rows: npt.NDArray[Any], n: int) -> Optional[npt.NDArray[Any]]:
    """Integer row indices with negatives counted from the end, as intp (so that
    adding n cannot wrap a narrow dtype); None when one falls outside [0, n)."""
    as_intp = rows.astype(np.intp)
    as_intp = np.where(as_intp < 0, as_intp + n, as_intp)
    if as_intp.size and (as_intp.min() < 0 or as_intp.max() >= n):
        return None
    return as_intp


def load_file(filename: PathLike, *, backend: str = "mmap", copy: bool = False,
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Dict[str, npt.NDArray[Any]]:
    """Load every tensor of a file, in buffer order.

    By default the arrays are zero-copy views of the file's private map. With
    ``copy=True`` each tensor is read into fresh memory of its own (threads read
    large files in parallel, the GIL released), and no array depends on the file.
    """
    reader = safe_open(filename, backend=backend, max_header_size=max_header_size)
    try:
        return reader.copy_tensors() if copy else reader.get_tensors()
    finally:
        reader.close()


def load_into(filename: PathLike, arrays: Mapping[str, npt.NDArray[Any]], *,
              max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
    """Read the named tensors of a file into caller-supplied arrays, allocating
    nothing. Each array must be C-contiguous, writable, and of its tensor's dtype
    and shape."""
    with safe_open(filename, max_header_size=max_header_size) as reader:
        reader.read_into(dict(arrays))


def load(data: Any, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Dict[str, npt.NDArray[Any]]:
    """Load tensors from a buffer (bytes, bytearray, memoryview, mmap) without copying.

    The arrays view `data` and keep it alive; they are read-only when `data` is.
    """
    reader = _core.Reader()
    reader.open_buffer(data, max_header_size=max_header_size)
    return reader.get_tensors()


def save(tensors: Mapping[str, npt.NDArray[Any]], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """Serialize tensors into the bytes of a safetensors file.

    The bytes are those huggingface safetensors writes for the same input (which
    orders several metadata keys at random; fastst sorts them), and the same
    whatever the insertion order of `tensors` and `metadata`.
    """
    return _plan(tensors, metadata).to_bytes()


def save_file(tensors: Mapping[str, npt.NDArray[Any]], filename: PathLike,
              metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False) -> None:
    """Write tensors to `filename` atomically.

    The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the old
    file or the new one, never a mix, and a failed save leaves the old file as it
    was. With ``fsync=True`` the file and its directory are flushed to disk before
    returning, so the new file also survives a power loss.
    """
    write_atomically(_plan(tensors, metadata), filename, fsync=fsync)


def _plan(tensors: Mapping[str, npt.NDArray[Any]],
          metadata: Optional[Mapping[str, str]]) -> _core.WritePlan:
    specs = [_core.spec_of_array(name, array) for name, array in _as_dict(tensors).items()]
    return _core.plan_write(specs, metadata)


def _as_dict(tensors: Mapping[str, Any]) -> Dict[str, Any]:
    if isinstance(tensors, dict):
        return tensors
    if isinstance(tensors, Mapping):
        return dict(tensors.items())
    raise TypeError(f"tensors must be a dict of str to numpy.ndarray, got {type(tensors).__name__}")

