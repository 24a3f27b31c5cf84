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

import errno
import json
import os
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import (Any, Callable, Dict, Generic, Hashable, Iterable, Iterator, List, Mapping,
                    NamedTuple, Optional, Sequence, Set, Tuple, Union)

import orjson

from ._core import (DEFAULT_MAX_HEADER_SIZE, SafetensorError, TensorInfo, TensorNotFoundError,
                    WritePlan, WriteSpec, spec_of_array)
from ._files import (TEMP_SUFFIX, AtomicFile, PathLike, fsync_path,
                     write_text_atomically)
from ._handle import (NUMPY_FRAMEWORKS, SHARD_NAME_RULE, Backend, FrameworkHandle, NumpyHandle,
                      framework_converter, is_checkpoint_path, is_plain_shard_name, is_url,
                      open_file, open_remote, stamp)
from ._slicing import Converter, SafeSlice, T
from .integrity import plan_with_checksums

__all__ = ["DEFAULT_PATTERN", "INDEX_SUFFIX", "ShardEntry", "ShardedHandle",
           "NumpyShardedHandle", "CheckpointIndex", "data_bytes", "is_checkpoint_path",
           "open_checkpoint",
           "parse_size", "read_index", "save_checkpoint", "split_into_shards"]

DEFAULT_PATTERN = "model{suffix}.safetensors"
INDEX_SUFFIX = ".index.json"
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
MAX_INDEX_DEPTH = 64   # JSON nesting an index may have; real ones have 3 levels
# Shards from this size up are copied one at a time: the core already shares the copy
# of a file this large among threads, and nesting two pools of threads only slows it.
PARALLEL_BELOW = 64 << 20
# A shard that a re-save replaces keeps, until the new index is in place, a second
# name: NAME-00001-of-0000N.fastst-backup.safetensors (a name an index may give).
BACKUP_INFIX = ".fastst-backup"
# errors of a file system that makes no hard links (or none across these names)
NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
                 errno.ENOSYS}


# ---------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------

class CheckpointIndex(NamedTuple):
    """A parsed, validated ``*.index.json``."""
    path: str                          # the index file
    weight_map: Dict[str, str]         # tensor name -> shard file name, in index order
    shards: Dict[str, List[str]]       # shard file name -> its tensors, in index order
    metadata: Optional[Dict[str, Any]]

    def shard_path(self, shard: str) -> str:
        return os.path.join(os.path.dirname(self.path), shard)


def find_checkpoint(directory: str) -> str:
    """The file to open for the checkpoint in `directory`: its
    ``model.safetensors.index.json``, else its ``model.safetensors``, else its only
    ``*.safetensors.index.json`` or only ``*.safetensors``."""
    for name in (DEFAULT_PATTERN.format(suffix="") + INDEX_SUFFIX,
                 DEFAULT_PATTERN.format(suffix="")):
        if os.path.isfile(os.path.join(directory, name)):
            return os.path.join(directory, name)
    names = sorted(os.listdir(directory))
    for ending in (".safetensors" + INDEX_SUFFIX, ".safetensors"):
        found = [name for name in names if name.endswith(ending)]
        if len(found) == 1:
            return os.path.join(directory, found[0])
        if found:
            raise SafetensorError(f"{directory}: several checkpoints ({', '.join(found)}); "
                                  f"open the one wanted by its file name")
    raise SafetensorError(f"{directory}: no model.safetensors.index.json nor any "
                          f".safetensors file in this directory")


def read_index(path: PathLike, *, max_size: int = DEFAULT_MAX_HEADER_SIZE) -> CheckpointIndex:
    """Read and check the index file at `path` (at most `max_size` bytes)."""
    path = os.path.abspath(os.fsdecode(path))
    # O_NONBLOCK: a FIFO under an index's name must not wait for a writer
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise SafetensorError(f"{path}: index is not a regular file")
        if status.st_size > max_size:
            raise SafetensorError(f"{path}: index of {status.st_size} bytes exceeds the "
                                  f"limit of {max_size} bytes")
        text = file.read(max_size + 1)
    return parse_index(text, path)


def parse_index(text: bytes, path: str) -> CheckpointIndex:
    """Check the JSON `text` of the index file `path`: an object whose
    ``weight_map`` maps each tensor name to a ``.safetensors`` file beside the
    index, with an optional ``metadata`` object, and no key twice anywhere."""
    try:
        document = orjson.loads(text)      # bounded nesting: never a RecursionError
    except orjson.JSONDecodeError as error:
        raise SafetensorError(f"{path}: index is not valid JSON: {error}") from None
    if _depth(document) > MAX_INDEX_DEPTH:
        raise SafetensorError(f"{path}: index nests deeper than {MAX_INDEX_DEPTH} levels")
    json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    if not isinstance(document, dict):
        raise SafetensorError(f"{path}: index must be a JSON object, got "
                              f"{type(document).__name__}")
    weight_map = document.get("weight_map")
    if not isinstance(weight_map, dict):
        raise SafetensorError(f"{path}: index has no 'weight_map' object")
    metadata = document.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise SafetensorError(f"{path}: index 'metadata' must be an object, got "
                              f"{type(metadata).__name__}")
    shards: Dict[str, List[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise SafetensorError(f"{path}: tensor {name!r}: shard must be a file name "
                                  f"string, got {type(shard).__name__}")
        shards.setdefault(shard, []).append(name)
    for shard, names in shards.items():
        _check_shard_name(shard, names[0], path)
    return CheckpointIndex(path, weight_map, shards, metadata)


def _depth(document: Any) -> int:
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        deepest = max(deepest, depth)
        if depth <= MAX_INDEX_DEPTH:
            items = value.values() if isinstance(value, dict) else value
            pending.extend((item, depth + 1) for item in items
                           if isinstance(item, (dict, list)))
    return deepest


def _unique_keys(pairs: List[Tuple[str, Any]], path: str) -> Dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: Set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise SafetensorError(f"{path}: index names {key!r} twice in one object")
            seen.add(key)
    return result


def _check_shard_name(shard: str, name: str, path: str) -> None:
    """A shard is a plain ``.safetensors`` file name, in the index's folder, that
    no server decodes into another (see ``is_plain_shard_name``)."""
    if not is_plain_shard_name(shard):
        raise SafetensorError(f"{path}: tensor {name!r}: shard {shard!r} is not "
                              f"{SHARD_NAME_RULE}")


# ---------------------------------------------------------------------------
# Reading: one handle over all shards
# ---------------------------------------------------------------------------

# an open shard: a NumpyHandle, or a FrameworkHandle for a framework's tensors
Shard = Any
# a file's st_dev, st_ino, st_size, st_mtime_ns; or an object's size, ETag, modified time
Stamp = Tuple[Any, ...]


class Opening(NamedTuple):
    """How ``safe_open`` opened a checkpoint: what a pickled handle opens again."""
    index_path: str          # absolute, or a URL
    framework: str
    device: Any
    backend: Backend
    max_header_size: int
    verify: bool
    storage_options: Optional[Dict[str, Any]] = None    # a URL's


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

    def __init__(self, index: CheckpointIndex, open_shard: Callable[[str], Shard],
                 backend: str, opening: Optional[Opening] = None,
                 pickled_stamps: Optional[Dict[str, Stamp]] = None) -> None:
        self._index = index
        self._open_shard = open_shard
        self._backend = backend
        self._opening = opening
        self._opened: Dict[str, Shard] = {}
        self._lock = threading.Lock()
        self._closed = False
        # shards as they were when the handle was pickled, for one unpickled
        self._pickled_stamps = dict(pickled_stamps or {})

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
        path = index.shard_path(shard)
        try:
            handle = self._open_shard(path)
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
        pickled = self._pickled_stamps.get(shard)
        if pickled is not None and tuple(handle.file_identity[1:]) != pickled:
            raise SafetensorError(f"{self._index.path}: shard {shard!r} changed since the "
                                  f"handle was pickled; open the checkpoint again to read it")

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
        """The path of the shard the index puts tensor `name` in (opens nothing)."""
        shard = self._index.weight_map.get(name)
        if shard is None:
            raise TensorNotFoundError(f"{self._index.path}: no tensor named {name!r}")
        return self._index.shard_path(shard)

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
        return self._backend

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
        shards = {shard: self._stamp_of(shard) for shard in self._index.shards}
        stamps = {shard: stamp for shard, stamp in shards.items() if stamp is not None}
        return _reopened_checkpoint, (opening, _stamp(opening.index_path, opening), stamps)

    def _stamp_of(self, shard: str) -> Optional[Stamp]:
        """The shard as this handle reads it: its opened file, or the file on disk
        (None when missing: opening it will say so)."""
        handle = self._opened.get(shard)
        if handle is not None:
            return tuple(handle.file_identity[1:])
        try:
            return _stamp(self._index.shard_path(shard), self._opening)
        except FileNotFoundError:
            return None

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
            with ThreadPoolExecutor(min(len(small), _usable_cpus())) as pool:
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


def _stamp(path: str, opening: Optional[Opening]) -> Stamp:
    """What says a file is unchanged: its stamp, or an object's size, ETag and
    modification time."""
    if is_url(path):
        from .remote import url_identity   # a capability: imported when used

        return url_identity(path, opening.storage_options if opening else None)[1:]
    return stamp(os.stat(path))


def _reopened_checkpoint(opening: Opening, index_stamp: Stamp, shard_stamps: Dict[str, Stamp]
                         ) -> Union[NumpyHandle, FrameworkHandle[Any], ShardedHandle[Any]]:
    """A pickled checkpoint handle, unpickled: the checkpoint opened again as it
    was. An index that changed is refused now; a shard that changed, when it is
    opened."""
    if _stamp(opening.index_path, opening) != tuple(index_stamp):
        raise SafetensorError(f"{opening.index_path}: index changed since the handle was "
                              f"pickled; open the checkpoint again to read it")
    convert = (None if opening.framework in NUMPY_FRAMEWORKS
               else framework_converter(opening.framework, opening.device))
    return open_checkpoint(opening.index_path, convert, backend=opening.backend,
                           max_header_size=opening.max_header_size, verify=opening.verify,
                           opened_as=(opening.framework, opening.device),
                           pickled_stamps=shard_stamps,
                           storage_options=opening.storage_options)



def _copy_of(handle: Shard) -> Dict[str, Any]:
    copies: Dict[str, Any] = handle.copy_tensors()
    return copies


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def open_checkpoint(path: PathLike, convert: Optional[Converter[Any]] = None, *,
                    backend: Backend = "mmap", max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    verify: bool = False, opened_as: Optional[Tuple[str, Any]] = None,
                    pickled_stamps: Optional[Dict[str, Stamp]] = None,
                    storage_options: Optional[Mapping[str, Any]] = None
                    ) -> Union[NumpyHandle, FrameworkHandle[Any], ShardedHandle[Any]]:
    """Open the checkpoint at `path`, a directory or an ``*.index.json``, as one
    handle (see ``ShardedHandle``), its tensors passed through `convert` (a
    framework's converter) or NumPy arrays when it is None. A directory holding
    one unsharded file (``model.safetensors``) gives that file's handle. With
    `verify`, each shard must hold checksums, and each tensor's is checked on its
    first read (see ``fastst.integrity``). `opened_as`, the (framework, device)
    `convert` is for, lets the handle pickle; `pickled_stamps`, the shards'
    identities when it was pickled, makes it refuse shards that changed since.

    `path` may be the URL of an ``*.index.json`` (with `storage_options`): the
    shards beside it are then read by byte ranges (see ``fastst.remote``)."""
    if is_url(path):
        return _open_url_checkpoint(path, convert, max_header_size=max_header_size,
                                    verify=verify, opened_as=opened_as,
                                    pickled_stamps=pickled_stamps,
                                    storage_options=storage_options)
    text = os.fsdecode(path)
    target = find_checkpoint(text) if os.path.isdir(text) else text
    if not target.endswith(INDEX_SUFFIX):
        return open_file(target, convert, backend=backend, max_header_size=max_header_size,
                         verify=verify, opened_as=opened_as)
    index = read_index(target, max_size=max_header_size)
    opening = None if opened_as is None else Opening(
        os.path.abspath(target), *opened_as, backend, max_header_size, verify)

    def open_shard(shard: str) -> Shard:
        return open_file(shard, convert, backend=backend, max_header_size=max_header_size,
                         verify=verify)

    if convert is None:
        return NumpyShardedHandle(index, open_shard, backend, opening, pickled_stamps)
    return ShardedHandle(index, open_shard, backend, opening, pickled_stamps)


def _open_url_checkpoint(url: str, convert: Optional[Converter[Any]], *, max_header_size: int,
                         verify: bool, opened_as: Optional[Tuple[str, Any]],
                         pickled_stamps: Optional[Dict[str, Stamp]],
                         storage_options: Optional[Mapping[str, Any]]) -> ShardedHandle[Any]:
    """The checkpoint whose index is at `url`, its shards the URLs beside it."""
    from .remote import read_object   # a capability: imported when used

    options = dict(storage_options) if storage_options else None
    index = parse_index(read_object(url, options, max_header_size, "index"), url)
    opening = None if opened_as is None else Opening(
        url, *opened_as, "ranges", max_header_size, verify, options)

    def open_shard(shard: str) -> Shard:
        return open_remote(shard, convert, max_header_size=max_header_size, verify=verify,
                           storage_options=options)

    if convert is None:
        return NumpyShardedHandle(index, open_shard, "ranges", opening, pickled_stamps)
    return ShardedHandle(index, open_shard, "ranges", opening, pickled_stamps)


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
    never a mix, even when the save is killed (see ``_put_in_place``; on a file
    system without hard links, a save killed while it sets old shards aside
    leaves a checkpoint that refuses to open, naming a missing shard). The files
    of the old save, and what a killed save left, are removed after. The files
    are entries of the directory: a symlink among them is replaced, not written
    through. Each keeps the permission bits of the file it replaces, or of the
    checkpoint's index (or single file) when it replaces none.
    """
    directory, pattern = _save_place(filename)
    shards, total = split_into_shards(entries, parse_size(max_shard_size))
    by_name = {entry.spec.name: entry.spec for entry in entries}
    if len(shards) <= 1:
        single = {**(shard_metadata or {}), **(metadata or {})}
        files = {pattern.format(suffix=""): plan_with_checksums(
            [by_name[name] for name in (shards[0] if shards else [])], single or None,
            checksum)}
    else:
        count = len(shards)
        files = {pattern.format(suffix=f"-{number:05d}-of-{count:05d}"):
                 plan_with_checksums([by_name[name] for name in shard], shard_metadata,
                                     checksum)
                 for number, shard in enumerate(shards, 1)}
    names = list(files)
    index_text = None
    if len(shards) > 1:
        weight_map = {name: shard_name for shard_name, shard in zip(names, shards)
                      for name in shard}
        index = {"metadata": {"total_size": total, **(metadata or {})},
                 "weight_map": weight_map}
        index_text = json.dumps(index, indent=2)
        names.append(pattern.format(suffix="") + INDEX_SUFFIX)
    # every plan is checked before the first file is written
    written = _written_files(directory, pattern, files, fsync)
    try:
        _put_in_place(directory, pattern, written, index_text, fsync)
    except BaseException:
        for file in written:
            file.abort()
        raise
    _remove_leftovers(directory, pattern, set(names))
    return [os.path.join(directory, name) for name in names]


def save_array_checkpoint(arrays: Dict[str, Any], filename: PathLike, *,
                          max_shard_size: Union[int, str],
                          metadata: Optional[Mapping[str, str]] = None,
                          fsync: bool = False, checksum: Optional[str] = None) -> List[str]:
    """`save_checkpoint` of NumPy arrays, each counting for its bytes."""
    entries = []
    for name, array in arrays.items():
        spec = spec_of_array(name, array)
        entries.append(ShardEntry(spec, 0 if spec.source is None else spec.source.nbytes))
    return save_checkpoint(entries, filename, max_shard_size=max_shard_size,
                           metadata=metadata, fsync=fsync, checksum=checksum)


def _save_place(filename: PathLike) -> Tuple[str, str]:
    """(directory, file name pattern with ``{suffix}``) for a save to `filename`."""
    text = os.fsdecode(filename)
    if text.endswith(".safetensors") and not os.path.isdir(text):
        directory, base = os.path.split(text)
        pattern = base[:-len(".safetensors")].replace("{", "{{").replace("}", "}}")
        pattern += "{suffix}.safetensors"
    else:
        directory, pattern = text, DEFAULT_PATTERN
    shard = pattern.format(suffix="-00001-of-00002")
    if not is_plain_shard_name(shard):
        raise SafetensorError(f"{text}: its shards would be named like {shard!r}, which is "
                              f"not {SHARD_NAME_RULE}: no index could name them")
    os.makedirs(directory or ".", exist_ok=True)
    return directory, pattern


def _written_files(directory: str, pattern: str, files: Mapping[str, WritePlan],
                   fsync: bool) -> List[AtomicFile]:
    """Each plan written under a temporary name beside its file (flushed to disk
    with `fsync`) and closed, to be committed: nothing in place is touched yet."""
    index_path, single_path = _checkpoint_paths(directory, pattern)
    in_place = next((path for path in (index_path, single_path) if os.path.exists(path)), None)
    written: List[AtomicFile] = []
    try:
        for name, plan in files.items():
            file = AtomicFile(os.path.join(directory, name), plan.total_size,
                              follow_symlinks=False, mode_of=in_place)
            written.append(file)
            plan.write_to(file.fd, file.target)
            file.finish(fsync=fsync)
    except BaseException:
        for file in written:
            file.abort()
        raise
    return written


def _put_in_place(directory: str, pattern: str, written: Sequence[AtomicFile],
                  index_text: Optional[str], fsync: bool) -> None:
    """Rename the new files into place, the index last (the commit).

    Where a new file takes the name of a shard that the index in place names
    (as a re-save with as many shards does), that shard first gets a second name
    (``NAME.fastst-backup.safetensors``, a hard link) and the index in place is
    replaced by one that names those backups: the old checkpoint still opens,
    from the same bytes. Then the new files are renamed into place, then the new
    index (a single file: the old index is removed instead, and the directory
    opens the file). With `fsync` the directory is flushed after the backups,
    after the new files and after the index: no rename reaches the disk before
    the ones it depends on.
    """
    index_path, _ = _checkpoint_paths(directory, pattern)
    in_place = _index_in_place(index_path)
    if in_place is not None:
        names = {os.path.basename(file.target) for file in written}
        taken = [shard for shard in in_place.shards if shard in names]
        if taken:
            _back_up(in_place, taken, fsync)
    for file in written:
        file.commit()
    if fsync:
        fsync_path(directory)
    if index_text is not None:
        write_text_atomically(index_text, index_path, fsync=fsync, follow_symlinks=False)
    elif os.path.lexists(index_path):
        os.unlink(index_path)
        if fsync:
            fsync_path(directory)


def _checkpoint_paths(directory: str, pattern: str) -> Tuple[str, str]:
    """The paths of the index and of the single file of a checkpoint saved as
    `pattern` in `directory`."""
    single = os.path.join(directory, pattern.format(suffix=""))
    return single + INDEX_SUFFIX, single


def _index_in_place(index_path: str) -> Optional[CheckpointIndex]:
    """The index at `index_path`, None where there is none that opens (then no
    checkpoint opens from it, and nothing in place needs keeping)."""
    try:
        return read_index(index_path)
    except (FileNotFoundError, SafetensorError):
        return None


def _back_up(in_place: CheckpointIndex, shards: Sequence[str], fsync: bool) -> None:
    """Give each of `shards` (of the index `in_place`) its backup name, and replace
    the index by one that names the backups: the same checkpoint, out of the way
    of the files that take the shards' names."""
    directory = os.path.dirname(in_place.path)
    backups = {shard: _backup_name(shard) for shard in shards}
    for shard, backup in backups.items():
        _keep_aside(os.path.join(directory, shard), os.path.join(directory, backup))
    document: Dict[str, Any] = {} if in_place.metadata is None else {
        "metadata": in_place.metadata}
    document["weight_map"] = {name: backups.get(shard, shard)
                              for name, shard in in_place.weight_map.items()}
    write_text_atomically(json.dumps(document, indent=2), in_place.path, fsync=fsync,
                          follow_symlinks=False)


def _backup_name(shard: str) -> str:
    return shard[:-len(".safetensors")] + BACKUP_INFIX + ".safetensors"


def _keep_aside(path: str, backup: str) -> None:
    """Make `backup` a second name of the file at `path` (a hard link, or of the
    symlink at `path`). Where the file system makes no hard links, `backup`
    becomes its only name (a rename): until the index names `backup`, the
    checkpoint in place lacks that shard, and opening it says so."""
    _remove(backup)     # a killed save's, which no index in place names
    try:
        os.link(path, backup, follow_symlinks=False)
    except FileNotFoundError:
        return          # the checkpoint in place lacks this shard already
    except OSError as error:
        if error.errno not in NO_HARD_LINKS:
            raise
        try:
            os.replace(path, backup)
        except FileNotFoundError:
            return


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_leftovers(directory: str, pattern: str, kept: Iterable[str]) -> None:
    """Remove what an earlier save with `pattern` left that this one did not write:
    the files of the checkpoint it replaced, the backups made to replace it, and
    the temporary files of a save that was killed."""
    prefix, _, suffix = pattern.format(suffix="\0").partition("\0")
    name = (re.escape(prefix) + r"(-\d{5}-of-\d{5})?(" + re.escape(BACKUP_INFIX) + ")?"
            + re.escape(suffix) + "(" + re.escape(INDEX_SUFFIX) + ")?")
    form = re.compile(name)
    temporary = re.compile(r"\." + name + r"\.[0-9a-f]{8}" + re.escape(TEMP_SUFFIX))
    for entry in os.listdir(directory or "."):
        if (form.fullmatch(entry) and entry not in kept) or temporary.fullmatch(entry):
            _remove(os.path.join(directory, entry))
