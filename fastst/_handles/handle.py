"""Handles on one safetensors file: a ``NumpyHandle`` (the compiled Reader's
methods: NumPy arrays, views of the file's map or fresh memory), a
``VerifyingHandle`` that checks each tensor's checksum on its first read, and a
``FrameworkHandle`` whose tensors pass through a framework adapter's converter,
chosen once at opening. ``open_handle`` opens one on a Source; a handle pickles by
opening its Source again, which must hold the same version of the file.
"""
from __future__ import annotations

from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, Iterable, Iterator, List,
                    Optional, Set, Tuple, TypeVar, Union, overload)

from .._core import (DEFAULT_MAX_HEADER_SIZE, Reader, SafetensorError, SafetensorTypeError,
                     read_runs)
from .._frameworks.registry import (NUMPY_FRAMEWORKS, check_numpy_device,
                                    converter as framework_converter)
from .._io.limits import DEFAULT_PREFETCH_BYTES
from .._io.source import Buffer, FileObject, Identity, LocalFile, Source, identity_of

if TYPE_CHECKING:   # none of these is imported when fastst is; each on its first use
    import numpy.typing as npt

    from .._core import TensorInfo
    from .._frameworks.registry import Converter
    from .meta import TensorMeta
    from .prefetch import Plan, PrefetchLoader
    from .protocols import FileIdentity
    from .readahead import ReadAhead
    from .slicing import SafeSlice

__all__ = ["FrameworkHandle", "NumpyHandle", "VerifyingHandle", "data_bytes", "open_handle"]

T = TypeVar("T")    # a handle's tensors


class NumpyHandle(Reader):
    """An open safetensors file whose tensors are NumPy arrays.

    What ``safe_open(..., framework="np")`` returns; not made directly. Its
    tensors are zero-copy views of the file's private map (backend
    ``"mmap"``), or fresh memory read when asked (backend ``"pread"``, and for
    URLs and file objects). It is a context manager; closing it leaves the
    arrays it gave valid.

    Its reading methods are the compiled reader's own: `get_tensor`,
    `get_tensors`, `copy_tensors`, `read_into`, `read_rows`, `gather` (rows of
    a tensor, into ``out=`` when given), `gather_rows`, `info`, `keys`,
    `offset_keys`, `metadata`, and the mapping protocol (``f[name]``,
    ``name in f``, ``len(f)``, iteration over the sorted names). It pickles
    by opening the same file again (to pass to another process), which must
    not have changed since: a file replaced, rewritten or resized is refused
    with a `SafetensorError` when the handle is unpickled.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"x": np.arange(6).reshape(3, 2), "y": np.ones(3)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     len(f), f.keys(), f["x"][1].tolist(), f.gather("y", [0, 2]).tolist()
    (2, ['x', 'y'], [2, 3], [1.0, 1.0])
    >>> import pickle
    >>> f = pickle.loads(pickle.dumps(fastst.safe_open(path)))   # reopened by its path
    >>> f.keys()
    ['x', 'y']
    >>> f.close()
    """

    __module__ = "fastst"

    _origin: Optional[Source] = None

    @property
    def origin(self) -> Source:
        """Where the handle's bytes are: the Source it was opened on (see
        ``fastst._io.source``), which a pickled handle opens again."""
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
        """A lazy handle on tensor `name`, that NumPy indexing reads from.

        Parameters
        ----------
        name : str
            The tensor's name.

        Returns
        -------
        SafeSlice
            Nothing is read until it is indexed: ``f.get_slice(name)[index]``
            is ``f.get_tensor(name)[index]``, reading only what the index
            reaches.

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.arange(12).reshape(4, 3)}, path)
        >>> with fastst.safe_open(path, backend="pread") as f:
        ...     part = f.get_slice("x")
        ...     part.get_shape(), part[1:3, -1].tolist()
        ([4, 3], [5, 8])
        """
        from .slicing import SafeSlice

        return SafeSlice(self, name)

    def get_tensor_meta(self, name: str) -> TensorMeta:
        """What the header says of tensor `name`: its dtype code, shape and data
        offsets, read without touching its bytes (the reference's
        ``get_tensor_meta``; ``info`` says as much and the NumPy shape).

        Parameters
        ----------
        name : str
            The tensor's name.

        Returns
        -------
        TensorMeta

        Raises
        ------
        TensorNotFoundError
            When the file has no tensor `name`.
        SafetensorError
            When the handle is closed.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.zeros((4, 3), np.int8), "y": np.ones(2)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     f.get_tensor_meta("x")
        TensorMeta(dtype='I8', shape=[4, 3], data_offsets=(16, 28))
        """
        from .meta import meta_of

        return meta_of(self.info(name))

    def read_runs(self, name: str, offsets: Any, length: int, out: npt.NDArray[Any]
                  ) -> npt.NDArray[Any]:
        """Runs of bytes of tensor `name`, and nothing else, one after another into
        `out` (see ``fastst._core.read_runs``): the part of a tensor that a shard
        owns.

        Parameters
        ----------
        name : str
            The tensor's name.
        offsets : sequence or array of int
            Where each run starts, in bytes from the tensor's first byte.
        length : int
            The length of every run, in bytes.
        out : numpy.ndarray
            A C-contiguous, writable array of ``len(offsets) * length`` bytes.

        Returns
        -------
        numpy.ndarray
            `out`.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.arange(6, dtype=np.int16)}, path)
        >>> with fastst.safe_open(path, backend="pread") as f:
        ...     f.read_runs("x", [2, 8], 2, np.empty(2, np.int16)).tolist()
        [1, 4]
        """
        result: npt.NDArray[Any] = read_runs(self, name, offsets, length, out)
        return result

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES
                     ) -> ReadAhead[npt.NDArray[Any]]:
        """The tensors, one by one, each in fresh memory, read ahead in the
        background while the caller works on the one it was given.

        A thread reads the tensors in the order of `names` (several small ones
        in one read plan, a large one by the core's reading threads), while the
        caller hashes, converts, quantises or writes the tensor before: a walk
        costs about the longer of reading and working, not their sum. The bytes
        read ahead and not yet taken never exceed `prefetch_bytes`; a tensor
        larger than that is read alone, once every tensor before it was taken.
        So the process holds at most `prefetch_bytes` plus the tensors the
        caller keeps. The thread stops when the iterator is exhausted, closed,
        left by ``break`` or an exception, or dropped.

        Parameters
        ----------
        names : iterable of str, optional
            The tensors, in the order to read them; by default every tensor in
            the order of its bytes in the file.
        prefetch_bytes : int, default 256 MiB
            The budget of bytes read ahead.

        Returns
        -------
        ReadAhead
            An iterator of ``(name, array)``, and a context manager that stops
            the thread on exit. An error reading a tensor (a file truncated or
            replaced since it was opened: a `SafetensorError`) is raised when
            that tensor's turn comes.

        Raises
        ------
        TensorNotFoundError
            When a name is not a tensor of the file.
        SafetensorError
            When `prefetch_bytes` is not a positive integer.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({f"w{i}": np.full(1000, i, np.float32) for i in range(4)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     for name, array in f.iter_tensors(prefetch_bytes=8000):
        ...         print(name, array.sum())
        w0 0.0
        w1 1000.0
        w2 2000.0
        w3 3000.0
        """
        from .readahead import ReadAhead

        return ReadAhead([(self, name, None) for name in _names_to_read(self, names)],
                         prefetch_bytes)

    def prefetch(self, plan: Optional[Plan] = None, *, device: Any = None,
                 threads: Optional[int] = None,
                 max_bytes_in_flight: int = DEFAULT_PREFETCH_BYTES
                 ) -> PrefetchLoader[npt.NDArray[Any]]:
        """Start reading the tensors of `plan` (whole, or a run of rows of each)
        in the background, within a budget of bytes: the reference's
        ``prefetch`` (safetensors 0.9, where it loads torch tensors onto CUDA
        devices only), here for every handle, framework and device.

        The plan is checked whole before anything is read. Threads then read
        its tensors in file order into fresh memory: several small ones in one
        read plan, a larger one in pieces that they share. The loader hands out
        each tensor once: ``take(name)`` (waiting for its bytes), or iterating
        over it, which gives them as their bytes land. The bytes read and not
        yet handed out, with those being read, never exceed
        `max_bytes_in_flight`: a tensor larger than that, or one taken before
        the threads reach it, is read when taken, by the caller's thread.

        Parameters
        ----------
        plan : dict of str to slice or None, optional
            The tensors to read: each name maps to None for the whole tensor, or
            to a slice of step 1 of its first axis (negative bounds count from
            its end; bounds past it are an error, not clamped). Tensors left out
            are not read. None (the default): every tensor, whole.
        device : str, optional
            Where the tensors go: for NumPy, ``"cpu"`` (the default, None, is the
            handle's).
        threads : int, optional
            The threads that read, 1 to 64; by default as many as share a read
            plan (``fastst.read_options().threads``: one per usable CPU, at most
            4, unless set). The reference reads with 8 threads a file.
        max_bytes_in_flight : int, default 256 MiB
            The budget: bytes being read, and read but not yet handed out.

        Returns
        -------
        PrefetchLoader
            The tensors, as NumPy arrays in fresh memory; a context manager that
            stops its threads on exit.

        Raises
        ------
        TensorNotFoundError
            When a name of the plan is not a tensor of the file.
        SafetensorError
            When the plan selects no tensors; a slice has a step other than 1,
            is of a 0-d tensor, reaches past the tensor's first axis
            (`SafetensorIndexError`), or cuts a sub-byte tensor (F4, F6_*)
            inside a byte; `threads` or `max_bytes_in_flight` is out of range;
            the handle is closed.
        SafetensorTypeError
            When the plan is not a dict of names to None or slices (a list of
            names: see `will_need`, the page-cache hint this method's name
            stood for before).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"embed": np.arange(12.0).reshape(6, 2), "bias": np.ones(2),
        ...                   "skipped": np.zeros(3)}, path)
        >>> with fastst.safe_open(path) as f:
        ...     with f.prefetch({"embed": slice(2, 4), "bias": None}) as loader:
        ...         rows = loader.take("embed")        # rows 2 and 3 only
        ...         rest = dict(loader)                # the others, as their bytes land
        >>> rows.tolist(), sorted(rest)
        ([[4.0, 5.0], [6.0, 7.0]], ['bias'])
        """
        from .prefetch import PrefetchLoader, checked_plan   # imported on first use

        return PrefetchLoader(self._prefetched(checked_plan(plan, self.source), device),
                              self.source, threads=threads,
                              max_bytes_in_flight=max_bytes_in_flight)

    def _prefetched(self, plan: Optional[Dict[str, Optional[slice]]], device: Any
                    ) -> List[Any]:
        """The tensors a checked `plan` selects, for a PrefetchLoader."""
        if device is not None:
            check_numpy_device(device)
        from .prefetch import planned_tensors

        return planned_tensors(self, plan, None)

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled, a handle opens its Source again (see ``_reopened``)."""
        return _pickled(self, "np", "cpu")

    def __repr__(self) -> str:
        return _describe(self)


class FrameworkHandle(Generic[T]):
    """An open safetensors file whose tensors come out as another framework's
    (torch, JAX).

    What ``safe_open(..., framework="pt")`` (or ``"jax"``) returns: each NumPy
    array the file gives passes through the converter chosen when the file was
    opened, a zero-copy view on the CPU where the framework allows. It has the
    reading methods of `NumpyHandle` that make sense for the framework's
    tensors, and is a context manager. A handle from ``safe_open`` pickles, as
    a `NumpyHandle` does.

    Parameters
    ----------
    reader : NumpyHandle
        The open file.
    convert : callable
        ``convert(array, name, info)``: a framework's tensor from the NumPy
        array of tensor `name`, described by its `TensorInfo`.
    opened_as : tuple of (str, device), optional
        The framework and device `convert` is for, with which the handle
        pickles (opening the file again); without it, it cannot be pickled.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os, torch
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.eye(2, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path, framework="pt") as f:
    ...     f.get_tensor("w")
    tensor([[1., 0.],
            [0., 1.]])
    """

    __module__ = "fastst"

    def __init__(self, reader: NumpyHandle, convert: Converter[T],
                 opened_as: Optional[Tuple[str, Any]] = None) -> None:
        self._reader = reader
        self._convert = _naming_the_file(convert, reader.source)
        # a converter may take a whole file at once (CUDA: one stream, one allocation)
        self._convert_file: Optional[Callable[[NumpyHandle], Dict[str, T]]] = getattr(
            convert, "convert_file", None)
        self._infos: Dict[str, TensorInfo] = {}   # filled as tensors are asked for
        self._opened_as = opened_as               # (framework, device), for pickling
        # a converter may lay a tensor out over several devices (JAX shardings)
        self._sharded: Optional[Callable[..., T]] = getattr(convert, "sharded", None)
        self._sharding_for: Optional[Callable[..., Any]] = getattr(convert, "sharding_for",
                                                                     None)

    def get_tensor(self, name: str, *, out: None = None, sharding: Any = None) -> T:
        """Tensor `name` as the framework's tensor (see ``NumpyHandle.get_tensor``).

        Parameters
        ----------
        out : None
            Not for framework tensors (only a `NumpyHandle` reads into arrays).
        sharding : jax.sharding.Sharding, optional
            For JAX: the array laid out by `sharding`, each addressable
            device's shard read alone (only its bytes; a shard several devices
            hold, once), as ``jax.device_put(array, sharding)`` gives it (see
            ``fastst.jax``).

        Returns
        -------
        torch.Tensor or jax.Array
            On the CPU, a view of the file's map where the framework allows.

        Raises
        ------
        SafetensorError
            When the framework has no dtype for the tensor's.
        TypeError
            When `out` is given.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"b": np.arange(3, dtype=np.int16)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.get_tensor("b")
        tensor([0, 1, 2], dtype=torch.int16)
        """
        if out is not None:
            raise TypeError("out= takes NumPy arrays; open the file with framework='np'")
        if sharding is not None:
            if self._sharded is None:
                raise SafetensorError(f"{self.source}: sharding= lays out JAX arrays; open "
                                      f"the file with framework='jax'")
            return self._sharded(self._reader, name, self._info(name), sharding)
        array = self._reader.get_tensor(name)
        return self._convert(array, name, self._info(name))

    def __getitem__(self, name: str) -> T:
        return self.get_tensor(name)

    def gather(self, name: str, rows: Any, *, out: None = None) -> T:
        """Rows `rows` of tensor `name`'s first axis, as one framework tensor in
        fresh memory (see ``NumpyHandle.gather``).

        Parameters
        ----------
        out : None
            Not for framework tensors.

        Raises
        ------
        TypeError
            When `out` is given.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.arange(8).reshape(4, 2)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.gather("x", [3, 0])
        tensor([[6, 7],
                [0, 1]])
        """
        if out is not None:
            raise TypeError("out= takes NumPy arrays; open the file with framework='np'")
        return self._convert(self._reader.gather(name, rows), name, self._info(name))

    def get_tensors(self, *, shardings: Any = None) -> Dict[str, T]:
        """Every tensor, in the order of its bytes in the file.

        On a CUDA device the whole file streams through one ring of pinned
        buffers into one device allocation.

        Parameters
        ----------
        shardings : jax.sharding.Sharding, mapping or callable, optional
            For JAX: how to lay out each array over devices (see
            ``fastst.jax``): one sharding for all, a mapping of name to
            sharding, or ``shardings(name, shape, dtype)`` (the array's shape
            and NumPy dtype); a tensor given None loads as without it.

        Returns
        -------
        dict of str to torch.Tensor or jax.Array

        Raises
        ------
        SafetensorError
            When the handle is closed, or the framework has no dtype for a
            tensor's.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"a": np.zeros(2, np.float32), "b": np.ones(1)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.get_tensors()
        {'b': tensor([1.], dtype=torch.float64), 'a': tensor([0., 0.])}
        """
        if shardings is not None:
            if self._sharding_for is None:
                raise SafetensorError(f"{self.source}: shardings= lays out JAX arrays; open "
                                      f"the file with framework='jax'")
            choose = self._sharding_for
            return {name: self.get_tensor(name, sharding=choose(shardings, name, self._info(name)))
                    for name in self._reader.offset_keys()}
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
        """A lazy handle on tensor `name` (see ``NumpyHandle.get_slice``):
        indexing reads the part it selects, and gives it as the framework's tensor.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.arange(6).reshape(2, 3)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.get_slice("x")[:, 1:]
        tensor([[1, 2],
                [4, 5]])
        """
        from .slicing import SafeSlice

        return SafeSlice(self._reader, name, self._convert, handle=self)

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES) -> ReadAhead[T]:
        """The tensors, one by one, read ahead in the background within a budget
        of bytes (see ``NumpyHandle.iter_tensors``, whose parameters it takes),
        each converted to the framework's tensor when its turn comes.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"a": np.zeros(2), "b": np.ones(2)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     dict(f.iter_tensors(["b", "a"]))
        {'b': tensor([1., 1.], dtype=torch.float64), 'a': tensor([0., 0.], dtype=torch.float64)}
        """
        convert = self._convert
        info = self._info

        def converted(array: Any, name: str) -> T:
            return convert(array, name, info(name))

        from .readahead import ReadAhead

        return ReadAhead([(self._reader, name, converted)
                          for name in _names_to_read(self._reader, names)], prefetch_bytes)

    def prefetch(self, plan: Optional[Plan] = None, *, device: Any = None,
                 threads: Optional[int] = None,
                 max_bytes_in_flight: int = DEFAULT_PREFETCH_BYTES) -> PrefetchLoader[T]:
        """Start reading the tensors of `plan` in the background, within a budget
        of bytes (see ``NumpyHandle.prefetch``, whose parameters it takes); each is
        converted to the framework's tensor when handed out, on the handle's device
        unless `device` names another (a ``str``, an ``int``, a ``torch.device``
        or a ``jax.Device``, as ``safe_open`` takes it).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"w": np.arange(6, dtype=np.float32).reshape(3, 2)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     with f.prefetch({"w": slice(-1, None)}) as loader:
        ...         loader.take("w")
        tensor([[4., 5.]])
        """
        from .prefetch import PrefetchLoader, checked_plan   # imported on first use

        return PrefetchLoader(self._prefetched(checked_plan(plan, self.source), device),
                              self.source, threads=threads,
                              max_bytes_in_flight=max_bytes_in_flight)

    def _prefetched(self, plan: Optional[Dict[str, Optional[slice]]], device: Any
                    ) -> List[Any]:
        """The tensors a checked `plan` selects, for a PrefetchLoader, each converted
        for `device` (None: the handle's)."""
        from .prefetch import planned_tensors

        convert = self._convert
        if device is not None:
            if self._opened_as is None:
                raise SafetensorTypeError(f"{self.source}: device= needs a handle from "
                                          f"safe_open, which knows its framework")
            convert = _naming_the_file(framework_converter(self._opened_as[0], device),
                                       self.source)
        return planned_tensors(self._reader, plan, convert)

    def will_need(self, names: Iterable[str]) -> int:
        """Ask the kernel to start reading tensors into the page cache (see
        ``NumpyHandle.will_need``).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"a": np.zeros(2, np.float32)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.will_need(["a"])
        8
        """
        hinted: int = self._reader.will_need(names)
        return hinted

    def keys(self) -> List[str]:
        """The names of the file's tensors, sorted (see ``NumpyHandle.keys``).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"b": np.zeros(1), "a": np.zeros(1)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.keys(), f.offset_keys()
        (['a', 'b'], ['a', 'b'])
        """
        return self._reader.keys()

    def offset_keys(self) -> List[str]:
        """The names of the file's tensors in the order of their bytes (see
        ``NumpyHandle.offset_keys``)."""
        return self._reader.offset_keys()

    def metadata(self) -> Optional[Dict[str, str]]:
        """The file's ``__metadata__`` (see ``NumpyHandle.metadata``).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.zeros(1)}, path, metadata={"format": "pt"})
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.metadata()
        {'format': 'pt'}
        """
        return self._reader.metadata()

    def info(self, name: str) -> TensorInfo:
        """What the header says of tensor `name` (see ``NumpyHandle.info``)."""
        return self._info(name)

    def get_tensor_meta(self, name: str) -> TensorMeta:
        """What the header says of tensor `name`, read without touching its bytes
        (see ``NumpyHandle.get_tensor_meta``).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"w": np.zeros((2, 2), np.float16)}, path)
        >>> with fastst.safe_open(path, framework="pt") as f:
        ...     f.get_tensor_meta("w").shape
        [2, 2]
        """
        from .meta import meta_of

        return meta_of(self._info(name))

    @property
    def source(self) -> str:
        """What error messages call the file: its path or URL."""
        return self._reader.source

    @property
    def backend(self) -> str:
        """How the file is read: ``"mmap"``, ``"pread"`` or ``"ranges"``."""
        return self._reader.backend

    @property
    def file_identity(self) -> Optional[FileIdentity]:
        """The version of the file opened (see ``NumpyHandle.file_identity``): for a
        local file, its (path, st_dev, st_ino, st_size, st_mtime_ns)."""
        return self._reader.file_identity

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (see ``NumpyHandle.closed``)."""
        return self._reader.closed

    def close(self) -> None:
        """Let go of the file; tensors already given stay valid."""
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
            raise SafetensorTypeError(f"{self.source}: only a handle from safe_open can be "
                                      f"pickled")
        return _pickled(self._reader, *self._opened_as)

    def __repr__(self) -> str:
        return _describe(self._reader)


def data_bytes(handle: Any) -> int:
    """The bytes of a file's tensors: where its last tensor in buffer order ends.

    Its data start plus this is the file's size: the tensors of a valid file
    cover its data exactly.

    Parameters
    ----------
    handle : NumpyHandle or FrameworkHandle
        An open file.

    Returns
    -------
    int

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.checkpoint import data_bytes
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"a": np.zeros(3, np.float32), "b": np.zeros(2, np.int8)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     data_bytes(f), f.data_start + data_bytes(f) == os.path.getsize(path)
    (14, True)
    """
    names = handle.offset_keys()
    return handle.info(names[-1]).data_offsets[1] if names else 0


def _pickled(reader: NumpyHandle, framework: str, device: Any) -> Tuple[Any, ...]:
    """How a handle pickles: the function that opens it again (``_reopened``) and its
    arguments: the Source, the version of the file read (its ``Identity``), the
    header's length, the framework, the device, the class of the reader (a
    NumpyHandle, or a subclass such as one that verifies), and whether its arrays
    of bfloat16 and float8 are ml_dtypes' (else their bits)."""
    if reader.closed:
        raise SafetensorError(f"{reader.source}: file is closed; a closed handle cannot be "
                              f"pickled")
    seen = identity_of(reader)
    if seen is None:
        raise SafetensorTypeError(f"{reader.source}: {reader.origin.cannot_reopen()}")
    return (_reopened, (reader.origin, seen, reader.data_start - 8, framework, device,
                        type(reader), reader.uses_ml_dtypes))


def _names_to_read(reader: Any, names: Optional[Iterable[str]]) -> List[str]:
    """`names` as a list, each checked to be a tensor of `reader`; by default every
    tensor in file order."""
    if names is None:
        listed: List[str] = reader.offset_keys()
        return listed
    if isinstance(names, str):
        raise SafetensorTypeError(f"{reader.source}: names must be an iterable of tensor "
                                  f"names, not a str")
    wanted = list(names)
    for name in wanted:
        reader.info(name)     # TensorNotFoundError for a name it does not hold
    return wanted


def _origin_of(reader: Reader) -> Source:
    """The Source of a Reader opened by its own methods, as far as it tells: a local
    file (its path and backend), else one that cannot be opened again."""
    if reader.backend in ("mmap", "pread") and reader.file_identity is not None:
        return LocalFile(reader.file_identity[0], reader.backend)
    return Buffer(None) if reader.backend == "buffer" else FileObject(None)


def _reopened(source: Source, seen: Identity, header_size: int, framework: str, device: Any,
              reader_class: type = None, uses_ml_dtypes: bool = True
              ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """A pickled handle, unpickled: its Source opened again, as before. A file that
    is not the one pickled (replaced, rewritten, resized) is refused."""
    convert = None if framework in NUMPY_FRAMEWORKS else framework_converter(framework, device)
    reader = _reader_for(convert, reader_class or NumpyHandle, uses_ml_dtypes)
    # the header's length is known: a longer one is not the same file
    source.reopen(reader, seen, max_header_size=header_size, what="file",
                  since="the handle was pickled", remedy="open it again to read the new file")
    reader.origin = source
    return reader if convert is None else FrameworkHandle(reader, convert, (framework, device))


def _reader_for(convert: Optional[Converter[Any]], reader_class: type,
                uses_ml_dtypes: bool = True) -> NumpyHandle:
    """A reader, not open yet, for `convert`: one whose bfloat16 and float8 tensors
    come as their bits where the converter, or the caller, needs no ml_dtypes."""
    reader: NumpyHandle = reader_class()
    reader.uses_ml_dtypes = uses_ml_dtypes and getattr(convert, "uses_ml_dtypes", True)
    return reader


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
    """A `NumpyHandle` that checks each tensor's checksum the first time the
    tensor is read.

    What ``safe_open(..., verify=True)`` returns for NumPy (and wraps for the
    frameworks). A partial read (rows, a gather, a slice) checks the whole
    tensor first. A tensor whose bytes do not match its checksum raises a
    `SafetensorError` naming it, the algorithm and both digests. A file
    without checksums is refused at opening, and so is one whose checksums
    leave some tensor out: verifying it could not keep its promise
    (``verify_file`` checks the other tensors of such a file and names each one
    left out as an error).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"x": np.arange(3)}, path, checksum="xxh3_64")
    >>> with fastst.safe_open(path, verify=True) as f:
    ...     type(f).__name__, f.get_tensor("x").tolist(), sorted(f.verified)
    ('VerifyingHandle', [0, 1, 2], ['x'])
    >>> fastst.save_file({"x": np.arange(3)}, path)            # no checksums
    >>> fastst.safe_open(path, verify=True)
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorError: ...: verify=True, but the file has no checksums (save it with checksum='xxh3_64')
    """

    __module__ = "fastst.integrity"

    def open_file(self, filename: Any, backend: str = "mmap", *,
                  max_header_size: int = DEFAULT_MAX_HEADER_SIZE, threads: int = 0) -> None:
        """Open a local file (see ``Reader.open_file``), then take its checksums.

        Raises
        ------
        SafetensorError
            When the file has no checksums, or they leave a tensor out.
        """
        super().open_file(filename, backend, max_header_size=max_header_size, threads=threads)
        self._take_checksums()

    def open_ranges(self, source: str, size: int, fetch: Any, *,
                    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    identity: Any = None) -> None:
        """Open a file read by byte ranges (see ``Reader.open_ranges``), then take
        its checksums.

        Raises
        ------
        SafetensorError
            When the file has no checksums, or they leave a tensor out.
        """
        super().open_ranges(source, size, fetch, max_header_size=max_header_size,
                            identity=identity)
        self._take_checksums()

    def _take_checksums(self) -> None:
        from .._format.checksums import checksums_of, some_tensors, without_checksum   # on use

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
        """Check tensor `name`'s checksum, unless it was checked before.

        Parameters
        ----------
        name : str
            The tensor's name.
        array : numpy.ndarray, optional
            Its bytes, already read; read now when not given.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        TensorNotFoundError
            When the file has no tensor `name`.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"x": np.arange(3)}, path, checksum="xxh3_128")
        >>> with fastst.safe_open(path, verify=True) as f:
        ...     f.check("x")
        ...     f.algorithm, f.verified
        ('xxh3_128', {'x'})
        """
        if name in self.verified:
            return
        # imported with the handle's first check
        from .._format.checksums import digest_of, mismatch

        if array is None:
            array = NumpyHandle.get_tensor(self, name)
        actual = digest_of(array, self.algorithm)
        if actual != self.digests[name]:
            raise SafetensorError(f"{self.source}: tensor {name!r}: "
                                  + mismatch(self.algorithm, self.digests[name], actual))
        self.verified.add(name)

    def get_tensor(self, name: str, *, out: Optional[npt.NDArray[Any]] = None
                   ) -> npt.NDArray[Any]:
        """Tensor `name` (see ``NumpyHandle.get_tensor``), its checksum checked on
        its first read.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        array: npt.NDArray[Any] = super().get_tensor(name, out=out)
        self.check(name, array)
        return array

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.get_tensor(name)

    def get_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        """Every tensor (see ``NumpyHandle.get_tensors``), each checksum checked.

        Raises
        ------
        SafetensorError
            When a tensor's bytes do not match its checksum.
        """
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def copy_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        """Every tensor in fresh memory (see ``NumpyHandle.copy_tensors``), each
        checksum checked.

        Raises
        ------
        SafetensorError
            When a tensor's bytes do not match its checksum.
        """
        arrays: Dict[str, npt.NDArray[Any]] = super().copy_tensors()
        for name, array in arrays.items():
            self.check(name, array)
        return arrays

    def read_into(self, arrays: Dict[str, npt.NDArray[Any]]) -> None:
        """Read tensors into caller-supplied arrays (see ``NumpyHandle.read_into``),
        each checksum checked.

        Raises
        ------
        SafetensorError
            When a tensor's bytes do not match its checksum.
        """
        super().read_into(arrays)
        for name, array in arrays.items():
            self.check(name, array)

    def read_rows(self, name: str, first: int, last: int) -> npt.NDArray[Any]:
        """Rows of tensor `name` (see ``NumpyHandle.read_rows``), the whole tensor's
        checksum checked first.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        self.check(name)
        rows: npt.NDArray[Any] = super().read_rows(name, first, last)
        return rows

    def read_runs(self, name: str, offsets: Any, length: int, out: npt.NDArray[Any]
                  ) -> npt.NDArray[Any]:
        """Runs of bytes of tensor `name` (see ``NumpyHandle.read_runs``), the whole
        tensor's checksum checked first.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        self.check(name)
        return super().read_runs(name, offsets, length, out)

    def get_part(self, name: str, index: Any, rows: Optional[npt.NDArray[Any]] = None
                 ) -> Any:
        """``get_tensor(name)[index]`` (see ``Reader.get_part``), the whole tensor's
        checksum checked first.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        self.check(name)
        return super().get_part(name, index, rows)

    def gather_rows(self, name: str, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Rows of tensor `name` (see ``NumpyHandle.gather_rows``), the whole
        tensor's checksum checked first.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather_rows(name, rows)
        return gathered

    def gather(self, name: str, rows: Any, out: Optional[npt.NDArray[Any]] = None
               ) -> npt.NDArray[Any]:
        """Rows of tensor `name` (see ``NumpyHandle.gather``), the whole tensor's
        checksum checked first.

        Raises
        ------
        SafetensorError
            When the tensor's bytes do not match its checksum.
        """
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather(name, rows, out)
        return gathered


@overload
def open_handle(source: Source, convert: None = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None,
                uses_ml_dtypes: bool = True) -> NumpyHandle: ...
@overload
def open_handle(source: Source, convert: Converter[T], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None,
                uses_ml_dtypes: bool = True) -> FrameworkHandle[T]: ...
@overload
def open_handle(source: Source, convert: Optional[Converter[Any]], *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None, uses_ml_dtypes: bool = True
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]: ...
def open_handle(source: Source, convert: Optional[Converter[Any]] = None, *,
                max_header_size: int = DEFAULT_MAX_HEADER_SIZE, verify: bool = False,
                opened_as: Optional[Tuple[str, Any]] = None, uses_ml_dtypes: bool = True
                ) -> Union[NumpyHandle, FrameworkHandle[Any]]:
    """One safetensors file where `source` says, its tensors passed through
    `convert` (a framework's converter, see ``fastst._frameworks.registry``) or NumPy arrays
    when it is None; with `verify`, each tensor's checksum is checked on its first
    read. `opened_as`, the (framework, device) `convert` is for, lets a
    FrameworkHandle pickle. Without `uses_ml_dtypes` (for a caller that reads the
    header, or bytes), NumPy arrays of bfloat16 and float8 tensors come as their
    bits (see ``Reader.uses_ml_dtypes``)."""
    reader = _reader_for(convert, VerifyingHandle if verify else NumpyHandle, uses_ml_dtypes)
    source.open(reader, max_header_size=max_header_size)
    reader.origin = source
    return reader if convert is None else FrameworkHandle(reader, convert, opened_as)
