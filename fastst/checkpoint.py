"""Sharded checkpoints, in the layout of the Hugging Face tools: tensors spread
over ``model-00001-of-0000N.safetensors`` files, and ``model.safetensors.index.json``
naming the shard of each tensor.

Reading: ``safe_open`` (and ``load_file``, the adapters, ``fastst inspect``) take
a checkpoint's directory or its ``*.index.json`` and give one handle over all its
shards. Opening reads the index alone; each shard is opened, and checked against
the index, when one of its tensors is first asked for.

Writing: ``save_file(..., max_shard_size=...)`` cuts the tensors into shards the
way ``huggingface_hub.split_torch_state_dict_into_shards`` does, and writes the
files ``huggingface_hub.save_torch_state_dict`` writes, byte for byte.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> folder = tempfile.mkdtemp()
>>> tensors = {f"layer{i}": np.full(100, i, np.float32) for i in range(3)}
>>> fastst.save_file(tensors, folder, max_shard_size=800)
>>> sorted(os.listdir(folder))
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
>>> with fastst.safe_open(folder) as f:
...     f.keys(), f.metadata(), f.get_tensor("layer2")[:3].tolist()
(['layer0', 'layer1', 'layer2'], {'total_size': 1200}, [2.0, 2.0, 2.0])
"""
from __future__ import annotations

import os
import re
import threading
from typing import (TYPE_CHECKING, Any, Callable, Dict, Generic, Hashable, Iterable, Iterator,
                    List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union)

from ._core import (DEFAULT_MAX_HEADER_SIZE, SafetensorError, SafetensorTypeError, TensorInfo,
                    TensorNotFoundError, WriteSpec, spec_of_array, usable_cpus)
from ._format.checksums import plan_with_checksums
from ._format.index import (CheckpointIndex, commit_files, find_checkpoint, index_name,
                            index_text, read_index, remove_leftovers, save_place, shard_names,
                            write_files)
from ._format.names import (DEFAULT_PATTERN, INDEX_SUFFIX, is_checkpoint, is_checkpoint_path,
                            is_index_name)
from ._frameworks.registry import NUMPY_FRAMEWORKS, converter as framework_converter
from ._handles.handle import FrameworkHandle, NumpyHandle, T, data_bytes, open_handle
from ._handles.meta import TensorMeta, meta_of
from ._io.files import PathLike
from ._io.limits import DEFAULT_BACKEND, DEFAULT_PREFETCH_BYTES
from ._io.progress import byte_bar
from ._io.source import Identity, LocalFile, Source, as_source, identity_of

if TYPE_CHECKING:   # each imported on its first use
    from ._frameworks.registry import Converter
    from ._handles.prefetch import Plan, PrefetchLoader
    from ._handles.readahead import ChainedReadAhead
    from ._handles.slicing import SafeSlice

__all__ = ["DEFAULT_PATTERN", "INDEX_SUFFIX", "ShardEntry", "ShardedHandle",
           "NumpyShardedHandle", "CheckpointIndex", "data_bytes", "is_checkpoint",
           "is_checkpoint_path", "open_checkpoint", "parse_size", "read_index",
           "save_checkpoint", "split_into_shards"]

SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
# Shards from this size up are copied one at a time: the core already shares the copy
# of a file this large among threads, and nesting two pools of threads only slows it.
PARALLEL_BELOW = 64 << 20


# ---------------------------------------------------------------------------
# Reading: one handle over all shards
# ---------------------------------------------------------------------------

# an open shard: a NumpyHandle, or a FrameworkHandle for a framework's tensors
Shard = Any


class Opening(NamedTuple):
    """How ``safe_open`` opened a checkpoint: what a pickled handle opens again."""
    index: Source
    framework: str
    device: Any
    max_header_size: int
    verify: bool
    uses_ml_dtypes: bool = True    # else bfloat16 and float8 arrays hold their bits


class ShardedHandle(Generic[T]):
    """A sharded checkpoint opened as one file: what ``safe_open`` returns for a
    checkpoint's directory or ``*.index.json``.

    It has the reading methods of the handle of one file (``keys``,
    ``get_tensor``, ``get_tensors``, ``get_slice``, ``info``, ``offset_keys``, the
    mapping protocol); ``metadata()`` is the index's ``metadata`` object. A shard
    is opened when one of its tensors is first asked for, and checked then: it
    must hold exactly the tensors the index gives it. ``close()`` closes every
    shard opened.

    A handle from ``safe_open`` pickles by opening the checkpoint again (so it
    passes to spawned workers and process pools): the index and every shard must
    be the files they were when it was pickled.

    Parameters
    ----------
    index : CheckpointIndex
        The checkpoint's parsed index.
    source : Source
        Where the index is; the shards are its siblings.
    open_shard : callable
        Opens one shard's Source as a handle (a `NumpyHandle` or a
        `FrameworkHandle`).
    opening : Opening, optional
        How ``safe_open`` opened the checkpoint, for pickling.
    shards_seen : dict, optional
        The shards' identities when the handle was pickled: a shard that
        changed since is refused when it is opened.

    See Also
    --------
    open_checkpoint : How ``safe_open`` makes one.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> tensors = {f"layer{i}": np.full(100, i, np.float32) for i in range(3)}
    >>> fastst.save_file(tensors, folder, max_shard_size=800)    # two shards and an index
    >>> with fastst.safe_open(folder) as f:
    ...     type(f).__name__, len(f), os.path.basename(f.shard_file("layer2"))
    ('NumpyShardedHandle', 3, 'model-00002-of-00002.safetensors')
    """

    def __init__(self, index: CheckpointIndex, source: Source,
                 open_shard: Callable[[Source], Shard], opening: Optional[Opening] = None,
                 shards_seen: Optional[Dict[str, Identity]] = None) -> None:
        self._index = index
        self._source = source
        self._open_shard = open_shard
        self._opening = opening
        self._opened: Dict[str, Shard] = {}
        self._lock = threading.Lock()
        self._closed = False
        # shards as they were when the handle was pickled, for one unpickled
        self._shards_seen = dict(shards_seen or {})

    # -- shards ----------------------------------------------------------------

    def _shard_of(self, name: str) -> Shard:
        shard = self._index.weight_map.get(name) if isinstance(name, str) else None
        if shard is None:
            self._check_open()
            raise TensorNotFoundError(f"{self._index.path}: no tensor named {name!r}")
        return self._shard(shard, name)

    def _shard(self, shard: str, wanted: str) -> Shard:
        handle = self._opened.get(shard)
        if handle is not None:
            return handle
        with self._lock:
            self._check_open()
            handle = self._opened.get(shard)
            if handle is None:
                handle = self._opened[shard] = self._open_checked(shard, wanted)
        return handle

    def _open_checked(self, shard: str, wanted: str) -> Shard:
        index = self._index
        try:
            handle = self._open_shard(self._source.sibling(shard))
        except FileNotFoundError:
            raise SafetensorError(f"{index.path}: tensor {wanted!r}: shard {shard!r} is "
                                  f"missing") from None
        except IsADirectoryError:
            raise SafetensorError(f"{index.path}: tensor {wanted!r}: shard {shard!r} is a "
                                  f"directory") from None
        try:
            self._check_unchanged(shard, handle)
            self._check_contents(shard, handle)
        except SafetensorError:
            handle.close()
            raise
        return handle

    def _check_contents(self, shard: str, handle: Shard) -> None:
        index = self._index
        for name in handle.offset_keys():
            listed = index.weight_map.get(name)
            if listed is None:
                raise SafetensorError(f"{index.path}: shard {shard!r} holds tensor {name!r}, "
                                      f"which the index does not name")
            if listed != shard:
                raise SafetensorError(f"{index.path}: tensor {name!r} is in shard {shard!r} "
                                      f"and, by the index, in {listed!r}")
        expected = index.shards[shard]
        if len(handle) != len(expected):
            missing = next(name for name in expected if name not in handle)
            raise SafetensorError(f"{index.path}: tensor {missing!r} is absent from its "
                                  f"shard {shard!r}")

    def _check_unchanged(self, shard: str, handle: Shard) -> None:
        seen = self._shards_seen.get(shard)
        if seen is None:
            return
        now = identity_of(handle)
        if now is None or now.version != seen.version:
            raise seen.changed(now, f"shard {shard!r}", "the handle was pickled",
                               "open the checkpoint again to read it")

    def shards(self) -> List[Shard]:
        """Every shard's handle, in index order: each opened now, and checked
        against the index, before any is returned.

        Returns
        -------
        list of NumpyHandle or FrameworkHandle
            Closed with the checkpoint.

        Raises
        ------
        SafetensorError
            When a shard is missing, or does not hold exactly the tensors the
            index gives it.
        """
        return [handle for _, handle in self._all_shards()]

    def _all_shards(self) -> List[Tuple[str, Shard]]:
        return [(shard, self._shard(shard, names[0]))
                for shard, names in self._index.shards.items()]

    def _check_open(self) -> None:
        if self._closed:
            raise SafetensorError(f"{self._index.path}: the checkpoint is closed")

    # -- reading ---------------------------------------------------------------

    def get_tensor(self, name: str, *, sharding: Any = None) -> T:
        """Tensor `name` as its shard's handle gives it (see ``NumpyHandle.get_tensor``
        and ``FrameworkHandle.get_tensor``), the shard opened, and checked, on first use.

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        SafetensorError
            When its shard is missing, or does not match the index.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> tensors = {f"layer{i}": np.full(100, i, np.float32) for i in range(3)}
        >>> fastst.save_file(tensors, folder, max_shard_size=800)    # two shards and an index
        >>> with fastst.safe_open(folder) as f:
        ...     f.get_tensor("layer1")[:2]
        array([1., 1.], dtype=float32)
        """
        handle = self._shard_of(name)
        tensor: T = (handle.get_tensor(name) if sharding is None
                     else handle.get_tensor(name, sharding=sharding))
        return tensor

    def __getitem__(self, name: str) -> T:
        return self.get_tensor(name)

    def get_tensors(self, *, shardings: Any = None) -> Dict[str, T]:
        """Every tensor: shard by shard in index order, each shard's in buffer order.

        Parameters
        ----------
        shardings : jax.sharding.Sharding, mapping or callable, optional
            For JAX: how to lay out each array over devices (see
            ``FrameworkHandle.get_tensors``).

        Returns
        -------
        dict of str to tensor
        """
        tensors: Dict[str, T] = {}
        for _, handle in self._all_shards():
            tensors.update(handle.get_tensors() if shardings is None
                           else handle.get_tensors(shardings=shardings))
        return tensors

    def iter_tensors(self, names: Optional[Iterable[str]] = None, *,
                     prefetch_bytes: int = DEFAULT_PREFETCH_BYTES) -> ChainedReadAhead[T]:
        """The tensors, one by one, read ahead in the background within a budget
        of bytes (see ``NumpyHandle.iter_tensors``, whose parameters it takes): by
        default shard by shard in index order, each shard's in the order of its
        bytes. Each run of names from one shard is read ahead by that shard's
        handle, one run after another.

        Raises
        ------
        TensorNotFoundError
            When the index names no such tensor.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> fastst.save_file({f"w{i}": np.full(100, i, np.float32) for i in range(3)}, folder,
        ...                  max_shard_size=800)
        >>> with fastst.safe_open(folder) as f:
        ...     [(name, int(t[0])) for name, t in f.iter_tensors()]
        [('w0', 0), ('w1', 1), ('w2', 2)]
        """
        if names is None:
            runs = [(handle, None) for _, handle in self._all_shards()]
        else:
            if isinstance(names, str):
                raise SafetensorTypeError(f"{self._index.path}: names must be an iterable "
                                          f"of tensor names, not a str")
            runs = []
            for name in names:
                handle = self._shard_of(name)
                if runs and runs[-1][0] is handle:
                    runs[-1][1].append(name)
                else:
                    runs.append((handle, [name]))

        def part(handle: Shard, run: Optional[List[str]]) -> Callable[[], Any]:
            return lambda: handle.iter_tensors(run, prefetch_bytes=prefetch_bytes)

        from ._handles.readahead import ChainedReadAhead

        return ChainedReadAhead([part(handle, run) for handle, run in runs], prefetch_bytes)

    def prefetch(self, plan: Optional[Plan] = None, *, device: Any = None,
                 threads: Optional[int] = None,
                 max_bytes_in_flight: int = DEFAULT_PREFETCH_BYTES) -> PrefetchLoader[T]:
        """Start reading the tensors of `plan` in the background, within one budget
        of bytes for all the shards (see ``NumpyHandle.prefetch``, whose parameters
        it takes): shard by shard in index order, each shard's in the order of its
        bytes. A name the index lacks is a `TensorNotFoundError`.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> fastst.save_file({f"w{i}": np.full(100, i, np.float32) for i in range(3)}, folder,
        ...                  max_shard_size=800)
        >>> with fastst.safe_open(folder) as f, f.prefetch() as loader:
        ...     loader.names(), float(loader.take("w2").sum())
        (['w0', 'w1', 'w2'], 200.0)
        """
        from ._handles.prefetch import PrefetchLoader, checked_plan   # imported on first use

        checked = checked_plan(plan, self._index.path)
        for name in checked or ():
            self._shard_of(name)     # TensorNotFoundError for a name the index lacks
        tensors = []
        for shard, names in self._index.shards.items():
            part = None if checked is None else {name: checked[name] for name in names
                                                 if name in checked}
            if part is None or part:
                tensors += self._shard(shard, names[0])._prefetched(part, device)
        return PrefetchLoader(tensors, self._index.path, threads=threads,
                              max_bytes_in_flight=max_bytes_in_flight)

    def will_need(self, names: Iterable[str]) -> int:
        """Ask the kernel to start reading tensors into the page cache, each from
        its shard (see ``NumpyHandle.will_need``).

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> fastst.save_file({f"w{i}": np.zeros(100, np.float32) for i in range(3)}, folder,
        ...                  max_shard_size=800)
        >>> with fastst.safe_open(folder) as f:
        ...     f.will_need(["w2", "w0"])
        800
        """
        by_shard: Dict[int, Tuple[Shard, List[str]]] = {}
        for name in names:
            handle = self._shard_of(name)
            by_shard.setdefault(id(handle), (handle, []))[1].append(name)
        return sum(handle.will_need(part) for handle, part in by_shard.values())

    def gather(self, name: str, rows: Any) -> T:
        """Rows `rows` of tensor `name`'s first axis, from its shard (see
        ``NumpyHandle.gather``).

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        SafetensorIndexError
            When a row is out of range.
        """
        tensor: T = self._shard_of(name).gather(name, rows)
        return tensor

    def get_slice(self, name: str) -> SafeSlice[T]:
        """A lazy handle on tensor `name`, from its shard (see ``fastst.SafeSlice``).

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        """
        part: SafeSlice[T] = self._shard_of(name).get_slice(name)
        return part

    def info(self, name: str) -> TensorInfo:
        """What the header of its shard says of tensor `name` (opens the shard).

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        """
        info: TensorInfo = self._shard_of(name).info(name)
        return info

    def get_tensor_meta(self, name: str) -> TensorMeta:
        """What the header of its shard says of tensor `name`: its dtype code,
        shape and data offsets in that shard (opens the shard, reads none of its
        tensors; see ``NumpyHandle.get_tensor_meta``).

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> folder = tempfile.mkdtemp()
        >>> fastst.save_file({f"w{i}": np.zeros(100, np.float32) for i in range(3)}, folder,
        ...                  max_shard_size=800)
        >>> with fastst.safe_open(folder) as f:
        ...     f.get_tensor_meta("w2")      # the first tensor of the second shard
        TensorMeta(dtype='F32', shape=[100], data_offsets=(0, 400))
        """
        return meta_of(self.info(name))

    def shard_file(self, name: str) -> str:
        """The path (or URL, its credentials hidden) of the shard the index puts
        tensor `name` in (opens nothing); `shard_source` gives it whole.

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        """
        return self.shard_source(name).label

    def shard_source(self, name: str) -> Source:
        """Where the shard the index puts tensor `name` in is, as a Source (opens
        nothing).

        Raises
        ------
        TensorNotFoundError
            When the index names no tensor `name`.
        """
        shard = self._index.weight_map.get(name)
        if shard is None:
            raise TensorNotFoundError(f"{self._index.path}: no tensor named {name!r}")
        return self._source.sibling(shard)

    def keys(self) -> List[str]:
        """Tensor names, sorted (from the index: opens no shard).

        Returns
        -------
        list of str
        """
        self._check_open()
        return sorted(self._index.weight_map)

    def offset_keys(self) -> List[str]:
        """Tensor names shard by shard, each shard's in buffer order (opens every
        shard).

        Returns
        -------
        list of str
        """
        return [name for _, handle in self._all_shards() for name in handle.offset_keys()]

    def metadata(self) -> Optional[Dict[str, Any]]:
        """The index's ``metadata`` object (e.g. ``{"total_size": 1200}``, whose
        values need not be str), or None when the index has none.

        Returns
        -------
        dict or None
        """
        self._check_open()
        return None if self._index.metadata is None else dict(self._index.metadata)

    @property
    def index(self) -> CheckpointIndex:
        """The checkpoint's parsed index."""
        return self._index

    @property
    def index_source(self) -> Source:
        """Where the index is, as a Source (a URL's with its credentials, which
        ``index.path`` and messages hide)."""
        return self._source

    @property
    def source(self) -> str:
        """The index's path (or URL), as messages name the checkpoint."""
        return self._index.path

    @property
    def backend(self) -> str:
        """How the shards are read: ``"mmap"``, ``"pread"`` or ``"ranges"``."""
        return self._source.backend

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called; its shards are closed with it."""
        return self._closed

    def close(self) -> None:
        """Close every shard opened; the handle cannot be used afterwards (tensors
        already given stay valid)."""
        with self._lock:
            self._closed = True
            opened, self._opened = self._opened, {}
        for handle in opened.values():
            handle.close()

    def __len__(self) -> int:
        return len(self._index.weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._index.weight_map

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __enter__(self) -> ShardedHandle[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickled, the handle holds how the checkpoint was opened and the identity
        of its index and shards (see ``_reopened_checkpoint``)."""
        opening = self._opening
        if opening is None:
            raise SafetensorTypeError(f"{self._index.path}: only a checkpoint from safe_open "
                                      f"can be pickled")
        self._check_open()
        shards = {shard: self._identity_of(shard) for shard in self._index.shards}
        seen = {shard: identity for shard, identity in shards.items() if identity is not None}
        index_seen = opening.index.identity()
        if index_seen is None:
            raise SafetensorError(f"{self._index.path}: the index is gone; a checkpoint "
                                  f"whose index is missing cannot be pickled")
        return _reopened_checkpoint, (opening, index_seen, seen)

    def _identity_of(self, shard: str) -> Optional[Identity]:
        """The shard as this handle reads it: its opened file, or the file on disk
        (None when missing: opening it will say so)."""
        handle = self._opened.get(shard)
        if handle is not None:
            return identity_of(handle)
        return self._source.sibling(shard).identity()

    def __repr__(self) -> str:
        state = ("closed" if self._closed else
                 f"{len(self)} tensors in {len(self._index.shards)} shards")
        return f"<fastst.safe_open {self._index.path!r} ({state})>"


class NumpyShardedHandle(ShardedHandle[Any]):
    """A sharded checkpoint whose tensors are NumPy arrays, with the NumPy-only
    methods of ``NumpyHandle`` too: ``out=``, `copy_tensors`, `read_into`,
    `read_rows`, `gather_rows`.

    What ``safe_open(checkpoint)`` returns for NumPy; its constructor is that of
    `ShardedHandle`.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> tensors = {f"layer{i}": np.full(100, i, np.float32) for i in range(3)}
    >>> fastst.save_file(tensors, folder, max_shard_size=800)    # two shards and an index
    >>> with fastst.safe_open(folder) as f:
    ...     copies = f.copy_tensors()
    >>> sorted(copies), copies["layer0"].base is None
    (['layer0', 'layer1', 'layer2'], True)
    """

    def get_tensor(self, name: str, *, out: Any = None, sharding: None = None) -> Any:
        """Tensor `name`, from its shard, into `out` when given (see
        ``ShardedHandle.get_tensor``); `sharding` is for JAX handles.

        Raises
        ------
        ValueError
            When `out` is not of the tensor's dtype and shape.
        SafetensorError
            When `sharding` is given: shardings lay out JAX arrays.
        """
        if sharding is not None:
            raise SafetensorError(f"{self._index.path}: sharding= lays out JAX arrays; open "
                                  f"the checkpoint with framework='jax'")
        return self._shard_of(name).get_tensor(name, out=out)

    def __enter__(self) -> NumpyShardedHandle:
        return self

    def copy_tensors(self) -> Dict[str, Any]:
        """Every tensor read into fresh memory, shard by shard in index order (see
        ``NumpyHandle.copy_tensors``).

        A large shard's copy shares its work among threads itself: those are read
        one after another. Smaller shards are read by a pool of threads, one shard
        each, so that a checkpoint of many small shards keeps the throughput of
        one file.
        """
        shards = self._all_shards()
        small = [handle for shard, handle in shards if data_bytes(handle) < PARALLEL_BELOW]
        parts: Dict[int, Dict[str, Any]] = {}
        if len(small) > 1:
            from concurrent.futures import ThreadPoolExecutor   # a first load needs none

            with ThreadPoolExecutor(min(len(small), usable_cpus())) as pool:
                parts = dict(zip(map(id, small), pool.map(_copy_of, small)))
        tensors: Dict[str, Any] = {}
        for _, handle in shards:
            part = parts.get(id(handle))
            tensors.update(part if part is not None else handle.copy_tensors())
        return tensors

    def read_into(self, arrays: Dict[str, Any]) -> None:
        """Read the named tensors into caller-supplied arrays, each from its shard
        (see ``NumpyHandle.read_into``).

        Raises
        ------
        TensorNotFoundError
            When the index names no such tensor.
        ValueError
            When an array is not of its tensor's dtype and shape.
        """
        by_shard: Dict[int, Tuple[Shard, Dict[str, Any]]] = {}
        for name, array in arrays.items():
            handle = self._shard_of(name)
            by_shard.setdefault(id(handle), (handle, {}))[1][name] = array
        for handle, part in by_shard.values():
            handle.read_into(part)

    def read_rows(self, name: str, first: int, last: int) -> Any:
        """Rows ``[first, last)`` of tensor `name`, from its shard (see
        ``NumpyHandle.read_rows``)."""
        return self._shard_of(name).read_rows(name, first, last)

    def gather_rows(self, name: str, rows: Any) -> Any:
        """Rows `rows` (an ``intp`` array, in range) of tensor `name`, from its
        shard (see ``NumpyHandle.gather_rows``)."""
        return self._shard_of(name).gather_rows(name, rows)

    def gather(self, name: str, rows: Any, out: Any = None) -> Any:
        """Rows `rows` of tensor `name`'s first axis, into `out` when given (see
        ``NumpyHandle.gather``)."""
        return self._shard_of(name).gather(name, rows, out)


def _reopened_checkpoint(opening: Opening, index_seen: Identity,
                         shards_seen: Dict[str, Identity]
                         ) -> Union[NumpyHandle, FrameworkHandle[Any], ShardedHandle[Any]]:
    """A pickled checkpoint handle, unpickled: the checkpoint opened again as it
    was. An index that changed is refused now; a shard that changed, when it is
    opened."""
    now = opening.index.identity()
    if now is None or now.version != index_seen.version:
        raise index_seen.changed(now, "index", "the handle was pickled",
                                 "open the checkpoint again to read it")
    convert = (None if opening.framework in NUMPY_FRAMEWORKS
               else framework_converter(opening.framework, opening.device))
    return open_checkpoint(opening.index, convert, max_header_size=opening.max_header_size,
                           verify=opening.verify, opened_as=(opening.framework, opening.device),
                           uses_ml_dtypes=opening.uses_ml_dtypes,
                           shards_seen=shards_seen)


def _copy_of(handle: Shard) -> Dict[str, Any]:
    copies: Dict[str, Any] = handle.copy_tensors()
    return copies


def open_checkpoint(target: Any, convert: Optional[Converter[Any]] = None, *,
                    backend: str = DEFAULT_BACKEND, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    verify: bool = False, opened_as: Optional[Tuple[str, Any]] = None,
                    shards_seen: Optional[Dict[str, Identity]] = None,
                    storage_options: Optional[Mapping[str, Any]] = None,
                    uses_ml_dtypes: bool = True
                    ) -> Union[NumpyHandle, FrameworkHandle[Any], ShardedHandle[Any]]:
    """Open a sharded checkpoint, a directory or an ``*.index.json``, as one handle.

    What ``safe_open`` does for a checkpoint. Opening reads the index alone;
    the shards are the files (or objects) beside it, each opened, and checked
    against the index, when one of its tensors is first asked for. A
    directory holding one unsharded file (``model.safetensors``) gives that
    file's handle.

    Parameters
    ----------
    target : Source or str or os.PathLike or URL
        The checkpoint's directory or index.
    convert : callable, optional
        A framework's converter, ``convert(array, name, info)``; None for
        NumPy arrays.
    backend : "mmap" or "pread", default "mmap"
        How local shards are read (for a path).
    max_header_size : int, default 100,000,000
        The largest header, and index, accepted, in bytes.
    verify : bool, default False
        Each shard must hold checksums, and each tensor's is checked on its
        first read (see ``fastst.integrity``).
    opened_as : tuple of (str, device), optional
        The framework and device `convert` is for; lets the handle pickle.
    shards_seen : dict, optional
        The shards' identities when the handle was pickled: shards that
        changed since are refused.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    uses_ml_dtypes : bool, default True
        False for a caller that reads headers or bytes: NumPy arrays of
        bfloat16 and float8 tensors then hold their bits (unsigned integers
        of their width), and ml_dtypes is not imported.

    Returns
    -------
    ShardedHandle or NumpyShardedHandle or NumpyHandle or FrameworkHandle
        A `NumpyShardedHandle` for NumPy, a `ShardedHandle` otherwise; a
        single file's handle for a directory holding one unsharded file.

    Raises
    ------
    FileNotFoundError
        When the index does not exist.
    SafetensorError
        When the index is not valid (see `read_index`), or a directory holds
        no checkpoint, or several.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> tensors = {f"layer{i}": np.full(100, i, np.float32) for i in range(3)}
    >>> fastst.save_file(tensors, folder, max_shard_size=800)    # two shards and an index
    >>> from fastst.checkpoint import open_checkpoint
    >>> with open_checkpoint(folder) as f:
    ...     f.index.shards["model-00002-of-00002.safetensors"]
    ['layer2']
    """
    source = as_source(target, storage_options, backend=backend)
    if source.is_directory():
        source = LocalFile(find_checkpoint(source.label), source.backend)
    if not is_index_name(source.name):
        return open_handle(source, convert, max_header_size=max_header_size, verify=verify,
                           opened_as=opened_as, uses_ml_dtypes=uses_ml_dtypes)
    index = read_index(source, max_size=max_header_size)
    opening = None if opened_as is None else Opening(source, *opened_as, max_header_size,
                                                     verify, uses_ml_dtypes)

    def open_shard(shard: Source) -> Shard:   # (framework, device): a shard's slices pickle
        return open_handle(shard, convert, max_header_size=max_header_size, verify=verify,
                           opened_as=opened_as, uses_ml_dtypes=uses_ml_dtypes)

    kind = NumpyShardedHandle if convert is None else ShardedHandle
    return kind(index, source, open_shard, opening, shards_seen)


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

class ShardEntry(NamedTuple):
    """One tensor to write into a sharded checkpoint (see `save_checkpoint`).

    Attributes
    ----------
    spec : WriteSpec
        The tensor: name, dtype code, shape and data.
    size : int
        The bytes it counts for against ``max_shard_size`` (its storage's, for
        torch, as the Hugging Face tools count).
    storage : hashable or None
        What its memory is: tensors of one storage go into one shard, and
        only the first counts.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.checkpoint import ShardEntry
    >>> from fastst.writer import spec_of_array
    >>> ShardEntry(spec_of_array("x", np.zeros(4, np.float32)), 16).size
    16
    """
    spec: WriteSpec
    size: int                   # the bytes it counts for against max_shard_size
    storage: Optional[Hashable] = None   # tensors of one storage go into one shard


def parse_size(size: Union[int, str]) -> int:
    """A shard size limit in bytes, from an int or a size as the Hugging Face
    tools write it.

    Parameters
    ----------
    size : int or str
        Bytes, or a decimal size with a unit: ``"5GB"`` is 5 * 10**9 (units
        KB, MB, GB, TB, powers of 1000, as in ``huggingface_hub``).

    Returns
    -------
    int
        Bytes, above 0.

    Raises
    ------
    SafetensorError
        When `size` is not an int or such a size, or is not above 0.

    Examples
    --------
    >>> from fastst.checkpoint import parse_size
    >>> parse_size("5GB"), parse_size("1.5 MB"), parse_size(1024)
    (5000000000, 1500000, 1024)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip()
        multiplier = SIZE_UNITS.get(text[-2:].upper())
        number = text[:-2].strip()
        if multiplier is None or not re.fullmatch(r"[0-9]*\.?[0-9]+(e[0-9]+)?", number):
            raise SafetensorError(f"max_shard_size {size!r}: expected a number of bytes or "
                                  f"a size such as '5GB' (units KB, MB, GB, TB)")
        value = int(float(number) * multiplier)
    else:
        raise SafetensorError(f"max_shard_size must be an int or a str such as '5GB', got "
                              f"{type(size).__name__}")
    if value <= 0:
        raise SafetensorError(f"max_shard_size {size!r}: must be above 0 bytes")
    return value


def split_into_shards(entries: Sequence[ShardEntry], max_shard_size: int
                      ) -> Tuple[List[List[str]], int]:
    """Tensor names grouped into shards, and the total size counted, as the
    Hugging Face tools group them.

    Greedy, in the order of `entries`: a tensor goes into the current shard
    unless it would take it past `max_shard_size`, which then is closed. A
    tensor larger than the limit gets a shard of its own at once (the current
    shard stays open after it). A tensor sharing its storage with an earlier
    one counts for nothing and joins that one's shard, at its end.

    Parameters
    ----------
    entries : sequence of ShardEntry
        The tensors, in the order to place them.
    max_shard_size : int
        The most bytes a shard holds (see `parse_size`).

    Returns
    -------
    shards : list of list of str
        The tensor names of each shard.
    total : int
        The bytes counted, each storage once.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.checkpoint import ShardEntry, split_into_shards
    >>> from fastst.writer import spec_of_array
    >>> entries = [ShardEntry(spec_of_array(name, np.zeros(size, np.uint8)), size)
    ...            for name, size in [("a", 300), ("b", 300), ("c", 900), ("d", 200)]]
    >>> split_into_shards(entries, 800)      # "c" alone: "a" and "b" wait for "d"
    ([['c'], ['a', 'b', 'd']], 1700)
    """
    shards: List[List[str]] = []
    current: List[str] = []
    current_size = total = 0
    first_of_storage: Dict[Hashable, str] = {}
    followers: Dict[str, List[str]] = {}
    for entry in entries:
        name = entry.spec.name
        if entry.storage is not None:
            first = first_of_storage.setdefault(entry.storage, name)
            if first != name:
                followers.setdefault(first, []).append(name)
                continue
        total += entry.size
        if entry.size > max_shard_size:
            shards.append([name])
            continue
        if current_size + entry.size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += entry.size
    if current:
        shards.append(current)
    for shard in shards:
        shard.extend(follower for name in list(shard) for follower in followers.get(name, ()))
    return shards, total


def save_checkpoint(entries: Sequence[ShardEntry], filename: PathLike, *,
                    max_shard_size: Union[int, str],
                    metadata: Optional[Mapping[str, str]] = None,
                    shard_metadata: Optional[Mapping[str, str]] = None,
                    fsync: bool = False, checksum: Optional[str] = None,
                    align: Optional[int] = None) -> List[str]:
    """Write tensors as a checkpoint cut into shards, with its index, as the
    Hugging Face tools write one.

    What ``save_file(..., max_shard_size=...)`` and the frameworks' savers
    run. The shards are cut by `split_into_shards`; when everything fits in
    one shard, that one file is written, as ``model.safetensors`` (or
    ``NAME.safetensors``), and no index.

    A save replaces the checkpoint in that place as one file is replaced: until
    the new index is in place the old checkpoint opens, after it the new one,
    never a mix, even when the save is killed (see ``fastst._format.index.commit_files``; on a file
    system without hard links, a save killed while it sets old shards aside
    leaves a checkpoint that refuses to open, naming a missing shard). The files
    of the old save, and what a killed save left, are removed after. The files
    are entries of the directory: a symlink among them is replaced, not written
    through. Each keeps the permission bits of the file it replaces, or of the
    checkpoint's index (or single file) when it replaces none. When stderr is a
    terminal and the files hold 64 MiB or more, a bar there shows the bytes
    written (never in a pipe or a file).

    Parameters
    ----------
    entries : sequence of ShardEntry
        The tensors, in the order to place them.
    filename : str or os.PathLike
        The directory to save into (created if need be; the files are
        ``model-00001-of-0000N.safetensors`` and
        ``model.safetensors.index.json``), or the path the checkpoint would
        have as one file, ``DIR/NAME.safetensors``, for
        ``DIR/NAME-00001-of-0000N.safetensors`` and
        ``DIR/NAME.safetensors.index.json``.
    max_shard_size : int or str
        The most bytes a shard holds (see `parse_size`).
    metadata : mapping of str to str, optional
        The index's ``metadata``, after ``{"total_size": ...}``.
    shard_metadata : mapping of str to str, optional
        Each shard's ``__metadata__`` (``{"format": "pt"}`` for torch). A
        single file holds both dicts merged.
    fsync : bool, default False
        Flush each file, and the directory, to disk.
    checksum : "xxh3_64" or "xxh3_128", optional
        Each file holds the checksums of its own tensors (see
        ``fastst.integrity``).
    align : int, optional
        Each file is aligned (see ``fastst.save``): its data, and as many of
        its tensors as can, start at multiples of this many bytes. The shards
        are cut as without it.

    Returns
    -------
    list of str
        The paths of the files written, the index last.

    Raises
    ------
    SafetensorError
        When `max_shard_size` is not a size, or a tensor is not valid (every
        file is checked before the first is written).
    OSError
        When the files cannot be written; the old checkpoint stays.

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> from fastst.checkpoint import ShardEntry, save_checkpoint
    >>> from fastst.writer import spec_of_array
    >>> folder = tempfile.mkdtemp()
    >>> entries = [ShardEntry(spec_of_array(f"w{i}", np.zeros(100, np.uint8)), 100)
    ...            for i in range(3)]
    >>> paths = save_checkpoint(entries, os.path.join(folder, "net.safetensors"),
    ...                         max_shard_size=200, metadata={"step": "3"})
    >>> [os.path.basename(path) for path in paths]
    ['net-00001-of-00002.safetensors', 'net-00002-of-00002.safetensors', 'net.safetensors.index.json']
    """
    directory, pattern = save_place(filename)
    shards, total = split_into_shards(entries, parse_size(max_shard_size))
    by_name = {entry.spec.name: entry.spec for entry in entries}
    names = shard_names(pattern, len(shards))
    if len(shards) <= 1:
        single = {**(shard_metadata or {}), **(metadata or {})}
        files = {names[0]: plan_with_checksums(
            [by_name[name] for name in (shards[0] if shards else [])], single or None,
            checksum, align=align)}
    else:
        files = {file: plan_with_checksums([by_name[name] for name in shard], shard_metadata,
                                           checksum, align=align)
                 for file, shard in zip(names, shards)}
    index = None
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
        index = index_text(weight_map, {"total_size": total, **(metadata or {})})
        names.append(index_name(pattern))
    # every plan is checked before the first file is written
    bar = byte_bar(sum(plan.total_size for plan in files.values()), "save")
    try:
        written = write_files(directory, pattern, files, fsync,
                              None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    commit_files(directory, pattern, written, index, fsync)
    remove_leftovers(directory, pattern, set(names))
    return [os.path.join(directory, name) for name in names]


def save_array_checkpoint(arrays: Dict[str, Any], filename: PathLike, *,
                          max_shard_size: Union[int, str],
                          metadata: Optional[Mapping[str, str]] = None,
                          fsync: bool = False, checksum: Optional[str] = None,
                          align: Optional[int] = None) -> List[str]:
    """`save_checkpoint` of NumPy arrays, each counting for its bytes."""
    entries = []
    for name, array in arrays.items():
        spec = spec_of_array(name, array)
        entries.append(ShardEntry(spec, 0 if spec.data is None else spec.data.nbytes))
    return save_checkpoint(entries, filename, max_shard_size=max_shard_size,
                           metadata=metadata, fsync=fsync, checksum=checksum, align=align)
