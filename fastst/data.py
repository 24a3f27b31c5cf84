"""Data loaders over the rows of a safetensors file.

``Rows`` serves the rows of one or more tensors of equal length (features and
labels, say) a whole batch at a time, each tensor through one ``gather``. It opens
its file lazily in each process: pickled (to a spawned worker), it carries the
file's identity and reopens it on first use, refusing a file that changed.

- ``batches(path, names, batch_size)``: NumPy (or JAX) batches, no torch needed.
- ``RowDataset(path, names, *, backend="mmap", framework="pt")``: a map-style
  ``torch.utils.data.Dataset`` (defined only when torch is installed, on first use
  of the name), a ``Rows`` that gives torch tensors by default;
  ``dataset[[3, 1, 4]]`` gathers a batch.
- ``data_loader(dataset, batch_size)``: torch's ``DataLoader`` fed by torch's
  ``BatchSampler``, so that each worker gathers a whole batch in one call.
- ``Loader(source, names, batch_size)``: batches of rows of one file or many,
  gathered by a few threads (the gathers release the GIL) into a ring of reused
  buffers, shuffled, split between ranks, resumable; no worker processes.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> from fastst.data import batches
>>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
>>> fastst.save_file({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, path)
>>> [y.tolist() for x, y in batches(path, ["x", "y"], batch_size=2)]
[[0, 1], [2, 3], [4]]
"""
from __future__ import annotations

import operator
import pickle
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Sized, Tuple

import numpy as np

from ._api import safe_open
from ._core import SafetensorError
from ._data.loader import Loader, Names, _common_length, _integer
from ._io.files import PathLike
from ._io.limits import DEFAULT_BACKEND

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch  # type: ignore[import-not-found, unused-ignore]
    from torch.utils.data import BatchSampler, DataLoader, Dataset

    from ._handles.protocols import Backend

    class RowDataset(Rows, Dataset[Any]):   # what _row_dataset_class makes at run time
        def __init__(self, path: PathLike, names: Names, *, backend: Backend = DEFAULT_BACKEND,
                     framework: str = "pt") -> None: ...
        def __getitem__(self, index: Any) -> Any: ...
        def __getitems__(self, indices: Sequence[int]) -> list[Any]: ...

# RowDataset too, when torch is installed (not listed: `import *` must not need torch)
__all__ = ["Loader", "Rows", "batches", "batch_sampler", "data_loader"]



class Rows:
    """The rows of tensors `names` of the file at `path`, all of the same length,
    served a whole batch at a time.

    Each tensor of a batch is read in one ``gather`` call (only its rows:
    with ``backend="pread"``, each run of adjacent rows in one read). The file
    is opened now and checked; pickled (to a spawned worker), a `Rows`
    carries the file's identity and opens it again on first use, refusing a
    file that changed. ``len(rows)`` is the number of rows; it is a context
    manager.

    Parameters
    ----------
    path : str or bytes or os.PathLike
        A safetensors file, or a sharded checkpoint (its directory or index).
    names : str or sequence of str
        One tensor name (batches are its arrays), or several (batches are
        tuples of arrays, in this order). Every tensor needs at least one
        axis, and the same length along the first.
    backend : "mmap" or "pread", default "mmap"
        How the file is read (see ``fastst.safe_open``).
    framework : str, default "np"
        What the batches are: NumPy arrays (``"np"``), torch (``"pt"``) or JAX
        (``"jax"``) tensors, as ``fastst.safe_open`` names them.

    Attributes
    ----------
    names : tuple of str
        The tensors served.

    Raises
    ------
    TensorNotFoundError
        When a name is not a tensor of the file.
    SafetensorError
        When no name is given, a tensor has no axis, or the tensors' lengths
        differ.
    FileNotFoundError
        When the file does not exist.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.data import Rows
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
    >>> fastst.save_file({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, path)
    >>> with Rows(path, ["x", "y"]) as rows:
    ...     len(rows), rows.gather([4, 0])
    (5, (array([[8., 9.],
           [0., 1.]]), array([4, 0])))
    """

    def __init__(self, path: PathLike, names: Names, *, backend: Backend = DEFAULT_BACKEND,
                 framework: str = "np") -> None:
        self._single = isinstance(names, str)
        self.names: Tuple[str, ...] = (names,) if isinstance(names, str) else tuple(names)
        self._handle: Any = safe_open(path, framework, backend=backend)
        self._pickled: Optional[bytes] = None
        try:
            self._length = _common_length(self._handle, self.names)
        except BaseException:
            self._handle.close()
            raise

    def __len__(self) -> int:
        return self._length

    def gather(self, rows: Any) -> Any:
        """Rows `rows` of every tensor, each tensor's in one call.

        Parameters
        ----------
        rows : sequence or array of int
            Row numbers, in any order, repeats allowed, negatives counted from
            the end (as ``NumpyHandle.gather`` takes them).

        Returns
        -------
        array or tuple of arrays
            One array when one name was given, else a tuple in the order of
            the names.

        Raises
        ------
        SafetensorIndexError
            When a row is out of range.
        SafetensorError
            When the `Rows` is closed, or its file changed since it was
            pickled.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.data import Rows
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(5)}, path)
        >>> with Rows(path, "y") as rows:
        ...     rows.gather([3, 1, -1])
        array([3, 1, 4])
        """
        handle = self._open()
        batch = tuple(handle.gather(name, rows) for name in self.names)
        return batch[0] if self._single else batch

    def batches(self, batch_size: int, *, shuffle: bool = False, seed: Any = None,
                drop_last: bool = False) -> Iterator[Any]:
        """Batches of `batch_size` rows, in order or shuffled.

        Parameters
        ----------
        batch_size : int
            Rows a batch, at least 1.
        shuffle : bool, default False
            Serve the rows in an order drawn by
            ``numpy.random.default_rng(seed)``.
        seed : int or numpy.random.Generator, optional
            The seed of the order.
        drop_last : bool, default False
            Leave out the last batch when it is shorter.

        Yields
        ------
        array or tuple of arrays
            Each batch, as `gather` gives it.

        Raises
        ------
        ValueError
            When `batch_size` is not a positive integer.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.data import Rows
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(5)}, path)
        >>> with Rows(path, "y") as rows:
        ...     [batch.tolist() for batch in rows.batches(2, shuffle=True, seed=0)]
        [[2, 4], [3, 0], [1]]
        """
        for rows in _batched(_order(len(self), shuffle, seed), batch_size, drop_last):
            yield self.gather(rows)

    @property
    def is_open(self) -> bool:
        """Whether this process has the file open (False in a worker before its
        first batch, and after ``close``)."""
        return self._handle is not None and not self._handle.closed

    @property
    def source(self) -> str:
        """The file's path, as messages name it (opens the file in a worker)."""
        return str(self._open().source)

    def _open(self) -> Any:
        if self._handle is None:
            if self._pickled is None:
                raise SafetensorError("rows of a closed file: make a new Rows to read again")
            self._handle = pickle.loads(self._pickled)   # checks it is the same file
        return self._handle

    def close(self) -> None:
        """Close the file; a closed `Rows` reads nothing more."""
        if self._handle is not None:
            self._handle.close()
        self._handle = self._pickled = None

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the open file: how to reopen it, opened on first use."""
        state = dict(self.__dict__)
        if self._handle is not None:
            state["_pickled"] = pickle.dumps(self._handle)
        state["_handle"] = None
        return state

    def __repr__(self) -> str:
        return f"<fastst.data.Rows {list(self.names)} ({self._length} rows)>"


def batches(path: PathLike, names: Names, batch_size: int, *, shuffle: bool = False,
            seed: Any = None, drop_last: bool = False, backend: Backend = DEFAULT_BACKEND,
            framework: str = "np") -> Iterator[Any]:
    """Batches of rows of tensors of a file, each tensor's gathered in one call:
    a data loader that needs no torch.

    Parameters
    ----------
    path : str or bytes or os.PathLike
        A safetensors file, or a sharded checkpoint.
    names : str or sequence of str
        One tensor (batches are its arrays) or several (batches are tuples),
        of equal lengths (see `Rows`).
    batch_size : int
        Rows a batch, at least 1.
    shuffle : bool, default False
        Serve the rows in an order drawn by ``numpy.random.default_rng(seed)``.
    seed : int or numpy.random.Generator, optional
        The seed of the order.
    drop_last : bool, default False
        Leave out the last batch when it is shorter.
    backend : "mmap" or "pread", default "mmap"
        How the file is read.
    framework : str, default "np"
        What the batches are: NumPy arrays (``"np"``), torch (``"pt"``) or JAX
        (``"jax"``) tensors, as ``fastst.safe_open`` names them.

    Yields
    ------
    array or tuple of arrays
        Each batch. The file is closed when the generator ends or is closed.

    Raises
    ------
    TensorNotFoundError
        When a name is not a tensor of the file.
    SafetensorError
        When the tensors' lengths differ, or one has no axis.
    ValueError
        When `batch_size` is not a positive integer.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.data import batches
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
    >>> fastst.save_file({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, path)
    >>> [y.tolist() for x, y in batches(path, ["x", "y"], 2, drop_last=True)]
    [[0, 1], [2, 3]]
    """
    with Rows(path, names, backend=backend, framework=framework) as rows:
        yield from rows.batches(batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)


def batch_sampler(dataset: Sized, batch_size: int, *, shuffle: bool = False,
                  drop_last: bool = False, generator: Optional[torch.Generator] = None
                  ) -> BatchSampler:
    """torch's ``BatchSampler`` over a dataset's rows, in order or shuffled: lists
    of row numbers that a ``RowDataset`` gathers in one call each.

    Give it to torch's ``DataLoader`` as ``sampler=``, with
    ``batch_size=None`` (what `data_loader` does).

    Parameters
    ----------
    dataset : RowDataset or sized
        What the rows are of (its ``len``).
    batch_size : int
        Rows a batch.
    shuffle : bool, default False
        Draw the order with torch's ``RandomSampler``.
    drop_last : bool, default False
        Leave out the last batch when it is shorter.
    generator : torch.Generator, optional
        The generator of the shuffled order.

    Returns
    -------
    torch.utils.data.BatchSampler

    Raises
    ------
    ImportError
        When torch is not installed.

    Examples
    --------
    >>> import torch
    >>> from fastst.data import batch_sampler
    >>> list(batch_sampler(range(5), 2))
    [[0, 1], [2, 3], [4]]
    >>> shuffled = list(batch_sampler(range(5), 2, shuffle=True,
    ...                               generator=torch.Generator().manual_seed(0)))
    >>> [len(batch) for batch in shuffled], sorted(sum(shuffled, []))
    ([2, 2, 1], [0, 1, 2, 3, 4])
    """
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler
    order = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
    return BatchSampler(order, batch_size, drop_last)


def data_loader(dataset: RowDataset, batch_size: int, *, shuffle: bool = False,
                drop_last: bool = False, generator: Optional[torch.Generator] = None,
                **options: Any) -> DataLoader[Any]:
    """torch's ``DataLoader`` over a ``RowDataset``, each batch gathered in one
    call by the worker that makes it.

    Each worker opens the file on its first batch (the dataset pickles
    without its open file).

    Parameters
    ----------
    dataset : RowDataset
        The rows.
    batch_size : int
        Rows a batch.
    shuffle : bool, default False
        Shuffle the rows (see `batch_sampler`).
    drop_last : bool, default False
        Leave out the last batch when it is shorter.
    generator : torch.Generator, optional
        The generator of the shuffled order.
    **options
        Passed to ``DataLoader`` (``num_workers``,
        ``multiprocessing_context``, ``pin_memory``, ``timeout``...).

    Returns
    -------
    torch.utils.data.DataLoader
        Whose batches are a tensor, or a tuple of tensors, a name.

    Raises
    ------
    ImportError
        When torch is not installed.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os, torch
    >>> import fastst.data
    >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
    >>> fastst.save_file({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, path)
    >>> dataset = fastst.data.RowDataset(path, ["x", "y"])
    >>> [y.tolist() for x, y in fastst.data.data_loader(dataset, batch_size=2)]
    [[0, 1], [2, 3], [4]]
    >>> dataset.close()
    """
    from torch.utils.data import DataLoader
    sampler = batch_sampler(dataset, batch_size, shuffle=shuffle, drop_last=drop_last,
                            generator=generator)
    return DataLoader(dataset, batch_size=None, sampler=sampler, **options)


def _order(length: int, shuffle: bool, seed: Any) -> npt.NDArray[Any]:
    if shuffle:
        return np.random.default_rng(seed).permutation(length)
    return np.arange(length)


def _batched(order: npt.NDArray[Any], batch_size: int, drop_last: bool
             ) -> Iterator[npt.NDArray[Any]]:
    batch_size = _integer("batch_size", batch_size, 1)
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]


def _row_dataset_class() -> type:
    """RowDataset, made on first use: its base class is torch's Dataset."""
    from torch.utils.data import Dataset

    class RowDataset(Rows, Dataset):  # type: ignore[misc]
        """A map-style torch ``Dataset`` over the rows of tensors `names` of the file
        at `path`: a `Rows` that gives torch tensors by default.

        ``dataset[i]`` is row i (a tensor, or a tuple of them); ``dataset[rows]``,
        for a list or array of row numbers, is a whole batch gathered in one
        call, as ``data_loader`` (or a ``DataLoader`` given
        ``sampler=batch_sampler(...)`` and ``batch_size=None``) asks for it; a
        ``DataLoader`` given a ``batch_size`` gets its batch in one call too
        (``__getitems__``). Each worker opens the file on its first batch.

        Parameters
        ----------
        path : str or bytes or os.PathLike
            A safetensors file, or a sharded checkpoint.
        names : str or sequence of str
            One tensor or several, of equal lengths (see `Rows`).
        backend : "mmap" or "pread", default "mmap"
            How the file is read.
        framework : str, default "pt"
            What the rows are: torch tensors (``"pt"``), NumPy arrays
            (``"np"``) or JAX arrays (``"jax"``).

        Raises
        ------
        TensorNotFoundError
            When a name is not a tensor of the file.
        SafetensorError
            When the tensors' lengths differ, or one has no axis.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> import fastst.data
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, path)
        >>> dataset = fastst.data.RowDataset(path, ["x", "y"])
        >>> len(dataset), dataset[1]
        (5, (tensor([2., 3.], dtype=torch.float64), tensor(1)))
        >>> dataset[[0, 4]][1]
        tensor([0, 4])
        >>> dataset.close()
        """

        def __init__(self, path: PathLike, names: Names, *, backend: Backend = DEFAULT_BACKEND,
                     framework: str = "pt") -> None:
            Rows.__init__(self, path, names, backend=backend, framework=framework)

        def __getitem__(self, index: Any) -> Any:
            if isinstance(index, (int, np.integer)) or getattr(index, "ndim", None) == 0:
                # one row: an int, or a 0-d integer array or tensor
                batch = self.gather([operator.index(index)])
                return batch[0] if self._single else tuple(part[0] for part in batch)
            return self.gather(index)

        def __getitems__(self, indices: Sequence[int]) -> list[Any]:
            """The samples a DataLoader with a batch_size asks for, gathered in one call
            (its collate_fn then stacks them)."""
            batch = self.gather(indices)
            if self._single:
                return list(batch)
            return list(zip(*batch))

        def __repr__(self) -> str:
            return f"<fastst.data.RowDataset {list(self.names)} ({len(self)} rows)>"

    RowDataset.__module__ = __name__
    RowDataset.__qualname__ = "RowDataset"    # so that pickle finds it here
    return RowDataset


def __getattr__(name: str) -> Any:
    if name == "RowDataset":
        cls = globals()["RowDataset"] = _row_dataset_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
