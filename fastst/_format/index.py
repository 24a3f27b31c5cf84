"""THE ``*.index.json`` of a sharded checkpoint, in the layout of the Hugging Face
tools: found in a folder, parsed strictly, its shards named, and a checkpoint's
files put in place so that a reader sees the old checkpoint or the new one, never
a mix (``write_files`` then ``commit_files``).

An index is ``{"metadata": {...}, "weight_map": {tensor: shard file name}}``, the
shards ``NAME-00001-of-0000N.safetensors`` files beside it, written as
``huggingface_hub`` writes them, byte for byte.
"""
from __future__ import annotations

import errno
import os
import re
from typing import (Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional,
                    Sequence, Set, Tuple)

from .._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError, WritePlan
from .._io.files import TEMP_SUFFIX, AtomicFile, PathLike, fsync_path, write_text_atomically
from .._io.source import LocalFile, Source
from .names import DEFAULT_PATTERN, INDEX_SUFFIX

__all__ = ["BACKUP_INFIX", "CheckpointIndex", "SHARD_NAME_RULE", "commit_files", "find_checkpoint",
           "index_text", "is_plain_shard_name", "parse_index", "read_index", "remove_leftovers",
           "save_place", "shard_names", "write_files"]

MAX_INDEX_DEPTH = 64   # JSON nesting an index may have; real ones have 3 levels
# What a shard's name may not hold, whatever the scheme: a path separator, '%' (a
# server decodes escapes: '%2e%2e%2f' is '../'), '?' or '#' (they end a URL's path),
# a control character. A pattern, compiled when an index is first read.
NOT_IN_SHARD_NAMES = r"[/\\%?#\x00-\x1f\x7f]"
SHARD_NAME_RULE = ("a .safetensors file name in the index's folder (no '/', '\\', '%', '?', "
                   "'#' or control character, and no leading '.')")
# A shard that a re-save replaces keeps, until the new index is in place, a second
# name: NAME-00001-of-0000N.fastst-backup.safetensors (a name an index may give).
BACKUP_INFIX = ".fastst-backup"
# errors of a file system that makes no hard links (or none across these names)
NO_HARD_LINKS = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
                 errno.ENOSYS}


class CheckpointIndex(NamedTuple):
    """A parsed, validated ``*.index.json``, as `read_index` gives it.

    Attributes
    ----------
    path : str
        The index file, or its URL.
    weight_map : dict of str to str
        Tensor name -> the file name of its shard, in index order.
    shards : dict of str to list of str
        Shard file name -> its tensors, in index order.
    metadata : dict or None
        The index's ``metadata`` object (``{"total_size": ...}``...).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> fastst.save_file({"a": np.zeros(100), "b": np.ones(100)}, folder, max_shard_size=800)
    >>> with fastst.safe_open(folder) as f:
    ...     f.index.shards, f.index.metadata
    ({'model-00001-of-00002.safetensors': ['a'], 'model-00002-of-00002.safetensors': ['b']}, {'total_size': 1600})
    """

    __module__ = "fastst.checkpoint"

    path: str                          # the index file, or its URL
    weight_map: Dict[str, str]         # tensor name -> shard file name, in index order
    shards: Dict[str, List[str]]       # shard file name -> its tensors, in index order
    metadata: Optional[Dict[str, Any]]


# ---------------------------------------------------------------------------
# Finding and reading
# ---------------------------------------------------------------------------

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


def read_index(index: Any, *, max_size: int = DEFAULT_MAX_HEADER_SIZE,
               shard_suffix: str = ".safetensors") -> CheckpointIndex:
    """Read and check a checkpoint's ``*.index.json``.

    The index must be a JSON object whose ``weight_map`` maps each tensor
    name to a ``.safetensors`` file beside the index, with an optional
    ``metadata`` object, no key twice anywhere, and no nesting deeper than 64
    levels: a shard's name can never reach outside the index's folder.

    Parameters
    ----------
    index : str or os.PathLike or Source
        The index's path, or a Source (a URL's).
    max_size : int, default 100,000,000
        The largest index read, in bytes.
    shard_suffix : str, default ".safetensors"
        What each shard's name ends with (``".bin"`` for a PyTorch checkpoint's
        index, which the converter reads by the same rules).

    Returns
    -------
    CheckpointIndex

    Raises
    ------
    FileNotFoundError
        When the index does not exist.
    SafetensorError
        When it is larger than `max_size`, not valid JSON, or breaks a rule
        above (naming the tensor and shard).

    Examples
    --------
    >>> import tempfile, os, json
    >>> from fastst.checkpoint import read_index
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors.index.json")
    >>> with open(path, "w") as file:
    ...     json.dump({"weight_map": {"w": "model-00001-of-00001.safetensors"}}, file)
    >>> read_index(path).shards
    {'model-00001-of-00001.safetensors': ['w']}
    >>> with open(path, "w") as file:
    ...     json.dump({"weight_map": {"w": "../elsewhere.safetensors"}}, file)
    >>> read_index(path)
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorError: ...: tensor 'w': shard '../elsewhere.safetensors' is not ...
    """
    source = index if isinstance(index, Source) else LocalFile(os.path.abspath(
        os.fsdecode(index)))
    return parse_index(source.read_all(max_size, "index"), source.label,
                       shard_suffix=shard_suffix)


def parse_index(text: bytes, path: str, *, shard_suffix: str = ".safetensors"
                ) -> CheckpointIndex:
    """Check the JSON `text` of the index file `path`: an object whose
    ``weight_map`` maps each tensor name to a ``.safetensors`` file beside the
    index, with an optional ``metadata`` object, and no key twice anywhere. (A
    PyTorch checkpoint's index, whose shards end in `shard_suffix` ``".bin"``,
    is read by the same rules.)"""
    import json

    from fastst._json import JSONDecodeError, loads

    try:
        document = loads(text)      # bounded nesting: never a RecursionError
    except JSONDecodeError as error:
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
        if not is_plain_shard_name(shard, shard_suffix):
            raise SafetensorError(f"{path}: tensor {names[0]!r}: shard {shard!r} is not "
                                  f"{SHARD_NAME_RULE.replace('.safetensors', shard_suffix)}")
    return CheckpointIndex(path, weight_map, shards, metadata)


def is_plain_shard_name(name: str, suffix: str = ".safetensors") -> bool:
    """Whether `name`, as an ``*.index.json`` gives a shard, names a ``.safetensors``
    (`suffix`) file in the index's own folder, on disk and behind any URL alike
    (see ``SHARD_NAME_RULE``)."""
    return (name.endswith(suffix) and not name.startswith(".")
            and re.search(NOT_IN_SHARD_NAMES, name) is None)


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


# ---------------------------------------------------------------------------
# Naming and writing
# ---------------------------------------------------------------------------

def save_place(filename: PathLike) -> Tuple[str, str]:
    """(directory, file name pattern with ``{suffix}``) of a checkpoint saved to
    `filename`: a directory (``model{suffix}.safetensors``), or the path it would
    have as one file, ``DIR/NAME.safetensors`` (``NAME{suffix}.safetensors``). The
    directory is made if need be."""
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


def shard_names(pattern: str, count: int) -> List[str]:
    """The file names of `count` shards (one: the single file, unnumbered)."""
    if count <= 1:
        return [pattern.format(suffix="")]
    return [pattern.format(suffix=f"-{number:05d}-of-{count:05d}")
            for number in range(1, count + 1)]


def index_name(pattern: str) -> str:
    return pattern.format(suffix="") + INDEX_SUFFIX


def index_text(weight_map: Mapping[str, str], metadata: Optional[Mapping[str, Any]]) -> str:
    """The text of an index, as ``huggingface_hub`` writes it."""
    import json

    document: Dict[str, Any] = {} if metadata is None else {"metadata": dict(metadata)}
    document["weight_map"] = dict(weight_map)
    return json.dumps(document, indent=2)


def write_files(directory: str, pattern: str, files: Mapping[str, WritePlan],
                fsync: bool, progress: Optional[Callable[[int], Any]] = None
                ) -> List[AtomicFile]:
    """Each plan written under a temporary name beside its file (flushed to disk
    with `fsync`) and closed, to be committed: nothing in place is touched yet.
    `progress` is called with each file's bytes once it is written."""
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
            if progress is not None:
                progress(plan.total_size)
    except BaseException:
        for file in written:
            file.abort()
        raise
    return written


def commit_files(directory: str, pattern: str, written: Sequence[AtomicFile],
                 index: Optional[str], fsync: bool) -> None:
    """Rename the new files into place, the index (its text `index`) last: the
    commit. On failure the files not yet in place are removed.

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
    try:
        _put_in_place(directory, pattern, written, index, fsync)
    except BaseException:
        for file in written:
            file.abort()
        raise


def _put_in_place(directory: str, pattern: str, written: Sequence[AtomicFile],
                  index: Optional[str], fsync: bool) -> None:
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
    if index is not None:
        write_text_atomically(index, index_path, fsync=fsync, follow_symlinks=False)
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
    weight_map = {name: backups.get(shard, shard) for name, shard in in_place.weight_map.items()}
    write_text_atomically(index_text(weight_map, in_place.metadata), in_place.path,
                          fsync=fsync, follow_symlinks=False)


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


def remove_leftovers(directory: str, pattern: str, kept: Iterable[str]) -> None:
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
