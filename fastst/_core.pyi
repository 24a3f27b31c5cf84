from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

# The API reference is generated from this file's docstrings (the compiled module
# keeps shorter ones of its own); their examples run in tests/test_docs.py.

DEFAULT_MAX_HEADER_SIZE: Final[int]
"""The largest header a reader accepts unless ``max_header_size`` says otherwise, in
bytes (100,000,000: 100 MB, as the reference's limit).

A file whose 8-byte prefix announces a longer header is refused with a
`SafetensorError` before anything more is read.

Examples
--------
>>> import fastst
>>> fastst.DEFAULT_MAX_HEADER_SIZE
100000000
"""

MAX_ALIGN: Final[int]
"""The largest alignment the writers take (``align=``), in bytes: 1 MiB.

Examples
--------
>>> from fastst.writer import MAX_ALIGN
>>> MAX_ALIGN
1048576
"""

ALIGNED_HEADER_SPACES: Final[int]
"""The least number of spaces an aligned file's header ends in (8): more than the
format's own layout leaves, so that ``update_metadata`` keeps such a file aligned."""

DTYPE_CODES: Final[tuple[str, ...]]
"""The header codes of the format's dtypes (``"F32"``, ``"BF16"``...), in the order the
format ranks them: the codes of `DTYPES`, in its order.

Examples
--------
>>> import fastst
>>> fastst.DTYPE_CODES[:6]
('BOOL', 'F4', 'F6_E2M3', 'F6_E3M2', 'U8', 'I8')
>>> "BF16" in fastst.DTYPE_CODES
True
"""

class TensorInfo(NamedTuple):
    """What a file's header says of one tensor, as ``info(name)`` gives it.

    A named tuple of the tensor's dtype code, its shape, its byte range in the
    tensor data, and the shape of the NumPy array it loads as.

    Attributes
    ----------
    dtype : str
        The header dtype code, e.g. ``"F32"`` (see `DTYPE_CODES`).
    shape : list of int
        The shape the header gives.
    data_offsets : tuple of (int, int)
        The tensor's bytes, ``[begin, end)``, counted from the start of the
        tensor data (which starts after the 8-byte prefix and the header).
    array_shape : tuple of int or None
        The shape of the NumPy array it loads as: `shape`, except for the
        sub-byte dtypes (F4, F6_*), whose packed bytes load as ``uint8`` with
        the last axis shrunk (or flat when the last axis does not hold whole
        bytes). None when NumPy cannot hold the shape (more than 64 axes, or a
        dimension or size past what an index of this platform reaches).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"w": np.zeros((2, 3), np.float32)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     info = f.info("w")
    >>> info
    TensorInfo(dtype='F32', shape=[2, 3], data_offsets=(0, 24), array_shape=(2, 3))
    >>> info.data_offsets[1] - info.data_offsets[0]
    24
    """
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]
    array_shape: tuple[int, ...] | None

class DtypeInfo(NamedTuple):
    """One dtype of the format: a row of `DTYPES`.

    Attributes
    ----------
    code : str
        The header code, e.g. ``"BF16"``.
    bits : int
        Bits per element (4 and 6 for the packed sub-byte dtypes).
    numpy : str
        The name of the NumPy dtype its tensors load as: ``"bfloat16"`` and the
        float8 names are ml_dtypes', and the sub-byte codes load as their
        packed bytes, ``"uint8"``.
    torch : str or None
        The name of the torch dtype (``"bfloat16"``, ``"float4_e2m1fn_x2"``...),
        or None where torch has none (the F6 codes).

    Examples
    --------
    >>> import fastst
    >>> {row.code: row for row in fastst.DTYPES}["BF16"]
    DtypeInfo(code='BF16', bits=16, numpy='bfloat16', torch='bfloat16')
    """
    code: str
    bits: int
    numpy: str
    torch: str | None

DTYPES: Final[tuple[DtypeInfo, ...]]
"""The one table of the format's dtypes, a `DtypeInfo` a row, in the order the format
ranks them (writers place tensors by descending rank, then by name).

Every dtype fastst reads and writes is here, with the NumPy dtype it loads as and the
torch dtype it matches; the other tables (`DTYPE_CODES`,
``fastst.torch.TORCH_DTYPES``) derive from it. See the guide's page on dtypes.

Examples
--------
>>> import fastst
>>> len(fastst.DTYPES), fastst.DTYPES[0]
(22, DtypeInfo(code='BOOL', bits=8, numpy='bool', torch='bool'))
>>> [row.code for row in fastst.DTYPES if row.bits < 8]
['F4', 'F6_E2M3', 'F6_E3M2']
"""

class SafetensorError(ValueError):
    """A file, a buffer, a tensor or an argument breaks a rule of the format.

    The base of fastst's errors, and a `ValueError`, as the reference's
    ``SafetensorError`` is. The message names the file (or ``<buffer>``), the
    tensor and the rule broken: ``"model.safetensors: tensor 'w': data_offsets
    [0, 8] overlap tensor 'b'"``. Where the reference raises another built-in
    type, fastst raises a subclass that is both: `TensorNotFoundError`,
    `SafetensorIndexError`, `SafetensorTypeError`,
    `SafetensorNotImplementedError`.

    Examples
    --------
    >>> import fastst
    >>> try:
    ...     fastst.load(b"short")
    ... except fastst.SafetensorError as error:
    ...     print(error)
    <buffer>: file is 5 bytes, shorter than the 8-byte header length
    """

class SafetensorIndexError(SafetensorError, IndexError):
    """An index or a row reaches outside a tensor.

    Both a `SafetensorError` and the `IndexError` NumPy raises for the same
    index.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(3)}, path)
    >>> try:
    ...     with fastst.safe_open(path) as f:
    ...         f.get_slice("x")[5]
    ... except IndexError as error:
    ...     print(type(error).__name__, "-", error)
    SafetensorIndexError - Error during slicing [5] with shape [3]: index 5 out of bounds for tensor dimension #0 of size 3 (tensor 'x' of ...x.safetensors)
    """

class SafetensorTypeError(SafetensorError, TypeError):
    """A value of a type, or a dtype, that safetensors cannot store.

    Both a `SafetensorError` and a `TypeError`.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> try:
    ...     fastst.save({"text": np.array(["a"])})
    ... except TypeError as error:
    ...     print(type(error).__name__, "-", error)
    SafetensorTypeError - tensor 'text': dtype <U1 has no safetensors code (supported: ...)
    """

class SafetensorNotImplementedError(SafetensorError, NotImplementedError):
    """Something the format, or fastst, cannot do.

    Saving a tensor that has no data (torch's meta device), a dask array of a
    sub-byte dtype, a view onto a file that cannot be mapped. Both a
    `SafetensorError` and the `NotImplementedError` (a `RuntimeError`) the
    reference raises.

    Examples
    --------
    >>> import fastst
    >>> issubclass(fastst.SafetensorNotImplementedError, NotImplementedError)
    True
    """

class NoSuchFileError(FileNotFoundError):
    """A file to open that does not exist.

    The `FileNotFoundError` the system gives (its ``errno``, ``strerror`` and
    ``filename``), whose message is worded as the reference's:
    ``No such file or directory: PATH``.

    Examples
    --------
    >>> import fastst
    >>> try:
    ...     fastst.safe_open("missing.safetensors")
    ... except FileNotFoundError as error:
    ...     print(error, error.errno)
    No such file or directory: missing.safetensors 2
    """

class TensorNotFoundError(SafetensorError, KeyError):
    """The file holds no tensor of that name.

    Both a `SafetensorError` and a `KeyError`, as a mapping raises; its
    message is the plain text, not a quoted key.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.zeros(1)}, path)
    >>> try:
    ...     with fastst.safe_open(path) as f:
    ...         f.get_tensor("y")
    ... except KeyError as error:
    ...     print(type(error).__name__, "-", error)
    TensorNotFoundError - ...x.safetensors: no tensor named 'y'
    """

def numpy_dtype(code: str, /) -> np.dtype[Any]: ...
def dtype_bits(code: str, /) -> int: ...

class Reader:
    """The compiled reader of one safetensors file or buffer, whose header it has
    validated in full: the reading methods of `fastst.NumpyHandle`.

    Use ``fastst.safe_open`` (or ``fastst.load``), which return one; the
    ``open_*`` methods are the low-level ways to open a bare Reader.
    """
    @property
    def source(self) -> str:
        """What error messages call the file: its path, URL, or ``"<buffer>"``."""
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called; a closed handle reads nothing more."""
    def open_file(
        self,
        filename: str | bytes | os.PathLike[str] | os.PathLike[bytes],
        backend: str = "mmap",
        *,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        threads: int = 0,
    ) -> None:
        """Open the local file `filename`: read and validate its header, and map it
        (`backend` ``"mmap"``) or keep it open for reads (``"pread"``). Its read
        plans are shared by `threads` threads (0 to 64) where ``read_options`` sets
        none; 0: ``read_threads()``.

        Raises
        ------
        OSError
            When the file cannot be opened (`FileNotFoundError`,
            `IsADirectoryError`, `PermissionError`).
        SafetensorError
            When `backend` is not known, `threads` is out of range, or the
            file breaks a rule of the format.
        """
    def open_buffer(
        self, data: Buffer, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        source: str = "<buffer>"
    ) -> None:
        """Open a buffer (bytes, bytearray, memoryview, mmap) holding a whole file,
        without copying it; `source` is what messages call it.

        Raises
        ------
        SafetensorError
            When the bytes break a rule of the format.
        """
    def open_ranges(
        self,
        source: str,
        size: int,
        fetch: Callable[[list[tuple[int, int]]], Sequence[Buffer]],
        *,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        identity: Hashable | None = None,
    ) -> None:
        """Open a file of `size` bytes read by byte ranges: ``fetch(ranges)`` takes
        a list of ``(offset, length)`` and returns one bytes-like object per range,
        exactly that long (what ``safe_open`` does for URLs and file objects).

        A `fetch` may also have a ``fetch_into(ranges, buffers)`` method, which
        puts each range's bytes into its buffer (a writable memoryview exactly
        as long, valid only during the call) and returns a list of the bytes
        each got: tensors of 64 KiB or more are then fetched straight into
        their arrays, each a range of its own (neighbours in the file, which the
        fetch may join into shared requests), all in one call with the first
        batch of the others.

        A `fetch` whose store ignores range requests says so with a true
        ``ranges_ignored`` attribute: it is then asked only for ranges that
        start at byte 0 (the rest of a header longer than the first request's
        64 KiB, with the start again; and, for a read of at least as many bytes
        as the tensors hold, such as ``get_tensors``, the whole file as one
        range).

        Raises
        ------
        SafetensorError
            When an answer of `fetch` is not what was asked for, or the bytes
            break a rule of the format.
        """
    def get_tensor(self, name: str, *, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
        """Tensor `name` as a NumPy array.

        With the ``"mmap"`` backend (and for buffers) the array is a zero-copy
        view of the file's private map: writable, its writes never reach the
        file, and valid after the handle is closed. With ``"pread"`` (and for
        URLs and file objects) the tensor is read into fresh memory.

        Parameters
        ----------
        name : str
            The tensor's name.
        out : numpy.ndarray, optional
            A C-contiguous, writable array of the tensor's dtype and array
            shape (see `TensorInfo`) to read the bytes into; it is returned.

        Returns
        -------
        numpy.ndarray
            The tensor, in the NumPy dtype of its code (ml_dtypes' for
            bfloat16 and float8, packed ``uint8`` for sub-byte codes).

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        SafetensorError
            When the handle is closed, or the tensor's bytes cannot be read
            (a file truncated since it was opened).
        ValueError
            When `out` has another shape or dtype, or is not C-contiguous.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
        >>> f = fastst.safe_open(path)
        >>> f.get_tensor("w")
        array([[1., 0.],
               [0., 1.]], dtype=float32)
        >>> out = np.empty((2, 2), np.float32)
        >>> f.get_tensor("w", out=out) is out
        True
        >>> f.close()
        """
    def get_part(
        self, name: str, index: Any, rows: npt.NDArray[Any] | None = None
    ) -> Any:
        """``get_tensor(name)[index]``, for a part of a tensor: what a slice's
        indexing gives with the ``"mmap"`` backend (see ``SafeSlice``).

        Where NumPy makes a view of the map (an index of ints, slices, None
        and Ellipsis), the tensor's range of the map is advised for what the
        view touches: a few short runs of bytes far apart (some rows) are read
        by faults that read the page they touch alone (``MADV_RANDOM``), where
        the kernel would read up to its read-ahead (``read_ahead_kb``) around
        each; a larger part keeps the kernel's read-around, and so does a
        tensor that `get_tensor` hands out whole afterwards.

        Parameters
        ----------
        name : str
            The tensor's name.
        index : object
            Any NumPy index.
        rows : numpy.ndarray, optional
            For an index led by an integer array: its rows, in range, as
            ``intp``; the map is advised for them before NumPy copies them.

        Returns
        -------
        numpy.ndarray or scalar
            As ``get_tensor(name)[index]``.

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        IndexError
            NumPy's, for an index that does not fit the tensor.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(6).reshape(3, 2)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.get_part("x", (1, slice(None))).tolist()
        [2, 3]
        """
    def copy_tensors(self) -> dict[str, npt.NDArray[Any]]:
        """Every tensor, in buffer order, each read into fresh memory of its own.

        Unlike `get_tensors`, no array depends on the file: large files are
        read by several threads at once, the GIL released.

        Returns
        -------
        dict of str to numpy.ndarray
            The tensors, by name, in the order of their bytes in the file.

        Raises
        ------
        SafetensorError
            When the handle is closed, or the file cannot be read whole.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(3, dtype=np.int8)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     copies = f.copy_tensors()
        >>> copies["x"].tolist(), copies["x"].base is None
        ([0, 1, 2], True)
        """
    def will_need(self, names: Iterable[str]) -> int:
        """Ask the kernel to start reading tensors into the page cache, and return.

        For a plan the caller knows but will read in its own order (a converter
        that writes tensors out of file order, rows gathered later): the kernel
        reads their bytes in the background (``posix_fadvise(POSIX_FADV_WILLNEED)``
        over each run of adjacent tensors, in pieces of the device's read-ahead
        limit: Linux reads no more of one call), so that the reads that follow
        find them in memory. The process holds no memory for them: the page cache
        does, and may drop them again under memory pressure. To read ahead into
        memory of the process, within a budget, use ``iter_tensors`` or
        ``prefetch``.

        Parameters
        ----------
        names : iterable of str
            The tensors to read ahead.

        Returns
        -------
        int
            The bytes asked for: 0 for a buffer (its bytes are in memory
            already) and for URLs and file objects (read by ranges, with no page
            cache).

        Raises
        ------
        TensorNotFoundError
            When a name is not a tensor of the file.
        SafetensorError
            When the handle is closed, or the file was replaced or truncated
            since it was opened.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"a": np.zeros(4, np.uint8), "b": np.ones(4, np.uint8)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.will_need(["b", "a"]), f.get_tensor("b").tolist()
        (8, [1, 1, 1, 1])
        """
    def prefetch_rows(self, name: str, first: int, stop: int) -> int:
        """Ask the kernel to start reading rows ``[first, stop)`` of tensor
        `name`'s first axis (clipped to it) into the page cache, as `will_need`
        does whole tensors (the thread ``Loader`` asks it of the blocks of a
        block shuffle over more than half the memory; see `cache_rows`). The
        number of bytes asked for: 0 for a buffer or a file read by ranges.

        Raises
        ------
        TensorNotFoundError
            When there is no tensor `name`.
        IndexError
            When the tensor is 0-d.
        """
    def cache_rows(self, name: str, first: int, stop: int) -> int:
        """Read rows ``[first, stop)`` of tensor `name`'s first axis (clipped to
        it) into the page cache now, without the GIL, and return once they are
        there (the thread ``Loader`` reads a shuffle's blocks so).

        The file is read in the whole 2 MiB-aligned pieces that hold the rows
        (up to 2 MiB more on each side), each in one request, and the page
        cache keeps each as one 2 MiB folio where the file system allows: a map
        of the file then maps it by 2 MiB, which a gather of scattered rows
        needs. A piece whose first and last pages the page cache holds is not
        read again. Before the first read of the file's first piece, the
        header's pages (read at open) are dropped from the page cache where
        the rest of the piece is not held, so that it too is one folio.
        Where the kernel cannot (before Linux 5.14) it asks as
        `prefetch_rows` does and returns at once.

        Returns
        -------
        int
            The bytes of the rows: 0 for a buffer or a file read by ranges.

        Raises
        ------
        TensorNotFoundError
            When there is no tensor `name`.
        IndexError
            When the tensor is 0-d.
        SafetensorError
            When the file at the path is another, or shorter than when opened.
        """
    def rows_cached(self, name: str, first: int, stop: int) -> bool:
        """Whether `cache_rows` would find rows ``[first, stop)`` of tensor
        `name` held already and read nothing: the page cache holds the first
        and the last page of every 2 MiB piece that holds them (asked of the
        file's map, without the GIL). A tensor it cannot read rows of raises
        as in `cache_rows`.

        Returns
        -------
        bool
            True also where the rows are no file's (a buffer's, a file read by
            ranges) or where there are none; False for a file read without a
            map (``backend="pread"``), which cannot be asked so.
        """
    def read_ahead_on_faults(self, on: bool) -> bool:
        """Whether a fault on the file's map that reads from the file reads
        ahead of the page it touches, as the kernel does by default (`on`), or
        reads that page alone (``MADV_RANDOM``). A reader whose rows are read
        into the page cache by `cache_rows`, in the order they are needed,
        turns it off: the read ahead that a gather's first touch of a piece
        starts would read the pieces after it before those needed next.

        Returns
        -------
        bool
            True where it is so; False for a file read otherwise than by its
            map.
        """
    def read_into(self, arrays: dict[str, npt.NDArray[Any]]) -> None:
        """Read the named tensors into caller-supplied arrays, allocating nothing.

        Parameters
        ----------
        arrays : dict of str to numpy.ndarray
            For each tensor to read, a C-contiguous, writable array of its
            dtype and array shape.

        Raises
        ------
        TensorNotFoundError
            When a name is not a tensor of the file.
        ValueError
            When an array has another shape or dtype, or is not C-contiguous.
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(4, dtype=np.int16)}, path)
        >>> buffer = np.empty(4, np.int16)
        >>> with fastst.safe_open(path) as f:
        ...     f.read_into({"x": buffer})
        >>> buffer.tolist()
        [0, 1, 2, 3]
        """
    def __getitem__(self, name: str, /) -> npt.NDArray[Any]: ...
    def get_tensors(self) -> dict[str, npt.NDArray[Any]]:
        """Every tensor, in buffer order, as `get_tensor` gives each.

        Views of the map with the ``"mmap"`` backend; fresh memory otherwise
        (a file read by ranges is read in one plan of requests).

        Returns
        -------
        dict of str to numpy.ndarray
            The tensors, by name, in the order of their bytes in the file.

        Raises
        ------
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"b": np.zeros(1), "a": np.ones(2)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     list(f.get_tensors())
        ['a', 'b']
        """
    def keys(self) -> list[str]:
        """The names of the file's tensors, sorted.

        Returns
        -------
        list of str
            Sorted names (`offset_keys` gives them in file order).

        Raises
        ------
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"b": np.zeros(1), "a": np.zeros(1)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.keys(), len(f), "a" in f
        (['a', 'b'], 2, True)
        """
    def offset_keys(self) -> list[str]:
        """The names of the file's tensors, in the order of their bytes in the file.

        Returns
        -------
        list of str
            Names in buffer order.

        Raises
        ------
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"a": np.zeros(1, np.int8), "b": np.zeros(1, np.float64)}, path)
        >>> with fastst.safe_open(path) as f:     # writers place wider dtypes first
        ...     f.offset_keys()
        ['b', 'a']
        """
    def metadata(self) -> dict[str, str] | None:
        """The file's ``__metadata__``: a dict of str to str, or None when it has none.

        Returns
        -------
        dict of str to str or None
            A new dict at each call.

        Raises
        ------
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.zeros(1)}, path, metadata={"format": "np"})
        >>> with fastst.safe_open(path) as f:
        ...     f.metadata()
        {'format': 'np'}
        """
    def info(self, name: str) -> TensorInfo:
        """What the header says of tensor `name`, read without touching its bytes.

        Parameters
        ----------
        name : str
            The tensor's name.

        Returns
        -------
        TensorInfo
            Its dtype code, shape, data offsets and NumPy array shape.

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.zeros((2, 2), np.int8)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.info("x")
        TensorInfo(dtype='I8', shape=[2, 2], data_offsets=(0, 4), array_shape=(2, 2))
        """
    def read_rows(self, name: str, first: int, last: int) -> npt.NDArray[Any]:
        """Rows ``[first, last)`` of tensor `name`'s first axis.

        A view with the ``"mmap"`` backend and for buffers; with ``"pread"``
        only those rows are read, into fresh memory. A few rows of a mapped
        file are read by faults that read the page they touch alone, as
        `get_part` advises the map.

        Parameters
        ----------
        name : str
            The tensor's name; it must have at least one axis.
        first, last : int
            The rows, ``0 <= first <= last <= len``.

        Returns
        -------
        numpy.ndarray
            The rows, of shape ``(last - first, *shape[1:])``.

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        IndexError
            When the rows are not within the tensor, or it has no axis.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(6).reshape(3, 2)}, path)
        >>> with fastst.safe_open(path, backend="pread") as f:
        ...     f.read_rows("x", 1, 3).tolist()
        [[2, 3], [4, 5]]
        """
    def gather_rows(self, name: str, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Rows `rows` of tensor `name`'s first axis, in a fresh array: the rows
        must be an ``intp`` array, each in range (`gather` takes any integers).

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        SafetensorIndexError
            When a row is out of range, or the tensor has no axis.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(4)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.gather_rows("x", np.array([3, 0], dtype=np.intp)).tolist()
        [3, 0]
        """
    def gather(
        self, name: str, rows: npt.ArrayLike, out: npt.NDArray[Any] | None = None
    ) -> npt.NDArray[Any]:
        """Rows `rows` of tensor `name`'s first axis, copied in their order: a batch
        of a data set in one call.

        Only those rows are read: the ``"pread"`` backend reads each run of
        adjacent rows in one call; mapped files and buffers copy from memory,
        the GIL released, a few rows far apart from a map advised as
        `get_part` advises them (a fault reads the page it touches alone).

        Parameters
        ----------
        name : str
            The tensor's name; it must have at least one axis.
        rows : sequence or array of int
            Row numbers, in any order, repeats allowed, any integer dtype,
            negatives counted from the end (as NumPy does).
        out : numpy.ndarray, optional
            A C-contiguous array of the result's shape and dtype to copy the
            rows into; it is returned.

        Returns
        -------
        numpy.ndarray
            The rows, of shape ``(len(rows), *shape[1:])``.

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        SafetensorIndexError
            When a row is out of range, or the tensor has no axis.
        SafetensorTypeError
            When `rows` is not a 1-d sequence of integers.
        ValueError
            When `out` has another shape or dtype, or is not C-contiguous.
        SafetensorError
            When the file was replaced or truncated since it was opened, even
            while the rows were copied from its map (the copy's fault is caught).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
        >>> fastst.save_file({"x": np.arange(10).reshape(5, 2)}, path)
        >>> with fastst.safe_open(path, backend="pread") as f:
        ...     f.gather("x", [4, 0, -1]).tolist()
        [[8, 9], [0, 1], [8, 9]]
        """
    @property
    def file_identity(self) -> tuple[Any, ...] | None:
        """The version of the file opened: for a local file ``(absolute path,
        st_dev, st_ino, st_size, st_mtime_ns)`` as it was when opened, for a URL
        the object's URL, size, ETag and modification time; None for a buffer.
        Another handle on the same, unchanged file has the same identity."""
    @property
    def backend(self) -> str:
        """How tensors are served: ``"mmap"``, ``"pread"``, ``"ranges"`` (URLs and
        file objects) or ``"buffer"``."""
    @property
    def data_start(self) -> int:
        """Where the tensor data starts in the file: 8 + the header's length."""
    @property
    def uses_ml_dtypes(self) -> bool:
        """Whether tensors of the dtypes NumPy lacks (bfloat16, float8) come as
        arrays of ml_dtypes' dtypes (True, the default: ml_dtypes is imported when
        a file holding one opens, so that reads never import) or as their bits,
        unsigned integers of their width (False: what a framework with dtypes of
        its own views, with no ml_dtypes loaded)."""
    @uses_ml_dtypes.setter
    def uses_ml_dtypes(self, value: bool) -> None: ...
    def array_dtype(self, code: str) -> np.dtype[Any]:
        """The NumPy dtype of this reader's arrays of header dtype `code`:
        ``fastst.numpy_dtype(code)``, or its bits where `uses_ml_dtypes` is False.

        Raises
        ------
        SafetensorError
            When `code` is not a dtype of the format.
        """
    def __len__(self) -> int: ...
    def __contains__(self, name: object, /) -> bool: ...
    def __iter__(self) -> Iterator[str]: ...
    def close(self) -> None:
        """Let go of the file: the handle reads nothing more, and arrays it gave
        stay valid (a view keeps the map alive). Closing again does nothing."""

def last_level_cache() -> int:
    """The bytes of the first CPU's last level of cache, as Linux describes it (glibc's
    sysconf adds up a whole package's); 32 MiB where it cannot be told."""

READER_FAILED: Final[int]
STOPPED: Final[int]
WATCH_FROM_FILES: int
TAKER_FILLS_BATCH_BYTES: int

class BatchRing:
    """Threads that gather batches of rows of several tensors, from the maps of one
    or more files (numbered across them), into a ring of batch buffers, and the
    consumer's side: each thread's loop (``work``) and each batch's wait (``take``)
    run without the GIL, so that no batch costs Python anything but its ``take``
    (the thread Loader's gathers over mapped files).

    Batch k of an iteration (its place) holds rows ``order[(first + k * step) *
    batch_rows:]`` (at most `batch_rows` of them) and goes into slot k % len(slots)
    once batch k - ahead is taken. With `needs` (one per place), place k waits until
    ``advance`` has said that ``needs[k]`` reads are done and that k's need is set;
    without, none waits. The maps stay while the ring does; each file is held open
    until ``close``. A batch takes rows from a file only while it is no shorter than
    mapped: over WATCH_FROM_FILES files or more (`watch` None; True: any number), a
    file on a local file system is watched (inotify) and checked again only when the
    kernel says it changed; any other file is checked before each batch that takes rows
    from it. A file cut short while a batch's rows are copied ends the batch too (the
    copy's fault is caught).
    """
    def __init__(self, handles: list[Reader], starts: list[int], names: tuple[str, ...],
                 order: npt.NDArray[np.int64], batch_rows: int, first: int, step: int,
                 count: int, slots: list[dict[str, npt.NDArray[Any]]], ahead: int,
                 needs: npt.NDArray[np.int64] | None = None,
                 watch: bool | None = None) -> None: ...
    @property
    def streams(self) -> bool:
        """Whether its copies of rows of whole 128-byte lines bypass the cache (a ring
        larger than twice the last level of cache, where the CPU can)."""
    @property
    def files_watched(self) -> int:
        """The files whose changes the kernel reports."""
    @property
    def files_checked(self) -> int:
        """The checks of a file's length (fstat calls) made so far."""
    @staticmethod
    def can_stream() -> bool:
        """Whether this CPU has the stores that bypass the cache (AVX2)."""
    def work(self) -> None:
        """A gathering thread's loop: returns once no batch is left, or at ``stop``."""
    def take(self, place: int) -> int:
        """Wait for batch `place` (taken in order) and return its slot, filling the
        batches no thread has started meanwhile where they are small
        (TAKER_FILLS_BATCH_BYTES) and their reads are done; READER_FAILED where the
        reading it waited for failed, STOPPED where the ring stopped first. A file cut
        short raises the SafetensorError that says so; a signal's handler
        (Ctrl-C's) runs while it waits, and what it raises comes out of the wait."""
    def advance(self, ready: int, claimed: int = 0) -> None:
        """`ready` reads are done, and the needs of the first `claimed` places are set."""
    def reading_failed(self) -> None:
        """The reading the batches wait for failed: each waiting batch ends READER_FAILED."""
    def stop(self) -> None:
        """End the threads' loops (after the batches they are copying) and every wait."""
    def close(self) -> None:
        """Once the threads have returned from ``work``: close the files and let go of
        the maps and the buffers."""

SHUFFLE_BUCKET_ROWS: Final[int]

def deal_rows(total: int, bit_generator: np.random.BitGenerator, bucket_rows: int = ...,
              /) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Rows ``0..total-1`` dealt at random to ``ceil(total / bucket_rows)`` buckets (at
    most 65,536), from `bit_generator` (left past its draws), without the GIL: the rows
    bucket after bucket (each bucket's in order), and where each bucket ends among
    them. Each bucket then shuffled in turn by ``shuffle_rows`` from the same generator
    makes a uniformly drawn permutation, each bucket shuffled in the CPU's cache, where
    one shuffle of millions of rows waits on a cache miss a row (the thread Loader's
    full shuffles: a bucket is shuffled as its batches come up).

    Raises
    ------
    ValueError
        A negative `total`, or `bucket_rows` below 1.
    """

def shuffle_rows(rows: npt.NDArray[np.int64], bit_generator: np.random.BitGenerator,
                 /) -> None:
    """Shuffle `rows` (a writable, contiguous int64 array of one axis) in place,
    drawn from `bit_generator`, without the GIL (Fisher-Yates; the thread Loader's
    windows of a block shuffle).

    Raises
    ------
    ValueError
        Any other array.
    """

class SupportsWrite(Protocol):
    def write(self, data: npt.NDArray[np.uint8], /) -> int | None: ...

class WriteSpec(NamedTuple):
    """One tensor to write: its name, header dtype code, header shape, and the
    array of its bytes.

    What every writer turns its input into (``spec_of_array`` for a NumPy
    array); given directly, it writes dtypes NumPy has no type for.

    Attributes
    ----------
    name : str
        The tensor's name.
    dtype : str
        Its header dtype code (see ``fastst.DTYPE_CODES``).
    shape : sequence of int
        Its header shape.
    data : numpy.ndarray or None
        An array whose bytes, in C order and little-endian, are the tensor's
        data: its dtype need not be the code's, only its byte count must
        match (four F4 values are two packed ``uint8``). None declares a
        tensor whose bytes are written later, in pieces (a streaming writer).

    Examples
    --------
    >>> import numpy as np, fastst
    >>> from fastst.writer import WriteSpec, serialize
    >>> packed = np.array([0x21, 0x43], dtype=np.uint8)     # four 4-bit floats
    >>> data = serialize([WriteSpec("f4", "F4", (4,), packed)])
    >>> fastst.load(data)["f4"]                              # F4 loads as packed bytes
    array([33, 67], dtype=uint8)
    """
    name: str
    dtype: str
    shape: Sequence[int]
    data: npt.NDArray[Any] | None

class WritePlan:
    """A file to write, as ``plan_write`` builds it: the 8-byte prefix and the
    padded header, then each tensor's place in the data, in the order the
    format's writers use (or, with ``align=``, the aligned order).

    Every writer of fastst writes through a plan: whole (`to_bytes`,
    `write_to`, `write_stream`), or, for a plan of declared tensors, the header
    first (`write_prefix`) and the tensors in pieces (`write_rows`,
    `write_bytes`).

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.writer import plan_write, spec_of_array
    >>> plan = plan_write([spec_of_array("x", np.zeros(2, np.float32))], None)
    >>> plan.names(), plan.data_start, plan.total_size
    (['x'], 64, 72)
    >>> plan.to_bytes()[8:plan.data_start]
    b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
    """
    @property
    def prefix(self) -> bytes:
        """The 8-byte header length and the header, padded with spaces."""
    @property
    def data(self) -> list[npt.NDArray[Any] | None]:
        """Each tensor's array, in file order (None for a declared tensor)."""
    @property
    def total_size(self) -> int:
        """The file's size in bytes."""
    def to_bytes(self) -> bytes:
        """The whole file as one bytes object.

        Raises
        ------
        SafetensorError
            When the plan declares tensors without data.
        """
    def write_to(self, fd: int, target: str = "<file>") -> None:
        """Write the whole file to the open file descriptor `fd` (`target` names
        it in messages), the GIL released per write.

        Raises
        ------
        OSError
            When a write fails (a full disk).
        SafetensorError
            When the plan declares tensors without data.
        """
    def write_stream(self, stream: SupportsWrite, target: str = "<stream>") -> None:
        """Write the whole file to a binary file object, in order, through
        ``stream.write`` in pieces of at most 16 MiB.

        Raises
        ------
        SafetensorError
            When the plan declares tensors without data.
        """
    @property
    def data_start(self) -> int:
        """Where the tensor data starts in the file: 8 + the header's length."""
    def write_prefix(self, fd: int, target: str = "<file>") -> None:
        """Write the prefix and header at the start of the file open as `fd`
        (a ``pwrite``: the file position does not move)."""
    def names(self) -> list[str]:
        """The tensor names, in file order."""
    def info(self, name: str, target: str = "<plan>") -> TensorInfo:
        """Tensor `name`'s header entry, as a reader's ``info`` gives it.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        """
    def write_rows(
        self, fd: int, name: str, first_row: int, array: npt.NDArray[Any],
        target: str = "<file>", bits_of: str | None = None
    ) -> tuple[int, int]:
        """Write `array` as rows ``[first_row, first_row + len(array))`` of tensor
        `name`, at their place in the file open as `fd` (a ``pwrite``).

        The array's dtype must be the tensor's NumPy dtype (either byte order),
        or, with `bits_of` (the header code of a dtype NumPy lacks, whose bits
        the array holds as integers of its width: a framework's bfloat16
        tensor), that code must be the tensor's; its rows of the tensor's row
        shape, every row within the tensor: all checked before a byte is
        written.

        Returns
        -------
        tuple of (int, int)
            The byte range written, relative to the tensor's start.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        SafetensorError
            When the piece does not fit the tensor (its dtype:
            `SafetensorTypeError`).
        OSError
            When the write fails.
        """
    def write_bytes(
        self, fd: int, name: str, start: int, data: Buffer, target: str = "<file>"
    ) -> tuple[int, int]:
        """Write the bytes of `data` (any C-contiguous buffer) at byte `start` of
        tensor `name`: for dtypes the caller has no array type for.

        Returns
        -------
        tuple of (int, int)
            The byte range written, relative to the tensor's start.

        Raises
        ------
        TensorNotFoundError
            When the plan has no tensor `name`.
        SafetensorError
            When the bytes reach outside the tensor.
        OSError
            When the write fails.
        """

def spec_of_array(name: str, array: npt.ArrayLike) -> WriteSpec:
    """The `WriteSpec` that writes the NumPy array `array` as tensor `name`.

    The header code follows from the array's dtype (ml_dtypes' bfloat16 and
    float8 included); the array is taken as it is, not copied (a
    non-contiguous or big-endian one is converted as it is written).

    Parameters
    ----------
    name : str
        The tensor's name.
    array : numpy.ndarray
        Its data.

    Returns
    -------
    WriteSpec

    Raises
    ------
    TypeError
        When `name` is not a str or `array` not a NumPy array.
    SafetensorTypeError
        When the array's dtype has no safetensors code (strings, objects...).

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.writer import spec_of_array
    >>> spec_of_array("x", np.zeros((2, 3), np.float16))
    WriteSpec(name='x', dtype='F16', shape=(2, 3), data=array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float16))
    """
class ReadOptions(NamedTuple):
    """How local files are read into fresh memory (see `read_options`)."""
    threads: int
    request_bytes: int
    direct: bool
    hints: bool
    huge_pages: bool


def read_options(*, threads: int | None = None, request_bytes: int | None = None,
                 direct: bool | None = None, hints: bool | None = None,
                 huge_pages: bool | None = None) -> ReadOptions:
    """Set how local files are read into fresh memory, and return the options
    that were in force.

    They apply to every read plan on a local file: ``load_file(copy=True)``,
    the ``"pread"`` backend, ``load_into``, ``copy_tensors``, ``read_into``,
    checkpoints, and ``iter_tensors``. A plan of 8 MiB or more is cut into
    requests of `request_bytes` that `threads` threads share, the GIL released:
    on a cold disk several requests in flight keep its queue full where one
    thread would wait for each in turn. With the page cache hot the threads
    share the copy. The defaults (one thread per usable CPU, at most 4, and
    4 MiB requests) came from a sweep on a cold local disk
    (``bench/cold.py --sweep``). They are settings of the process, shared by
    its threads.

    Parameters
    ----------
    threads : int, optional
        Threads one read plan is shared by, 1 to 64; 0 (the default): one
        per usable CPU, at most 4.
    request_bytes : int, optional
        The largest request, a multiple of 4096 from 64 KiB to 1 GiB.
    direct : bool, optional
        Read with ``O_DIRECT``, bypassing the page cache, where the file
        system takes it (tmpfs does not: its reads then go through the page
        cache, and ``read_counters()["direct_refused"]`` counts it). A
        tensor whose offset, length and memory are 4096-aligned (a file
        saved with ``align=4096``, read by ``read_into`` into aligned
        arrays) is read straight into its memory; any other through an
        aligned buffer of the thread's. The results are the same bytes.
        Plans under 1 MiB always go through the cache.
    hints : bool, optional
        Tell the kernel (``posix_fadvise(POSIX_FADV_SEQUENTIAL)``) that a plan
        of 8 MiB or more reads its bytes in file order, so that it reads
        further ahead.
    huge_pages : bool, optional
        Give fresh arrays of 4 MiB or more (from files, buffers, file objects
        and URLs alike) memory mapped for transparent huge pages, through a
        NumPy allocation handler: a fault brings 2 MiB, not 4 KiB, which makes
        filling fresh memory several times cheaper. It is advised
        ``madvise(MADV_HUGEPAGE)`` (Linux) as the kernel's settings allow
        without a fault waiting for memory to be compacted (see
        `use_huge_page_settings`). The arrays own their memory as any
        other (``flags.owndata``, ``resize``, pickling), and each gives it
        back when freed. True by default.

    Returns
    -------
    ReadOptions
        The options in force before the call; pass ``**options._asdict()``
        to restore them.

    Raises
    ------
    SafetensorError
        When a value is out of its range or of the wrong type.

    Examples
    --------
    >>> import fastst
    >>> before = fastst.read_options(threads=8, request_bytes=8 << 20)
    >>> fastst.read_options().threads
    8
    >>> _ = fastst.read_options(**before._asdict())
    """


def read_counters() -> dict[str, int]: ...
def use_huge_page_settings(folder: str = "/sys/kernel/mm/transparent_hugepage",
                           buddyinfo: str = "/proc/buddyinfo") -> str: ...
def free_huge_page_bytes(path: str = "/proc/buddyinfo") -> int: ...
def read_ahead_limit() -> int:
    """Half the machine's memory: the most read into the page cache ahead of use
    and counted on to stay there (1 where the memory is not known)."""
def hint_sequential(fd: int, offset: int, length: int, /) -> bool: ...
def read_threads() -> int:
    """The threads a read plan of two requests or more is shared by now: the
    ``threads`` of `read_options`, or by default one per usable CPU, at most 4."""
def usable_cpus() -> int: ...
def file_system_type(path: str | bytes | os.PathLike[str] | os.PathLike[bytes], /) -> int:
    """The magic number of the file system that holds `path` (statfs's f_type, as
    linux/magic.h names them: 0x6969 for NFS...); 0 where the platform tells none.
    OSError where the path cannot be looked up."""
def foreign_format(head: Buffer, /) -> str | None:
    """What the first bytes of a file say it is, when its length prefix is no
    length: the rest of the message "not a safetensors file: ...", which every
    way of opening a file gives for one whose prefix is wrong.

    Looks at the first 64 bytes at most: a NumPy ``.npy`` file, a zip archive
    (``.npz``, ``.pt``), HDF5, GGUF, a pickle, gzip or zstd data, an HTML page,
    a Git LFS pointer, JSON or other text. A real safetensors file may begin
    as one of these binary formats does (a prefix of 0x480 begins as a pickle
    does): ask only of a file whose prefix was found wrong; and a JSON header
    that begins after the prefix is taken for one (None: a file cut short).

    Examples
    --------
    >>> import io, numpy as np
    >>> from fastst._core import foreign_format
    >>> npy = io.BytesIO()
    >>> np.save(npy, np.zeros(3))
    >>> foreign_format(npy.getvalue())
    'it is a NumPy .npy file'
    >>> foreign_format(b"<!DOCTYPE html><html><body>Index of /</body></html>")
    'it is an HTML page (a web page or a folder listing, not the file itself)'
    >>> import fastst
    >>> foreign_format(fastst.save({"x": np.zeros(2)})) is None   # a header follows
    True
    """

def read_runs(
    reader: Reader, name: str, offsets: npt.ArrayLike, length: int, out: npt.NDArray[Any], /
) -> npt.NDArray[Any]:
    """Read runs of bytes of one tensor, and nothing else, one after another into `out`.

    What a shard of a tensor (a box of it: ``[start, stop)`` along each axis)
    needs: the pread backend reads each run (runs adjacent in the file in one
    call), a file read by ranges asks for them, a mapped file or a buffer copies
    them. ``NumpyHandle.read_runs`` calls it (and checks the checksum first when
    the handle verifies).

    Parameters
    ----------
    reader : Reader
        The open file.
    name : str
        The tensor's name.
    offsets : sequence or array of int
        Where each run starts, in bytes from the tensor's first byte.
    length : int
        The length of every run, in bytes; each run must lie inside the tensor.
    out : numpy.ndarray
        A C-contiguous, writable array of exactly ``len(offsets) * length``
        bytes; returned.

    Returns
    -------
    numpy.ndarray
        `out`.

    Raises
    ------
    TensorNotFoundError
        When the file has no tensor `name`.
    SafetensorIndexError
        When a run reaches outside the tensor.
    SafetensorTypeError
        When `offsets` are not integers, or `length` is not an integer.
    ValueError
        When `out` is not C-contiguous and writable, or holds another number
        of bytes.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst._core import read_runs
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(12, dtype=np.int32).reshape(3, 4)}, path)
    >>> with fastst.safe_open(path, backend="pread") as f:     # column 1 and 2 of each row
    ...     read_runs(f, "x", [4, 20, 36], 8, np.empty((3, 2), np.int32)).tolist()
    [[1, 2], [5, 6], [9, 10]]
    """
def write_array_at(
    fd: int, array: npt.NDArray[Any], offset: int, target: str = ..., /
) -> None: ...
def plan_write(
    specs: Iterable[WriteSpec | tuple[str, str, Sequence[int], npt.NDArray[Any] | None]],
    metadata: Mapping[str, str] | None,
    *,
    header_padding: int = 0,
    header_size: int | None = None,
    keep_order: bool = False,
    align: int | None = None,
) -> WritePlan:
    """Check tensors to write, place them, and build the header: a `WritePlan`.

    The tensors are ordered as the format's writers order them (by dtype rank,
    descending, then by name) unless `keep_order`, and the header is the one
    the reference writes for them, byte for byte.

    With `align`, the header is padded with spaces so that the data starts at
    a multiple of `align` in the file, and (unless `keep_order`) the tensors
    are ordered so that as many as can start at a multiple of it too: first
    those whose size is a multiple of `align`; then groups, each led by the
    largest tensor left, followed by the fewest (at most three), smallest
    others whose sizes bring the group's end to a multiple of `align` (the
    format leaves no gap between tensors); then the tensors no group could
    close, largest first; then those whose size is not a multiple of 8, in
    the format's order, so that every tensor still starts at a multiple of
    its element's size. The format's order is kept where it aligns as many
    tensors. The order depends only on the tensors, not on the order they
    are given in; the header lists them in the order of their data.

    Parameters
    ----------
    specs : iterable of WriteSpec or (name, dtype, shape, data) tuples
        The tensors; a `data` of None declares one whose bytes come later.
    metadata : mapping of str to str or None
        The header's ``__metadata__``.
    header_padding : int, default 0
        Bytes of spaces reserved after the header (rounded so that the data
        stays 8-byte aligned), room for later metadata edits
        (``fastst.update_metadata``).
    header_size : int, optional
        A header of exactly this many bytes, padded with spaces: for rewriting
        a file's header in place.
    keep_order : bool, default False
        Place the tensors in the order given.
    align : int, optional
        A power of two from 1 to `MAX_ALIGN` (1 MiB), in bytes; None or 0
        for the format's layout.

    Returns
    -------
    WritePlan

    Raises
    ------
    SafetensorError
        When a name is given twice, a shape is not a list of unsigned
        integers, or a tensor's data has not the bytes its dtype and shape
        need; when the header does not fit in `header_size`, or
        ``8 + header_size`` is not a multiple of `align`; when `align` is
        not a power of two up to `MAX_ALIGN`.
    SafetensorTypeError
        When a dtype code is not known.
    TypeError
        When a name or a metadata key or value is not a str.

    Examples
    --------
    >>> from fastst.writer import plan_write
    >>> plan = plan_write([("b", "F32", (2,), None), ("a", "I8", (1,), None)], {"k": "v"})
    >>> plan.names(), plan.info("a")
    (['b', 'a'], TensorInfo(dtype='I8', shape=[1], data_offsets=(8, 9), array_shape=(1,)))

    Aligned to 64 bytes: the data starts at byte 192, and the 8 bytes of
    ``step`` fill the gap the 56 of ``b`` leave.

    >>> specs = [("w", "F32", (64,)), ("b", "F32", (14,)), ("step", "I64", ())]
    >>> plan = plan_write(specs, None, align=64)
    >>> plan.data_start, [(name, plan.info(name).data_offsets) for name in plan.names()]
    (192, [('w', (0, 256)), ('b', (256, 312)), ('step', (312, 320))])
    """
