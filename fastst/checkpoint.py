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
"""
from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import (Any, Callable, Dict, Generic, Hashable, Iterator, List, Mapping, NamedTuple,
                    Optional, Sequence, Tuple, Union)

from ._adapters import NUMPY_FRAMEWORKS, converter as framework_converter
from ._checksums import plan_with_checksums
from ._core import (DEFAULT_MAX_HEADER_SIZE, SafetensorError, TensorInfo, TensorNotFoundError,
                    WriteSpec, spec_of_array, usable_cpus)
from ._files import PathLike
from ._handle import FrameworkHandle, NumpyHandle, open_handle
from ._index import (DEFAULT_PATTERN, INDEX_SUFFIX, CheckpointIndex, commit_files,
                     find_checkpoint, is_checkpoint, index_name, index_text, is_index_name, read_index, remove_leftovers, save_place, shard_names, write_files)
from ._slicing import Converter, SafeSlice, T
from ._source import Identity, LocalFile, Source, as_source, identity_of

__all__ = ["DEFAULT_PATTERN", "INDEX_SUFFIX", "ShardEntry", "ShardedHandle",
           "NumpyShardedHandle", "CheckpointIndex", "data_bytes", "is_checkpoint",
           "is_checkpoint_path", "open_checkpoint", "parse_size", "read_index",
           "save_checkpoint", "split_into_shards"]

SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
# Shards from this size up are copied one at a time: the core already shares the copy
# of a file this large among threads, and nesting two pools of threads only slows it.
PARALLEL_BELOW = 64 << 20


def is_checkpoint_path(filename: Any) -> bool:
    """Whether `filename` (a path or a URL) names a sharded checkpoint: a directory
    or an ``*.index.json``, or the URL of an index."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    return is_checkpoint(as_source(filename))


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
        against the index, before any is returned."""
        return [handle for _, handle in self._all_shards()]

    def _all_shards(self) -> List[Tuple[str, Shard]]:
        return [(shard, self._shard(shard, names[0]))
                for shard, names in self._index.shards.items()]

    def _check_open(self) -> None:
        if self._closed:
            raise SafetensorError(f"{self._index.path}: the checkpoint is closed")

    # -- reading ---------------------------------------------------------------

    def get_tensor(self, name: str) -> T:
        """The tensor `name`, from its shard."""
        tensor: T = self._shard_of(name).get_tensor(name)
        return tensor

    def __getitem__(self, name: str) -> T:
        return self.get_tensor(name)

    def get_tensors(self) -> Dict[str, T]:
        """Every tensor: shard by shard in index order, each in buffer order."""
        tensors: Dict[str, T] = {}
        for _, handle in self._all_shards():
            tensors.update(handle.get_tensors())
        return tensors

    def gather(self, name: str, rows: Any) -> T:
        """Rows `rows` of tensor `name`'s first axis, from its shard (see
        ``NumpyHandle.gather``)."""
        tensor: T = self._shard_of(name).gather(name, rows)
        return tensor

    def get_slice(self, name: str) -> SafeSlice[T]:
        """A lazy handle on tensor `name` (see ``SafeSlice``)."""
        part: SafeSlice[T] = self._shard_of(name).get_slice(name)
        return part

    def info(self, name: str) -> TensorInfo:
        """What the header of its shard says of tensor `name`."""
        info: TensorInfo = self._shard_of(name).info(name)
        return info

    def shard_file(self, name: str) -> str:
        """The path (or URL) of the shard the index puts tensor `name` in (opens
        nothing)."""
        return self.shard_source(name).label

    def shard_source(self, name: str) -> Source:
        """Where the shard the index puts tensor `name` in is (opens nothing)."""
        shard = self._index.weight_map.get(name)
        if shard is None:
            raise TensorNotFoundError(f"{self._index.path}: no tensor named {name!r}")
        return self._source.sibling(shard)

    def keys(self) -> List[str]:
        """Tensor names, sorted (from the index: opens no shard)."""
        self._check_open()
        return sorted(self._index.weight_map)

    def offset_keys(self) -> List[str]:
        """Tensor names shard by shard, each shard's in buffer order (opens every shard)."""
        return [name for _, handle in self._all_shards() for name in handle.offset_keys()]

    def metadata(self) -> Optional[Dict[str, Any]]:
        """The index's ``metadata`` object (e.g. ``{"total_size": ...}``), or None."""
        self._check_open()
        return None if self._index.metadata is None else dict(self._index.metadata)

    @property
    def index(self) -> CheckpointIndex:
        return self._index

    @property
    def source(self) -> str:
        return self._index.path

    @property
    def backend(self) -> str:
        return self._source.backend

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every shard opened; the handle cannot be used afterwards."""
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
            raise SafetensorError(f"{self._index.path}: only a checkpoint from safe_open can "
                                  f"be pickled")
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
    methods of ``NumpyHandle`` too."""

    def get_tensor(self, name: str, *, out: Any = None) -> Any:
        return self._shard_of(name).get_tensor(name, out=out)

    def __enter__(self) -> NumpyShardedHandle:
        return self

    def copy_tensors(self) -> Dict[str, Any]:
        """Every tensor read into fresh memory, shard by shard in index order.

        A large shard's copy shares its work among threads itself: those are read
        one after another. Smaller shards are read by a pool of threads, one shard
        each, so that a checkpoint of many small shards keeps the throughput of
        one file.
        """
        shards = self._all_shards()
        small = [handle for shard, handle in shards if data_bytes(handle) < PARALLEL_BELOW]
        parts: Dict[int, Dict[str, Any]] = {}
        if len(small) > 1:
            with ThreadPoolExecutor(min(len(small), usable_cpus())) as pool:
                parts = dict(zip(map(id, small), pool.map(_copy_of, small)))
        tensors: Dict[str, Any] = {}
        for _, handle in shards:
            part = parts.get(id(handle))
            tensors.update(part if part is not None else handle.copy_tensors())
        return tensors

    def read_into(self, arrays: Dict[str, Any]) -> None:
        """Read the named tensors into caller-supplied arrays (see ``NumpyHandle``)."""
        by_shard: Dict[int, Tuple[Shard, Dict[str, Any]]] = {}
        for name, array in arrays.items():
            handle = self._shard_of(name)
            by_shard.setdefault(id(handle), (handle, {}))[1][name] = array
        for handle, part in by_shard.values():
            handle.read_into(part)

    def read_rows(self, name: str, first: int, last: int) -> Any:
        return self._shard_of(name).read_rows(name, first, last)

    def gather_rows(self, name: str, rows: Any) -> Any:
        return self._shard_of(name).gather_rows(name, rows)

    def gather(self, name: str, rows: Any, out: Any = None) -> Any:
        """Rows `rows` of tensor `name`'s first axis, into `out` when given (see
        ``NumpyHandle.gather``)."""
        return self._shard_of(name).gather(name, rows, out)


def data_bytes(handle: Shard) -> int:
    """The bytes of a file's tensors: where its last tensor in buffer order ends (its
    data start plus this is the file's size: tensors cover the buffer exactly)."""
    names = handle.offset_keys()
    return handle.info(names[-1]).data_offsets[1] if names else 0


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
                           shards_seen=shards_seen)


def _copy_of(handle: Shard) -> Dict[str, Any]:
    copies: Dict[str, Any] = handle.copy_tensors()
    return copies


def open_checkpoint(target: Any, convert: Optional[Converter[Any]] = None, *,
                    backend: str = "mmap", max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    verify: bool = False, opened_as: Optional[Tuple[str, Any]] = None,
                    shards_seen: Optional[Dict[str, Identity]] = None,
                    storage_options: Optional[Mapping[str, Any]] = None
                    ) -> Union[NumpyHandle, FrameworkHandle[Any], ShardedHandle[Any]]:
    """Open the checkpoint at `target` (a Source, or a path or URL with `backend` or
    `storage_options`), a directory or an ``*.index.json``, as one handle (see ``ShardedHandle``), its tensors passed through
    `convert` (a framework's converter) or NumPy arrays when it is None. A
    directory holding one unsharded file (``model.safetensors``) gives that file's
    handle. With `verify`, each shard must hold checksums, and each tensor's is
    checked on its first read (see ``fastst.integrity``). `opened_as`, the
    (framework, device) `convert` is for, lets the handle pickle; `shards_seen`,
    the shards' identities when it was pickled, makes it refuse shards that
    changed since. The shards are the files (or objects) beside the index."""
    source = as_source(target, storage_options, backend=backend)
    if source.is_directory():
        source = LocalFile(find_checkpoint(source.label), source.backend)
    if not is_index_name(source.name):
        return open_handle(source, convert, max_header_size=max_header_size, verify=verify,
                           opened_as=opened_as)
    index = read_index(source, max_size=max_header_size)
    opening = None if opened_as is None else Opening(source, *opened_as, max_header_size,
                                                     verify)

    def open_shard(shard: Source) -> Shard:
        return open_handle(shard, convert, max_header_size=max_header_size, verify=verify)

    kind = NumpyShardedHandle if convert is None else ShardedHandle
    return kind(index, source, open_shard, opening, shards_seen)


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

class ShardEntry(NamedTuple):
    """One tensor to write into a sharded checkpoint."""
    spec: WriteSpec
    size: int                   # the bytes it counts for against max_shard_size
    storage: Optional[Hashable] = None   # tensors of one storage go into one shard


def parse_size(size: Union[int, str]) -> int:
    """A shard size limit in bytes: an int, or a decimal size as the Hugging Face
    tools write it (``"5GB"`` is 5 * 10**9; units KB, MB, GB, TB)."""
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
    """Tensor names grouped into shards, and the total size counted.

    Greedy, in the order of `entries`: a tensor goes into the current shard
    unless it would take it past `max_shard_size`, which then is closed. A tensor
    larger than the limit gets a shard of its own at once (the current shard
    stays open after it). A tensor sharing its storage with an earlier one counts
    for nothing and joins that one's shard, at its end.
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
                    fsync: bool = False, checksum: Optional[str] = None) -> List[str]:
    """Write `entries` as a checkpoint cut into shards of at most `max_shard_size`
    bytes; returns the paths of the files written, the index last.

    `filename` is the directory to save into (created if need be; the files are
    ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``), or
    the path the checkpoint would have as one file, ``DIR/NAME.safetensors``, for
    ``DIR/NAME-00001-of-0000N.safetensors`` and ``DIR/NAME.safetensors.index.json``.
    When everything fits in one shard, that one file is written, as
    ``model.safetensors`` (or ``NAME.safetensors``), and no index.

    Each shard holds `shard_metadata`; the index's ``metadata`` is
    ``{"total_size": ...}`` followed by `metadata`. A single file holds both
    dicts merged. With `checksum` (see ``fastst.integrity``) each file holds the
    checksums of its own tensors.

    A save replaces the checkpoint in that place as one file is replaced: until
    the new index is in place the old checkpoint opens, after it the new one,
    never a mix, even when the save is killed (see ``fastst._index.commit_files``; on a file
    system without hard links, a save killed while it sets old shards aside
    leaves a checkpoint that refuses to open, naming a missing shard). The files
    of the old save, and what a killed save left, are removed after. The files
    are entries of the directory: a symlink among them is replaced, not written
    through. Each keeps the permission bits of the file it replaces, or of the
    checkpoint's index (or single file) when it replaces none.
    """
    directory, pattern = save_place(filename)
    shards, total = split_into_shards(entries, parse_size(max_shard_size))
    by_name = {entry.spec.name: entry.spec for entry in entries}
    names = shard_names(pattern, len(shards))
    if len(shards) <= 1:
        single = {**(shard_metadata or {}), **(metadata or {})}
        files = {names[0]: plan_with_checksums(
            [by_name[name] for name in (shards[0] if shards else [])], single or None,
            checksum)}
    else:
        files = {file: plan_with_checksums([by_name[name] for name in shard], shard_metadata,
                                           checksum)
                 for file, shard in zip(names, shards)}
    index = None
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
        index = index_text(weight_map, {"total_size": total, **(metadata or {})})
        names.append(index_name(pattern))
    # every plan is checked before the first file is written
    commit_files(directory, pattern, write_files(directory, pattern, files, fsync), index, fsync)
    remove_leftovers(directory, pattern, set(names))
    return [os.path.join(directory, name) for name in names]


def save_array_checkpoint(arrays: Dict[str, Any], filename: PathLike, *,
                          max_shard_size: Union[int, str],
                          metadata: Optional[Mapping[str, str]] = None,
                          fsync: bool = False, checksum: Optional[str] = None) -> List[str]:
    """`save_checkpoint` of NumPy arrays, each counting for its bytes."""
    entries = []
    for name, array in arrays.items():
        spec = spec_of_array(name, array)
        entries.append(ShardEntry(spec, 0 if spec.data is None else spec.data.nbytes))
    return save_checkpoint(entries, filename, max_shard_size=max_shard_size,
                           metadata=metadata, fsync=fsync, checksum=checksum)
