"""The thread loader behind ``fastst.data.Loader``: batches of rows of one file or
many, gathered by a few threads (the gathers release the GIL) into a ring of reused
buffers, shuffled, split between ranks, resumable, with no worker processes: the
order of each epoch, the dataset's files and the position are here, the threads of
an iteration in ``fastst._data.pipeline``. ``fastst.data`` is its public face."""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
from typing import (TYPE_CHECKING, Any, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import numpy as np

from .._core import Reader, SafetensorError, TensorNotFoundError, read_ahead_limit
from .._format.names import INDEX_SUFFIX
from .._frameworks.registry import NUMPY_FRAMEWORKS, converter
from .._io.limits import DEFAULT_BACKEND
from .._io.source import Identity, LocalFile, as_source, identity_of
from ..checkpoint import open_checkpoint
from .order import EpochRows
from .pipeline import Blocks, Pipeline
from .rowblocks import BlockEdges

if TYPE_CHECKING:
    import numpy.typing as npt

    from .._handles.protocols import Backend

__all__ = ["Loader"]

Names = Union[str, Sequence[str]]


class Loader:
    """Batches of the rows of tensors `names` of one file or many, gathered by a
    few threads into a ring of reused buffers: a data loader with no worker
    processes.

    The rows of all the files are numbered in order, the first file's first.
    Each epoch draws its order (shuffled or not), gives each rank its part of
    it, and cuts that into batches; a pool of `threads` gathers them (each
    tensor's rows in one ``gather``, which runs without the GIL) at most
    `prefetch` batches ahead of the one taken, straight into preallocated
    buffers. A batch is a dict, tensor name -> array of its rows.

    **The arrays of a batch are reused**: they hold that batch until `prefetch`
    more batches are taken, then a later one is gathered into them. Keep a
    batch longer with ``copy=True`` (fresh arrays each batch) or copy what you
    keep. JAX arrays are always copies.

    Iterating continues from the loader's position, ``(epoch, batch)``: the
    first iteration starts at batch 0 of epoch 0; after the last batch of an
    epoch the position is batch 0 of the next epoch, whose order is drawn anew
    (from ``(seed, epoch)``), so that each ``for`` loop over the loader is one
    epoch. A loop left early (``break``) is continued by the next one.
    ``set_epoch(epoch)`` moves to an epoch, as ``DistributedSampler``'s does;
    ``state_dict()`` and ``load_state_dict()`` save and restore the position.
    The threads end with the iteration: at its end, on ``break``, on an
    exception, when the iterator is collected, and at interpreter exit.

    Parameters
    ----------
    source : path, URL, or a sequence of them
        A safetensors file, a URL, a sharded checkpoint (its directory or
        ``*.index.json``), a directory of ``.safetensors`` shards (read in the
        order of their names), a glob pattern (``"data/train-*.safetensors"``,
        files in sorted order), or a list of any of these.
    names : str or sequence of str
        The tensors, of equal length along their first axis in each file.
        Every file must hold them all, with the same dtype and row shape.
    batch_size : int
        Rows a batch, at least 1. The buffers hold no more than this rank's
        rows of an epoch, whatever the number.
    shuffle : bool or "blocks", default False
        ``True``: a permutation of all the rows, drawn from ``(seed, epoch)``.
        ``"blocks"``: rows in blocks of `block_rows` adjacent rows, the blocks
        in a random order, the rows shuffled within each window of
        `window_blocks` blocks: reads stay local (a cold disk, an object store).
        The row at the edge of two blocks goes with the one read later (a
        window's blocks are read in the order of the file), so that no block
        reads a piece of the file before that piece's block.
        The blocks are read ahead on threads of their own: from local files
        into the page cache, in whole 2 MiB pieces that a map of the file maps
        by 2 MiB (later epochs gather faster from them), at the disk's pace
        where the page cache holds the dataset; over a URL or a file object
        into memory, a window ahead, and batches gathered from there, two
        windows held at most. A full shuffle over local files that the page
        cache holds reads them so too, whole, in order, before its first batch
        (which takes rows from nearly everywhere).
    seed : int, optional
        The seed of the shuffled orders, from 0; None draws one (saved in
        ``state_dict()``). Needed when there are several ranks.
    drop_last : bool, default False
        Leave out each rank's last batch when it is shorter.
    rank, world_size : int, optional
        This process's part of each epoch: its rank among `world_size`. Both
        None: torch.distributed's when it is initialised, else 0 of 1. Each
        rank takes every `world_size`-th row of the epoch's order, as
        ``DistributedSampler`` does: without `drop_last` the order is padded
        with its first rows to a multiple of `world_size`; with it, cut to
        one. Every rank gets the same number of batches.
    threads : int, default 2
        Threads that gather; no more are started than batches may be in
        flight (`prefetch` + 1). Over mapped files, the thread that waits for a
        small batch (512 KiB at most) fills the next ones itself meanwhile.
    prefetch : int, default 4
        Batches gathered ahead of the one taken; the ring holds twice as many,
        and no more than the batches of an epoch.
    copy : bool, default False
        Give each batch fresh arrays instead of the ring's.
    framework : str, default "np"
        NumPy arrays (``"np"``), torch tensors (``"pt"``) or JAX arrays
        (``"jax"``); torch and JAX are imported only when asked for.
    device : str, default "cpu"
        Where the framework's tensors go (see ``fastst.safe_open``).
    pin_memory : bool, default False
        With ``framework="pt"``: the ring's buffers in pinned memory (needs
        CUDA), for fast copies to the GPU.
    block_rows, window_blocks : int, default 4096 and 16
        The blocks of ``shuffle="blocks"``; a full shuffle reads a window's
        rows at a time.
    backend : "mmap" or "pread", default "mmap"
        How local files are read (see ``fastst.safe_open``); URLs are read by
        byte ranges, each batch's rows of a file in as few requests as their
        ranges allow.
    storage_options : dict, optional
        The fsspec options of the URLs.

    Attributes
    ----------
    names : tuple of str
        The tensors.
    rows : int
        Rows of the dataset, all files together.
    epoch : int
        The epoch the next batch is of.

    Raises
    ------
    SafetensorError
        When a file lacks a tensor (``TensorNotFoundError``), when a tensor's
        dtype or row shape differs between files, or its length between
        tensors of a file (each message names the file); when a pattern or a
        directory has no file.
    ValueError
        For a `batch_size`, `threads`, `prefetch`, `block_rows`,
        `window_blocks`, `seed`, `rank` or `world_size` that is not an integer
        (a bool, a float, a str) or is out of range; for several ranks with no
        seed.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.data import Loader
    >>> folder = tempfile.mkdtemp()
    >>> for k in range(2):      # two files: 6 rows, numbered across both
    ...     fastst.save_file({"x": np.arange(6.0).reshape(3, 2) + 6 * k,
    ...                       "y": np.arange(3) + 3 * k},
    ...                      os.path.join(folder, f"part-{k}.safetensors"))
    >>> with Loader(folder, ["x", "y"], batch_size=4) as loader:
    ...     [batch["y"].tolist() for batch in loader]
    [[0, 1, 2, 3], [4, 5]]
    >>> with Loader(folder, "y", batch_size=2, shuffle=True, seed=0, copy=True) as loader:
    ...     epoch_0 = [batch["y"].tolist() for batch in loader]
    ...     epoch_1 = [batch["y"].tolist() for batch in loader]     # a new order
    >>> sorted(sum(epoch_0, [])), epoch_0 != epoch_1
    ([0, 1, 2, 3, 4, 5], True)
    """

    __module__ = "fastst.data"

    def __init__(self, source: Any, names: Names, batch_size: int, *, shuffle: Any = False,
                 seed: Optional[int] = None, drop_last: bool = False,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 threads: int = 2, prefetch: int = 4, copy: bool = False,
                 framework: str = "np", device: Any = "cpu", pin_memory: bool = False,
                 block_rows: int = 4096, window_blocks: int = 16, backend: Backend = DEFAULT_BACKEND,
                 storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.batch_size, self.threads, self.prefetch, self.block_rows, self.window_blocks = (
            _integer(what, value, 1) for what, value in (
                ("batch_size", batch_size), ("threads", threads), ("prefetch", prefetch),
                ("block_rows", block_rows), ("window_blocks", window_blocks)))
        if shuffle not in (False, True, "blocks"):
            raise ValueError(f"shuffle must be False, True or 'blocks', got {shuffle!r}")
        if pin_memory and framework not in ("pt", "torch", "pytorch"):
            raise ValueError("pin_memory=True needs framework='pt'")
        self.rank, self.world_size = _world(rank, world_size)
        if seed is None:
            if shuffle and self.world_size > 1:
                raise ValueError("several ranks need one seed, the same on every rank, "
                                 "so that they share one order")
            seed = int(np.random.SeedSequence().entropy) if shuffle else 0
        self.names: Tuple[str, ...] = (names,) if isinstance(names, str) else tuple(names)
        self.shuffle, self.seed, self.drop_last = shuffle, _integer("seed", seed, 0), drop_last
        self.copy, self.framework, self.device = copy, framework, device
        self.pin_memory = pin_memory
        if pin_memory:
            _check_pinned_memory()
        self._converter: Any = None if framework in NUMPY_FRAMEWORKS else converter(
            framework, device)
        # torch views the bits of bfloat16 and float8 as its own: no ml_dtypes
        self._dataset = _Dataset(source, self.names, backend, storage_options,
                                 getattr(self._converter, "uses_ml_dtypes", True))
        self.rows = self._dataset.rows
        self._epoch = self._batch = 0
        self._ring: Optional[List[Dict[str, Any]]] = None    # the buffers, between iterations

    # -- the order of an epoch ------------------------------------------------

    def __len__(self) -> int:
        """Batches of an epoch, on this rank."""
        share = self._share()
        return share // self.batch_size if self.drop_last else -(-share // self.batch_size)

    def _share(self) -> int:
        if self.drop_last:
            return self.rows // self.world_size
        return -(-self.rows // self.world_size)

    def _rank_rows(self, epoch: int) -> EpochRows:
        """This rank's rows of epoch `epoch`, in order."""
        return EpochRows(self.rows, self.shuffle, self.seed, epoch, self.block_rows,
                         self.window_blocks, self._share() * self.world_size, self.rank,
                         self.world_size)

    @property
    def epoch(self) -> int:
        """The epoch the next batch is of."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Continue at batch 0 of `epoch`; the epoch the loader is at is left where
        it is (so that a loop that calls it each epoch continues a resumed run).

        Parameters
        ----------
        epoch : int
            The epoch, from 0.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.data import Loader
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(4)}, path)
        >>> with Loader(path, "y", 2, shuffle=True, seed=1, copy=True) as loader:
        ...     first = [b["y"].tolist() for b in loader]
        ...     loader.set_epoch(0)
        ...     again = [b["y"].tolist() for b in loader]
        >>> first == again
        True
        """
        epoch = _integer("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._batch = epoch, 0

    # -- iterating ------------------------------------------------------------

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        return self._batches(self._epoch, self._batch, 0, 1, track=True)

    def _batches(self, epoch: int, start: int, worker: int, workers: int, *,
                 track: bool) -> Iterator[Dict[str, Any]]:
        """The batches of `epoch` from `start`, every `workers`-th from start + worker;
        `track`: move the loader's position as they are taken."""
        count = len(self)
        todo = range(start + worker, count, workers)
        if not todo:
            if track:
                self._epoch, self._batch = epoch + 1, 0
            return
        slots = self._take_ring(min(2 * self.prefetch, len(todo)))
        blocks = (Blocks(self.block_rows, self.window_blocks, self._window_batches(workers),
                         scattered=self.shuffle is True)
                  if self.shuffle else None)
        pipeline = Pipeline(self._dataset, lambda: self._rank_rows(epoch),
                            self._batch_rows(), todo, slots, self.prefetch, self.threads, blocks)
        delivered: Dict[int, Dict[str, Any]] = {}
        try:
            for position, index in enumerate(todo):
                slot = pipeline.take(position)
                if track:
                    last = index + 1 == count
                    self._epoch, self._batch = (epoch + 1, 0) if last else (epoch, index + 1)
                yield self._deliver(slots, slot, pipeline.size(index), delivered)
        finally:
            pipeline.stop()
            self._ring = slots

    def _batch_rows(self) -> int:
        """The rows a batch can hold: `batch_size`, or this rank's share of an epoch
        where that is fewer (its one batch), so that no buffer is sized by a
        `batch_size` past the rows."""
        return max(1, min(self.batch_size, self._share()))

    def _window_batches(self, workers: int) -> int:
        """The batches of an iteration that a window of a block shuffle fills: this
        rank's share of its rows, and this worker's of their batches."""
        share = self.batch_size * self.world_size * workers
        return -(-self.block_rows * self.window_blocks // share)

    def _take_ring(self, size: int) -> List[Dict[str, Any]]:
        """The buffers of the last iteration (its threads ended), else new ones: an
        iteration under way holds its own."""
        ring, self._ring = self._ring, None
        if ring is None or len(ring) != size:
            ring = [self._dataset.buffers(self._batch_rows(), self._allocate)
                    for _ in range(size)]
        return ring

    def _deliver(self, slots: List[Dict[str, Any]], slot: int, size: int,
                 delivered: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        buffers = slots[slot]
        if self.copy or self.framework in ("jax", "flax") or size < self._batch_rows():
            arrays = {name: buffer[:size] for name, buffer in buffers.items()}
            if self.copy or self.framework in ("jax", "flax"):
                arrays = {name: array.copy() for name, array in arrays.items()}
            return self._converted(arrays)
        if slot not in delivered:       # the ring's arrays, as the framework's: made once
            delivered[slot] = self._converted(buffers)
        return dict(delivered[slot])

    def _converted(self, arrays: Dict[str, Any]) -> Dict[str, Any]:
        if self.framework in NUMPY_FRAMEWORKS:
            return arrays
        if self._converter is None:     # a pickled loader makes its converter again
            self._converter = converter(self.framework, self.device)
        return {name: self._converter(array, name, self._dataset.infos[name])
                for name, array in arrays.items()}

    def _allocate(self, shape: Tuple[int, ...], dtype: np.dtype) -> npt.NDArray[Any]:
        """A ring buffer, on a 64-byte boundary (a cache line): rows of whole lines
        are then copied into it with stores that bypass the cache where the ring is
        large (see ``BatchRing``); malloc puts large blocks 16 bytes past a page."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if self.pin_memory:
            import torch
            memory = torch.empty(nbytes + 64, dtype=torch.uint8, pin_memory=True).numpy()
        else:
            memory = np.empty(nbytes + 64, np.uint8)
        # its address from the array interface: `.ctypes` makes ctypes objects, which
        # CPython 3.13t makes racily from several threads (ThreadSanitizer: _ctypes.c)
        start = -memory.__array_interface__["data"][0] % 64
        return memory[start:start + nbytes].view(dtype).reshape(shape)

    # -- the position ---------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """The position (the next batch to take) and what it is a position in: small
        (no rows), plain (JSON-able), for ``load_state_dict``.

        Returns
        -------
        dict
            ``epoch`` and ``batch`` (the next batch), ``seed``, the order's
            settings, and the dataset's ``fingerprint``: its files in order,
            each by a digest of what its header says (tensors, dtypes, shapes,
            offsets, metadata) and its rows, and the tensors read.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.data import Loader
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(10)}, path)
        >>> loader = Loader(path, "y", 3, shuffle=True, seed=7)
        >>> for batch in loader:
        ...     state = loader.state_dict()      # after the first batch
        ...     break
        >>> rest = [b["y"].tolist() for b in loader]
        >>> again = Loader(path, "y", 3, shuffle=True, seed=7)
        >>> again.load_state_dict(state)
        >>> [b["y"].tolist() for b in again] == rest, state["epoch"], state["batch"]
        (True, 0, 1)
        >>> loader.close(); again.close()
        """
        return {"epoch": self._epoch, "batch": self._batch, "seed": self.seed,
                "settings": self._settings(), "fingerprint": self._dataset.fingerprint()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue where `state` (from ``state_dict``) was: the next iteration
        starts with the batch that followed.

        Parameters
        ----------
        state : dict
            What ``state_dict()`` gave, in this process or another.

        Raises
        ------
        SafetensorError
            When the state is of another dataset: other tensors read, files
            whose headers or rows differ, or the same files in another order
            (each message names the file). Where the files are does not count:
            a copy of them at another path, or copied back, is the same dataset.
            A file whose tensors' bytes changed under the same header is not
            told apart (checksums are: ``fastst verify``).
        ValueError
            When the state's order was made with other settings (batch size,
            shuffle, ranks...) or drawn by an earlier version of fastst whose
            orders differ; when its ``seed``, ``epoch`` or ``batch`` is not an
            integer (a bool, a float, a str) or is out of range, or it is not a
            loader's state. Nothing is changed then.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.data import Loader
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(6)}, path)
        >>> with Loader(path, "y", 2) as loader:
        ...     loader.load_state_dict({**loader.state_dict(), "batch": 2})
        ...     [b["y"].tolist() for b in loader]
        [[4, 5]]
        """
        if not isinstance(state, dict) or not {"epoch", "batch", "seed", "settings",
                                                "fingerprint"} <= set(state):
            raise ValueError("not a Loader's state_dict()")
        seed = _integer("the state's seed", state["seed"], 0)
        epoch = _integer("the state's epoch", state["epoch"], 0)
        settings = self._settings()
        if state["settings"] != settings:
            if (isinstance(state["settings"], dict) and {**state["settings"], **_ORDER_VERSIONS}
                    == {**settings, **_ORDER_VERSIONS}):
                raise ValueError("the state's order was drawn by an earlier version of "
                                 "fastst, whose orders differ from this one's: its "
                                 "position cannot be continued in this order")
            raise ValueError(f"the state's order was made with {state['settings']}, this "
                             f"loader's with {settings}: make the loader as it was")
        self._dataset.check_fingerprint(state["fingerprint"])
        # the state's settings are this loader's: its epochs had as many batches
        batch = _integer("the state's batch", state["batch"], 0, len(self))
        self.seed, self._epoch, self._batch = seed, epoch, batch

    def _settings(self) -> Dict[str, Any]:
        settings = {"batch_size": self.batch_size, "shuffle": self.shuffle,
                    "drop_last": self.drop_last, "rank": self.rank,
                    "world_size": self.world_size, "block_rows": self.block_rows,
                    "window_blocks": self.window_blocks}
        # an order drawn otherwise by an earlier version is refused (see load_state_dict)
        if self.shuffle == "blocks":   # edge rows to the block read later
            settings["block_edges"] = "read later"
        if self.shuffle:               # the draws of deal_rows and shuffle_rows
            settings["draws"] = "fastst 2"
        return settings

    # -- torch ----------------------------------------------------------------

    def torch_dataset(self) -> Any:
        """This loader's batches as a torch ``IterableDataset``, for a
        ``DataLoader(dataset, batch_size=None, num_workers=...)``: each worker
        gathers its own batches (every `num_workers`-th, from the loader's
        position), none twice, and the ``DataLoader`` gives them in the
        loader's order. Each batch is a fresh copy (it crosses processes).

        The loader in the main process does not move: call its ``set_epoch``
        before each epoch. Where no worker processes are needed, iterate the
        loader itself.

        Returns
        -------
        torch.utils.data.IterableDataset

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os, torch
        >>> from fastst.data import Loader
        >>> path = os.path.join(tempfile.mkdtemp(), "rows.safetensors")
        >>> fastst.save_file({"y": np.arange(7)}, path)
        >>> loader = Loader(path, "y", 2, framework="pt", threads=1)
        >>> batches = torch.utils.data.DataLoader(loader.torch_dataset(), batch_size=None,
        ...                                       num_workers=0)   # or 2: the same batches
        >>> [batch["y"].tolist() for batch in batches]
        [[0, 1], [2, 3], [4, 5], [6]]
        >>> loader.close()
        """
        return _torch_batches_class()(self)

    # -- the files ------------------------------------------------------------

    def close(self) -> None:
        """Close the files (iterations under way end at their next batch)."""
        self._dataset.close()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "_converter": None, "_ring": None}

    def __repr__(self) -> str:
        return (f"<fastst.data.Loader {list(self.names)} ({self.rows} rows, batches of "
                f"{self.batch_size}, epoch {self._epoch} batch {self._batch})>")


# The settings that say which version of the orders a state's was: an earlier
# version's state lacks them, or says another.
_ORDER_VERSIONS = {"block_edges": None, "draws": None}


class _Part(NamedTuple):
    """A file (or checkpoint) of a dataset: its handle, its first row's number, its
    rows, and the digest of what its header says (``_Dataset.header_digest``)."""
    handle: Any
    start: int
    rows: int
    header: str = ""


class _Dataset:
    """The rows of tensors `names` of several files, numbered across them."""

    def __init__(self, source: Any, names: Tuple[str, ...], backend: Backend,
                 storage_options: Optional[Dict[str, Any]], uses_ml_dtypes: bool) -> None:
        if not names or not all(isinstance(name, str) for name in names):
            raise SafetensorError(f"name at least one tensor (str) to read rows of, "
                                  f"got {names!r}")
        self.names, self.storage_options = names, storage_options
        self.parts: List[_Part] = []
        self.layouts: Dict[str, Tuple[np.dtype, Tuple[int, ...]]] = {}
        self.infos: Dict[str, Any] = {}
        try:
            for target in _dataset_files(source, storage_options):
                self._add(open_checkpoint(target, backend=backend,
                                          storage_options=storage_options,
                                          opened_as=("np", "cpu"),
                                          uses_ml_dtypes=uses_ml_dtypes))
        except BaseException:
            self.close()
            raise
        self.rows = sum(part.rows for part in self.parts)
        self.starts = np.array([part.start for part in self.parts], np.int64)
        # read by ranges (URLs, file objects): no page cache to read ahead into
        self.by_ranges = any(part.handle.backend == "ranges" for part in self.parts)

    def _add(self, handle: Any) -> None:
        start = self.parts[-1].start + self.parts[-1].rows if self.parts else 0
        self.parts.append(_Part(handle, start, 0))    # closed with the others on error
        for name in self.names:
            if name not in handle:
                raise TensorNotFoundError(f"{handle.source}: no tensor named {name!r}; every "
                                          f"file of a dataset needs each tensor read")
        rows = _common_length(handle, self.names)
        for name in self.names:
            empty = handle.gather(name, np.empty(0, np.intp))   # the dtype and row shape
            layout = (empty.dtype, empty.shape[1:])
            first = self.layouts.setdefault(name, layout)
            self.infos.setdefault(name, handle.info(name))
            if layout != first:
                raise SafetensorError(
                    f"{handle.source}: tensor {name!r} has rows of {layout[0]} {layout[1]}, "
                    f"where {self.parts[0].handle.source} has rows of {first[0]} {first[1]}: "
                    f"every file of a dataset needs the same")
        self.parts[-1] = _Part(handle, start, rows, self.header_digest(handle))

    def buffers(self, batch_size: int, allocate: Any) -> Dict[str, Any]:
        return {name: allocate((batch_size, *shape), dtype)
                for name, (dtype, shape) in self.layouts.items()}

    def fill(self, buffers: Dict[str, Any], rows: npt.NDArray[np.int64]) -> None:
        """Gather rows `rows` (numbers across the files) into `buffers`."""
        size = len(rows)
        if len(self.parts) == 1:
            for name in self.names:
                self.parts[0].handle.gather(name, rows, out=buffers[name][:size])
            return
        which = np.searchsorted(self.starts, rows, side="right") - 1
        for number in np.unique(which):
            part = self.parts[number]
            places = np.flatnonzero(which == number)
            local = rows[places] - part.start
            first, last = int(places[0]), int(places[-1])
            for name in self.names:
                if last - first + 1 == len(places):     # adjacent places: gathered in place
                    part.handle.gather(name, local, out=buffers[name][first:last + 1])
                else:
                    buffers[name][places] = part.handle.gather(name, local)

    def mapped_handles(self) -> Optional[List[Reader]]:
        """The handles of the files, where each is a single mapped file; else None."""
        handles = [part.handle for part in self.parts]
        if all(isinstance(handle, Reader) and handle.backend == "mmap" for handle in handles):
            return handles
        return None

    def read_rows(self, rows: npt.NDArray[np.int64]) -> Dict[str, Any]:
        """Rows `rows` of each tensor, in fresh arrays, read in one gather a file."""
        buffers = self.buffers(len(rows), np.empty)
        self.fill(buffers, rows)
        return buffers

    def prefetch_blocks(self, blocks: List[int], edges: BlockEdges) -> None:
        """Ask the kernel to start reading blocks `blocks` (of `edges`), in that
        order, into the page cache (each in large requests). Local files only; a
        sharded checkpoint is not asked."""
        for block in blocks:
            for handle, first, stop in self._local_parts(*edges.span(block)):
                for name in self.names:
                    handle.prefetch_rows(name, first, stop)

    def cache_rows(self, first: int, stop: int) -> None:
        """Read rows [first, stop) of the local files into the page cache now (see
        ``Reader.cache_rows``); a sharded checkpoint's are left to its reads."""
        for handle, local_first, local_stop in self._local_parts(first, stop):
            for name in self.names:
                handle.cache_rows(name, local_first, local_stop)

    def rows_cached(self, first: int, stop: int) -> bool:
        """Whether ``cache_rows(first, stop)`` would read nothing: the page cache
        holds those rows of the local files (``Reader.rows_cached``)."""
        return all(handle.rows_cached(name, local_first, local_stop)
                   for handle, local_first, local_stop in self._local_parts(first, stop)
                   for name in self.names)

    def read_ahead_on_faults(self, on: bool) -> None:
        """Whether faults on the local files' maps read ahead of the pages they touch
        (``Reader.read_ahead_on_faults``): off where ``cache_rows`` reads the rows."""
        for part in self.parts:
            advise = getattr(part.handle, "read_ahead_on_faults", None)
            if advise is not None:
                advise(on)

    def _local_parts(self, first: int, stop: int) -> Iterator[Tuple[Any, int, int]]:
        """(handle, first, stop) of each single local file that holds some of rows
        [first, stop), those rows numbered in the file."""
        for part in self.parts:
            if (getattr(part.handle, "cache_rows", None) is not None
                    and part.start < stop and first < part.start + part.rows):
                yield part.handle, first - part.start, stop - part.start

    def fits_page_cache(self) -> bool:
        """Whether the rows of every tensor read fill at most half of the machine's
        memory (``read_ahead_limit``). A block read in whole 2 MiB pieces brings parts
        of its neighbours, which are read again unless the page cache still holds them
        when their turn comes, and a full shuffle's rows are read before its first
        batch: a larger dataset's blocks are only asked for, block by block (a full
        shuffle's rows are read where they lie)."""
        row_bytes = sum(dtype.itemsize * int(np.prod(shape))
                        for dtype, shape in self.layouts.values())
        return self.rows * row_bytes <= read_ahead_limit()

    def header_digest(self, handle: Any) -> str:
        """The SHA-256 of what the header of `handle`'s file says (of a checkpoint, the
        headers of the shards of the tensors read, and its index's metadata): each
        tensor's name, dtype, shape and offsets, the metadata (a file's checksums
        among it), the header's length. A file holds no byte past its last tensor,
        so that this tells its size too; what it does not tell is its tensors'
        bytes."""
        index = getattr(handle, "index", None)
        if index is None:
            tensors = [("", name) for name in handle.offset_keys()]
            header_length = handle.data_start
        else:
            tensors = [(shard, name) for shard in self._shards_read(index)
                       for name in index.shards[shard]]
            header_length = None      # each shard's own, not given by a checkpoint
        described = [[shard, name, info.dtype, info.shape, list(info.data_offsets)]
                     for shard, name in tensors for info in [handle.info(name)]]
        said = [header_length, handle.metadata(), described]
        return hashlib.sha256(json.dumps(said, sort_keys=True).encode()).hexdigest()

    def fingerprint(self) -> Dict[str, Any]:
        """What a state says its dataset is: its files' headers (their digests) and
        rows, in order, and the tensors read; their paths name them in messages."""
        return {"sources": [part.handle.source for part in self.parts],
                "headers": [part.header for part in self.parts],
                "rows": [part.rows for part in self.parts], "names": list(self.names)}

    def check_fingerprint(self, seen: Any) -> None:
        """Refuse a state's `seen` fingerprint where it is of another dataset: other
        tensors, or files whose headers or rows differ, or in another order. Where
        the files are does not count: a copy of them at another path (or the same
        copied back) is the same dataset."""
        if isinstance(seen, dict) and "files" in seen and "headers" not in seen:
            self._check_earlier_fingerprint(seen)
            return
        now = self.fingerprint()
        if not _is_fingerprint(seen):
            raise SafetensorError("the state's fingerprint is not a Loader's")
        difference = _difference(seen, now)
        if difference is not None:
            raise SafetensorError(
                f"the state is of another dataset: {difference}; give the loader the "
                f"files the state was saved over (a copy of them anywhere will do), or "
                f"start a new run")

    def _check_earlier_fingerprint(self, seen: Dict[str, Any]) -> None:
        """A state of an earlier fastst, which names each file by its path and version
        (device, inode, size, mtime): taken over those files unchanged, as it was then,
        and refused otherwise."""
        files = [[identity.location, list(identity.version)]
                 for part in self.parts for identity in self._identities(part.handle)]
        now: Dict[str, Any] = {"files": files, "names": list(self.names),
                               "rows": [part.rows for part in self.parts]}
        if seen == now:
            return
        remedy = ("the state names its files by path and inode (an earlier fastst's): "
                  "continue over those files as they were, or start a new run")
        if not isinstance(seen.get("files"), list) or not all(
                isinstance(file, list) and len(file) == 2 for file in seen["files"]):
            raise SafetensorError("the state's fingerprint is not a Loader's")
        then_files = {str(location): version for location, version in seen["files"]}
        for location, version in now["files"]:
            before = then_files.get(location)
            if isinstance(before, list) and before != version:
                raise Identity(location, tuple(before)).changed(
                    Identity(location, tuple(version)), "file", "the state was saved", remedy)
        raise SafetensorError(
            f"the state is of another dataset: files {list(then_files)}, tensors "
            f"{seen.get('names')}, rows {seen.get('rows')}; this loader reads files "
            f"{[f for f, _ in now['files']]}, tensors {now['names']}, rows {now['rows']}; "
            f"{remedy}")

    def _identities(self, handle: Any) -> List[Identity]:
        """The versions of the files `handle` reads: a file's, or a checkpoint's
        index and the shards of the tensors read."""
        index = getattr(handle, "index", None)
        if index is None:
            seen = identity_of(handle)
            return [] if seen is None else [seen]
        place = handle.index_source
        found = [place.identity()] + [place.sibling(shard).identity()
                                      for shard in self._shards_read(index)]
        return [identity for identity in found if identity is not None]

    def _shards_read(self, index: Any) -> List[str]:
        """The shards of a checkpoint (its `index`) that hold the tensors read."""
        return sorted({index.weight_map[name] for name in self.names})

    def close(self) -> None:
        for part in self.parts:
            part.handle.close()


def _is_fingerprint(seen: Any) -> bool:
    """Whether `seen` is a fingerprint as ``_Dataset.fingerprint`` makes them."""
    if not isinstance(seen, dict) or not all(
            isinstance(seen.get(key), list) for key in ("sources", "headers", "rows", "names")):
        return False
    parts = len(seen["headers"])
    return (len(seen["sources"]) == len(seen["rows"]) == parts
            and all(isinstance(header, str) for header in seen["headers"])
            and all(isinstance(rows, int) for rows in seen["rows"]))


def _difference(then: Dict[str, Any], now: Dict[str, Any]) -> Optional[str]:
    """What differs between the dataset of fingerprint `then` and that of `now`, in
    words (naming the files); None where they are the same."""
    if then["names"] != now["names"]:
        return f"tensors {then['names']}, where this loader reads {now['names']}"
    held_then = list(zip(then["headers"], then["rows"]))
    held_now = list(zip(now["headers"], now["rows"]))
    if held_then == held_now:
        return None
    if len(held_then) != len(held_now):
        return (f"{len(held_then)} files {then['sources']}, where this loader reads "
                f"{len(held_now)}: {now['sources']}")
    if sorted(held_then) == sorted(held_now):
        return (f"its files {then['sources']} are in another order here: "
                f"{now['sources']}")
    k = next(k for k, (was, held) in enumerate(zip(held_then, held_now)) if was != held)
    source, was = now["sources"][k], f"file {k + 1} of the state's, {then['sources'][k]}"
    if held_now[k][1] != held_then[k][1]:
        return f"{source} has {held_now[k][1]} rows, where {was}, had {held_then[k][1]}"
    return (f"{source} has another header than {was} (other tensors, dtypes, shapes, "
            f"offsets or metadata)")


def _check_pinned_memory() -> None:
    import torch
    try:
        torch.empty(1, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:
        raise RuntimeError(f"pin_memory=True needs pinned memory, which this torch cannot "
                           f"give ({error}); leave pin_memory out") from None


def _integer(what: str, value: Any, least: int, most: Optional[int] = None) -> int:
    """`value`, an integer (not a bool, a float or a str) from `least` to `most`, as
    an int; else the ValueError that names it `what`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or value < least or (most is not None and value > most):
        span = f"from {least}" if most is None else f"from {least} to {most}"
        raise ValueError(f"{what} must be an integer {span}, got {value!r}")
    return int(value)


def _world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """(rank, world size): given, or torch.distributed's when it is initialised."""
    if rank is None and world_size is None:
        distributed = sys.modules.get("torch.distributed")    # never imported here
        if distributed is not None and distributed.is_available() \
                and distributed.is_initialized():
            return distributed.get_rank(), distributed.get_world_size()
        return 0, 1
    if rank is None or world_size is None:
        raise ValueError("give both rank and world_size, or neither")
    world_size = _integer("world_size", world_size, 1)
    return _integer("rank", rank, 0, world_size - 1), world_size


def _dataset_files(source: Any, storage_options: Optional[Dict[str, Any]]) -> List[Any]:
    """The files (or checkpoints) `source` names, in the order of their rows."""
    given = [source] if isinstance(source, (str, bytes, os.PathLike)) else list(source)
    if not given:
        raise SafetensorError("a Loader needs at least one file")
    found: List[Any] = []
    for target in given:
        place = as_source(target, storage_options)
        if isinstance(place, LocalFile) and place.is_directory():
            found += _directory_files(place)
        elif isinstance(place, LocalFile) and glob.has_magic(place.label) \
                and not os.path.exists(place.label):
            matches = sorted(glob.glob(place.label))
            if not matches:
                raise SafetensorError(f"{place.label}: no file matches this pattern")
            found += matches
        else:
            found.append(target)
    return found


def _directory_files(place: LocalFile) -> List[str]:
    """A checkpoint's directory (it has an index: read as one), else its shards."""
    names = sorted(os.listdir(place.label))
    if any(name.endswith(INDEX_SUFFIX) for name in names):
        return [place.label]
    shards = [os.path.join(place.label, name) for name in names
              if name.endswith(".safetensors")]
    if not shards:
        raise SafetensorError(f"{place.label}: no .safetensors file in this directory")
    return shards


def _torch_batches_class() -> type:
    """The IterableDataset of a Loader's batches, made on first use (torch's)."""
    cls = globals().get("_TorchBatches")
    if cls is not None:
        return cls
    from torch.utils.data import IterableDataset, get_worker_info

    class _TorchBatches(IterableDataset):  # type: ignore[misc, type-arg]
        def __init__(self, loader: Loader) -> None:
            self.loader = loader

        def __iter__(self) -> Iterator[Dict[str, Any]]:
            worker = get_worker_info()
            loader = self.loader
            if worker is None:
                return loader._batches(loader.epoch, loader._batch, 0, 1, track=False)
            loader.copy = True     # each batch crosses to the main process: its own
            return loader._batches(loader.epoch, loader._batch, worker.id,
                                   worker.num_workers, track=False)

    globals()["_TorchBatches"] = _TorchBatches
    _TorchBatches.__module__ = __name__
    _TorchBatches.__qualname__ = "_TorchBatches"    # so that pickle finds it here
    return _TorchBatches


def _common_length(handle: Any, names: Tuple[str, ...]) -> int:
    if not names:
        raise SafetensorError(f"{handle.source}: name at least one tensor to read rows of")
    lengths = {}
    for name in names:
        if not isinstance(name, str):
            raise TensorNotFoundError(f"{handle.source}: no tensor named {name!r}")
        shape = handle.info(name).shape
        if not shape:
            raise SafetensorError(f"{handle.source}: tensor {name!r} is 0-d: it has no rows")
        lengths[name] = shape[0]
    if len(set(lengths.values())) > 1:
        raise SafetensorError(f"{handle.source}: tensors must have as many rows each; "
                              f"rows by tensor: {lengths}")
    return int(lengths[names[0]])


def __getattr__(name: str) -> Any:
    if name == "_TorchBatches":     # a spawned worker unpickling a Loader's dataset
        return _torch_batches_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
