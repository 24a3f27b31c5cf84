"""SafeSlice: one tensor of an open file, read through NumPy indexing.

With the mmap backend (and buffers) an index applies to the tensor's view and
touches only the pages it reaches; for a few rows far apart, the map is advised so
that each fault reads only the page it touches (``Reader.get_part``). With the pread
backend an index is turned into the rows it needs, and only those rows are read; a
basic index that narrows later axes too (a column block: a tensor-parallel slice, a
device's shard) reads only the runs of bytes of the block it selects from, runs less
than 4 KiB apart as one.
"""
from __future__ import annotations

import re
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Generic, List, Optional, Tuple, TypeVar, Union

import numpy as np

from .._core import (Reader, SafetensorError, SafetensorIndexError, dtype_bits, numpy_dtype,
                     read_runs)
from .._format.blocks import Box, box_of_index, join_gap, runs_of, shape_of, widened, within

if TYPE_CHECKING:   # numpy.typing costs milliseconds to import
    import numpy.typing as npt

    from .._frameworks.registry import Converter

T = TypeVar("T")
Index = Union[int, "np.integer[Any]", slice, EllipsisType, None, List[Any], "npt.NDArray[Any]",
              Tuple[Any, ...]]

# Distinct rows a narrowed pread gather reads at once: bounds its memory whatever the row size.
GATHER_BATCH_BYTES = 16 << 20


class SafeSlice(Generic[T]):
    """One tensor of an open file, read through NumPy indexing.

    What a handle's ``get_slice(name)`` returns, as ``safetensors``' slices:
    ``f.get_slice(name)[index]`` returns exactly ``f.get_tensor(name)[index]``,
    for any NumPy index (ints, slices with steps, ``...``, None, integer and
    boolean arrays). With the default ``"mmap"`` backend a basic index gives
    a view that touches only the pages it reaches (for a few rows far apart,
    a fault reads only its own page, not the disk's read-ahead around it);
    with ``"pread"`` (and for URLs and file objects) only the rows the index
    needs are read, and of those, for a basic index, only the block of
    columns it reaches (runs of bytes less than 4 KiB apart read as one). A
    handle opened for torch or JAX gives the framework's tensors.

    Sub-byte tensors (F4, F6_*) load as packed bytes: an index may select
    along their leading axes, not inside the packed last one.

    Parameters
    ----------
    reader : NumpyHandle
        The open file.
    name : str
        The tensor's name.
    convert : callable, optional
        A framework's converter, ``convert(array, name, info)``, for the
        selected part; None for NumPy arrays.
    handle : object, optional
        The handle that made it (by default `reader`, for NumPy arrays): a
        slice pickles as this handle and the tensor's name, and is unpickled
        as ``handle.get_slice(name)`` on the handle unpickled, which opens the
        file again (see ``NumpyHandle``).

    Raises
    ------
    TensorNotFoundError
        When the file has no tensor `name`.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"x": np.arange(12).reshape(4, 3)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     x = f.get_slice("x")
    ...     x.shape, x.get_dtype(), x[::2, 1].tolist(), x[[3, 0]].tolist()
    ((4, 3), 'I64', [1, 7], [[9, 10, 11], [0, 1, 2]])

    An index outside the tensor is an error, as in NumPy; the message starts with the
    reference's:

    >>> with fastst.safe_open(path) as f:
    ...     f.get_slice("x")[4]
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorIndexError: Error during slicing [4] with shape [4, 3]: index 4 out of bounds for tensor dimension #0 of size 4 (tensor 'x' of ...model.safetensors)
    """

    __module__ = "fastst"

    def __init__(self, reader: Reader, name: str, convert: Optional[Converter[T]] = None,
                 handle: Any = None) -> None:
        self._reader = reader
        self._name = name
        self._info = reader.info(name)
        self._convert = convert
        self._handle = reader if handle is None and convert is None else handle
        self._packed = dtype_bits(self._info.dtype) < 8
        # NumPy indexes the reader's view for these, with no check of fastst's first
        self._viewed = (reader.backend in ("mmap", "buffer") and not self._packed
                        and self._info.array_shape is not None)

    def __reduce__(self) -> Tuple[Any, ...]:
        if self._handle is None:
            raise TypeError(f"{self._reader.source}: tensor {self._name!r}: a slice made "
                            f"with a converter but no handle cannot be pickled; pickle the "
                            f"handle, and call get_slice on it again")
        return _slice_of, (self._handle, self._name)

    def get_shape(self) -> List[int]:
        """The tensor's shape as the header gives it.

        Returns
        -------
        list of int
            As ``safetensors``' ``get_shape()``.
        """
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The tensor's header dtype code, e.g. ``"F32"``.

        Returns
        -------
        str
            As ``safetensors``' ``get_dtype()``.
        """
        return self._info.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """The tensor's shape, as a tuple (as an array's)."""
        return tuple(self._info.shape)

    @property
    def ndim(self) -> int:
        """The tensor's number of axes."""
        return len(self._info.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The NumPy dtype the tensor loads as (``uint8`` for packed sub-byte codes)."""
        return numpy_dtype(self._info.dtype)

    def _array_dtype(self) -> np.dtype[Any]:
        """The dtype of the reader's arrays of the tensor: `dtype`, or its bits where
        the reader leaves ml_dtypes out (see ``Reader.uses_ml_dtypes``)."""
        dtype: np.dtype[Any] = self._reader.array_dtype(self._info.dtype)
        return dtype

    def __len__(self) -> int:
        if not self._info.shape:
            raise TypeError("len() of a 0-d tensor")
        return int(self._info.shape[0])

    def __getitem__(self, index: Index) -> T:
        try:
            if self._viewed and _is_plain(index):
                array = self._reader.get_part(self._name, index)
            else:
                array = self._select(index)
        except SafetensorError:
            raise
        except (IndexError, ValueError) as error:   # NumPy's, for this index
            kind = SafetensorIndexError if isinstance(error, IndexError) else SafetensorError
            words = _in_reference_words(str(error), index, self._info.shape)
            if words is None:
                raise kind(f"{self._reader.source}: tensor {self._name!r}: {error}") from None
            # the reference's message first: code written for it compares the start
            raise kind(f"{words} (tensor {self._name!r} of {self._reader.source})") from None
        if self._convert is None:
            return array  # type: ignore[return-value]  # T is the NumPy array here
        return self._convert(array, self._name, self._info)

    def _select(self, index: Any) -> npt.NDArray[Any]:
        array_shape = self._info.array_shape
        if array_shape is None:   # get_tensor says why
            return self._reader.get_tensor(self._name)
        if self._packed and self._selects_all_packed(index):
            index = Ellipsis   # the whole tensor, however many axes the index named
        _check_arrays_in_range(index, array_shape)
        if self._reader.backend in ("pread", "ranges"):   # reads into fresh memory
            return self._read_selected(index, array_shape)
        gather = _as_gather(index, array_shape)
        rows = None if gather is None else gather[0]
        result: npt.NDArray[Any] = self._reader.get_part(self._name, index, rows)
        return result

    def _selects_all_packed(self, index: Any) -> bool:
        """Sub-byte tensors surface as packed bytes: indices may select along the
        leading axes, but not inside the packed last axis (nor inside a tensor packed
        flat, whose axes do not survive packing). True when the index selects everything."""
        parts = index if isinstance(index, tuple) else (index,)
        if all(_selects_everything(part) for part in parts):
            return True
        shape, array_shape = self._info.shape, self._info.array_shape or ()
        if (len(array_shape) != len(shape) or len(parts) >= len(shape)
                or any(part is Ellipsis for part in parts)):
            raise SafetensorError(
                f"{self._reader.source}: tensor {self._name!r} ({self._info.dtype}) is stored "
                f"packed; index only its leading axes")
        return False

    def _read_selected(self, index: Any, shape: Tuple[int, ...]) -> npt.NDArray[Any]:
        """pread backend: read only the rows `index` selects along the first axis, or,
        for a basic index that narrows later axes too, only the bytes of the box it
        selects from (its runs of bytes that lie less than 4 KiB apart read as one)."""
        gather = _as_gather(index, shape)
        if gather is not None:
            return self._gather(*gather)
        found = box_of_index(index, shape)
        if found is not None:
            box, local_index = found
            read = widened(box, shape, self._array_dtype().itemsize,
                           join_gap(self._reader.backend))
            if any(span != (0, n) for span, n in zip(read[1:], shape[1:])):
                boxed = self._read_box(read, shape)[within(box, read)]
                return boxed[local_index]  # type: ignore[no-any-return]
        rows = _rows_needed(index, shape)
        if rows is None:
            result: npt.NDArray[Any] = self._reader.get_tensor(self._name)[index]
            return result
        first, last, local_index = rows
        part: npt.NDArray[Any] = self._reader.read_rows(self._name, first, last)
        return part[local_index]  # type: ignore[no-any-return]

    def _read_box(self, box: Box, shape: Tuple[int, ...]) -> npt.NDArray[Any]:
        """The bytes of `box`, and only those, read into a fresh array of its shape."""
        dtype = self._array_dtype()
        offsets, length = runs_of(box, shape, dtype.itemsize)
        out = np.empty(shape_of(box), dtype)
        read = getattr(self._reader, "read_runs", None)   # a handle's (it may verify first)
        if read is None:
            return read_runs(self._reader, self._name, offsets, length, out)
        boxed: npt.NDArray[Any] = read(self._name, offsets, length, out)
        return boxed

    def _gather(self, rows: npt.NDArray[Any], rest: Tuple[Any, ...]) -> npt.NDArray[Any]:
        """Rows `rows` (in range), each then narrowed by `rest`. A plain gather reads
        what it returns; a narrowed one reads each distinct row once, a batch at a
        time, and narrows it before reading the next batch."""
        if not rest:
            gathered: npt.NDArray[Any] = self._reader.gather_rows(self._name, rows)
            return gathered
        distinct, inverse = np.unique(rows, return_inverse=True)
        narrowed = [self._reader.gather_rows(self._name, batch)[(slice(None),) + rest]
                    for batch in _batches(distinct, self._row_bytes())]
        joined = narrowed[0] if len(narrowed) == 1 else np.concatenate(narrowed)
        return joined[inverse]

    def _row_bytes(self) -> int:
        shape = self._info.array_shape or ()
        return int(np.prod(shape[1:], dtype=object)) * self._array_dtype().itemsize

    def __repr__(self) -> str:
        return f"<fastst.SafeSlice {self._name!r} {self._info.dtype} {self._info.shape}>"


def _slice_of(handle: Any, name: str) -> SafeSlice[Any]:
    """A pickled SafeSlice, unpickled: its handle's (unpickled: opened again)."""
    made: SafeSlice[Any] = handle.get_slice(name)
    return made


PLAIN_PARTS = frozenset((int, slice, type(None), type(Ellipsis)))


def _is_plain(index: Any) -> bool:
    """Whether `index` is made of ints, slices, None and Ellipsis alone (no arrays,
    no lists): NumPy's own checks of it are all there is to check."""
    kind = type(index)
    if kind is int or kind is slice:
        return True
    return kind is tuple and all(type(part) in PLAIN_PARTS for part in index)


def _selects_everything(part: Any) -> bool:
    return part is Ellipsis or (isinstance(part, slice) and part == slice(None))


def _batches(rows: npt.NDArray[Any], row_bytes: int) -> List[npt.NDArray[Any]]:
    """`rows` cut into pieces of at most GATHER_BATCH_BYTES (one row at least);
    one empty piece when there are no rows."""
    per_batch = max(1, GATHER_BATCH_BYTES // row_bytes) if row_bytes else max(1, rows.size)
    return [rows[start:start + per_batch] for start in range(0, max(rows.size, 1), per_batch)]


def _as_gather(index: Any, shape: Tuple[int, ...]
               ) -> Optional[Tuple[npt.NDArray[Any], Tuple[Any, ...]]]:
    """An index led by a 1-d integer array (or list), followed by basic indices
    only (ints, slices, Ellipsis, None): (its rows, in range, as intp; the rest).
    None when it is not one."""
    parts = index if isinstance(index, tuple) else (index,)
    if not shape or not parts:
        return None
    head, rest = parts[0], parts[1:]
    if isinstance(head, list):
        try:
            head = np.asarray(head)
        except ValueError:   # ragged: NumPy's own indexing says what is wrong
            return None
    if not (isinstance(head, np.ndarray) and head.ndim == 1 and head.dtype.kind in "iu"
            and all(_is_basic(part) for part in rest)):
        return None
    return _rows_in_range(head, shape[0]), rest


def _is_basic(part: Any) -> bool:
    if isinstance(part, (bool, np.bool_)):
        return False
    return part is None or part is Ellipsis or isinstance(part, (slice, int, np.integer))


def _rows_needed(index: Any, shape: Tuple[int, ...]) -> Optional[Tuple[int, int, Any]]:
    """For an index whose first part selects along axis 0 (an int, a slice or an
    integer array), the rows [first, last) it touches and the same index relative
    to them; None when the whole tensor is needed."""
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
            raise IndexError(f"index {int(head)} is out of bounds for axis 0 with size {n}")
        return row, row + 1, (0,) + rest
    if isinstance(head, np.ndarray) and head.dtype.kind in "iu" and _selects_nothing(parts):
        return 0, 0, parts   # NumPy checks none of the arrays' values against the axes
    if isinstance(head, np.ndarray) and head.dtype.kind in "iu" and head.size:
        rows_array = _rows_in_range(head, n)
        first, last = int(rows_array.min()), int(rows_array.max()) + 1
        return first, last, (rows_array - first,) + rest
    return None


def _selects_nothing(parts: Tuple[Any, ...]) -> bool:
    """Whether the integer and boolean arrays of an index broadcast to no element."""
    shapes = []
    for part in parts:
        if isinstance(part, list):
            try:
                part = np.asarray(part)
            except ValueError:   # ragged: NumPy's own indexing says what is wrong
                return False
        if isinstance(part, np.ndarray):
            shapes.append((int(np.count_nonzero(part)),) if part.dtype == np.bool_ else part.shape)
    if not shapes:
        return False
    try:
        return 0 in np.broadcast_shapes(*shapes)
    except ValueError:   # shapes that do not broadcast: NumPy raises for the index
        return False


def _rows_in_range(rows: npt.NDArray[Any], n: int, axis: int = 0) -> npt.NDArray[Any]:
    """Integer indices along `axis` (of size `n`) with negatives counted from the end,
    as intp (so that adding n cannot wrap a narrow dtype); IndexError when one falls
    outside [0, n)."""
    if rows.dtype.kind == "u" and rows.size and rows.max() > np.iinfo(np.intp).max:
        raise IndexError(f"index {int(rows.max())} is out of bounds for axis {axis} with "
                         f"size {n}")
    as_intp = rows.astype(np.intp)
    as_intp = np.where(as_intp < 0, as_intp + n, as_intp)
    if as_intp.size and (as_intp.min() < 0 or as_intp.max() >= n):
        bad = rows.reshape(-1)[int(np.argmax((as_intp < 0) | (as_intp >= n)))]
        raise IndexError(f"index {int(bad)} is out of bounds for axis {axis} with size {n}")
    return as_intp


def _check_arrays_in_range(index: Any, shape: Tuple[int, ...]) -> None:
    """IndexError when a value of an integer array of `index` falls outside its axis.
    NumPy checks them only when the result has elements (before 2.5 it warned
    otherwise); checked here, an index says the same whatever the backend and
    NumPy's version."""
    parts = [np.asarray(part) if isinstance(part, list) else part
             for part in (index if isinstance(index, tuple) else (index,))]
    taken = [0 if part is None or part is Ellipsis else
             part.ndim if isinstance(part, np.ndarray) and part.dtype == np.bool_ else 1
             for part in parts]
    if sum(taken) > len(shape):
        return   # NumPy says how many indices are too many
    axis = 0
    for place, part in enumerate(parts):
        if part is Ellipsis:
            axis = len(shape) - sum(taken[place + 1:])
            continue
        if isinstance(part, np.ndarray) and part.dtype.kind in "iu":
            _rows_in_range(part.reshape(-1), shape[axis], axis)
        axis += taken[place]


# NumPy's words for an index outside a tensor, and the reference's (which code
# written for it looks for): one for an index past the end, one for a negative one
NUMPY_OUT_OF_BOUNDS = re.compile(r"index (-?\d+) is out of bounds for axis (\d+) with size (\d+)")
TOO_MANY_INDICES = "too many indices for array"


def _in_reference_words(message: str, index: Any, shape: List[int]) -> Optional[str]:
    """NumPy's message for `index`, which does not fit a tensor of `shape`, as the
    reference words it; None where the reference has no such message."""
    found = NUMPY_OUT_OF_BOUNDS.search(message)
    if found:
        position, axis, size = found.groups()
        if position.startswith("-"):
            return f"Invalid index {position} for dimension {axis} of size {size}"
        words = f"index {position} out of bounds for tensor dimension #{axis} of size {size}"
        written = _as_the_reference_writes(index, shape)
        if written is None:
            return words
        return f"Error during slicing {written} with shape {list(shape)}: {words}"
    if message.startswith(TOO_MANY_INDICES):
        return f"more slicing indexes than dimensions in tensor ({message})"
    return None


def _as_the_reference_writes(index: Any, shape: List[int]) -> Optional[str]:
    """`index` as the reference writes it in its messages (``[2:, 20]``: integers
    counted from the start, slices as ``start:stop``), where it is an index the
    reference takes (integers, and slices of step 1 with no negative bound, at most
    one a dimension); None otherwise."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > len(shape):
        return None
    written = []
    for part, size in zip(parts, shape):
        if isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)):
            written.append(str(int(part) + size if part < 0 else int(part)))
        elif (isinstance(part, slice) and part.step in (None, 1)
              and all(bound is None or isinstance(bound, (int, np.integer)) and bound >= 0
                      for bound in (part.start, part.stop))):
            written.append(":".join("" if bound is None else str(int(bound))
                                    for bound in (part.start, part.stop)))
        else:
            return None
    return f"[{', '.join(written)}]"
