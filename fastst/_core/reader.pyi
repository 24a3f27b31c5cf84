"""The compiled reader of one file or buffer: the reading methods of fastst.NumpyHandle."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

from .header import DEFAULT_MAX_HEADER_SIZE, TensorInfo

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

        The first request asks for the file's first 64 KiB: the prefix and, most
        often, the whole header (a longer header takes a second request).
        Tensors are then read into fresh memory, each read in as few requests
        as its byte ranges allow. `identity` is what `file_identity` returns.

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
        read by several threads at once, the GIL released. From a local file
        (8 MiB of tensors or more), the disk starts reading their bytes while
        their arrays are made, where `read_options` leaves hints on and direct
        reads off.

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
        (a file read by ranges is read in one plan of requests). With the
        ``"mmap"`` backend (8 MiB of tensors or more), unless `read_options`
        turned hints off, a thread reads the tensors' pages into the page cache
        in the background, in file order, while the caller works on the first
        ones.

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
        """Rows `rows` of tensor `name`'s first axis, each read into its place in
        a fresh array, and no other: the rows must be an ``intp`` array, each in
        range, in any order, repeats allowed (`gather` takes any integers).

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
        """Where the tensor data starts in the file (or buffer): 8 + the header's
        length."""
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
        ``numpy_dtype(code)``, or its bits where `uses_ml_dtypes` is False.

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
