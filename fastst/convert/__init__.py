"""Safe conversion to safetensors of PyTorch checkpoints and NumPy archives, on a
machine without torch, without running any code the checkpoint holds.

* ``torch_to_safetensors(src, dst)``: a ``torch.save`` file (``.bin``, ``.pt``,
  ``.pth``, zip or legacy format) -> a safetensors file. Its pickle is read by a
  restricted unpickler that knows only the names a state dict needs (and refuses
  any other with a SafetensorError naming it); storages are then read by byte
  range, one tensor at a time, and written in C order, little-endian, with no
  dtype cast. In a state dict, tensors tied to another (same storage and layout)
  are written once, the dropped names recorded in the metadata as ``save_model``
  does; any other nest is written as ``fastst.save_state`` writes a tree.
* ``numpy_to_safetensors(src, dst)``: a ``.npy`` or ``.npz`` file, read without
  pickle.
* ``convert(src, dst)``: either, by the file's contents; a directory converts every
  checkpoint in it (a sharded ``pytorch_model.bin.index.json`` keeps its split).

Each written tensor is read back and compared with the bytes its source gives.
No conversion writes more than ``max_expansion`` (default 8) times the bytes of
its input, plus 16 MiB, unless told to (``max_expansion=None``): a few hundred
bytes of checkpoint can describe a tensor of any size.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from .._core import SafetensorError, WriteSpec
from .._format.index import (CheckpointIndex, commit_files, index_name, index_text, read_index,
                             remove_leftovers, save_place, shard_names, write_files)
from .._format.names import is_index_name
from .._io.files import AtomicFile
from .._io.source import LocalFile
from ..checkpoint import ShardEntry, open_checkpoint, parse_size, split_into_shards
from ._output import (DEFAULT_MAX_EXPANSION, OnPhase, OutputBudget, Reporter, StreamedFile,
                      TensorToWrite, verify_written, write_declared)
from ._torch import (declare, flatten, max_repeated_entries, tied_names,
                     training_checkpoint_note)
from ._torch_files import LEGACY_MAGIC, LOCAL_HEADER, ZIP_ERRORS, open_torch_checkpoint

__all__ = ["ConversionReport", "torch_to_safetensors", "numpy_to_safetensors", "convert",
           "convert_directory", "is_torch_checkpoint", "safetensors_name",
           "DEFAULT_MAX_EXPANSION"]

Progress = Optional[Callable[[int], None]]


@dataclass
class ConversionReport:
    """What one conversion did: files, counts, bytes, tied names dropped, time, and
    notes for whoever runs it (a training checkpoint converted whole: how its
    tensors are named, and the ``key`` of its model's weights)."""
    source: str
    destination: str
    tensors: int = 0
    bytes: int = 0
    dropped: Dict[str, str] = field(default_factory=dict)   # dropped name -> name kept
    seconds: float = 0.0
    verified: bool = False
    files: List[str] = field(default_factory=list)   # written: the shards, then the index
    notes: List[str] = field(default_factory=list)


def torch_to_safetensors(src: Any, dst: Any, *, key: Optional[str] = None,
                         verify: bool = True, verify_torch: bool = False,
                         max_shard_size: Union[int, str, None] = None, fsync: bool = False,
                         progress: Progress = None, on_phase: OnPhase = None,
                         max_expansion: Optional[float] = DEFAULT_MAX_EXPANSION,
                         align: Optional[int] = None) -> ConversionReport:
    """Convert the torch checkpoint `src` to the safetensors file `dst`.

    `key` picks one entry of a nested checkpoint (``"state_dict"``, ``"model"``,
    or a ``/``-separated path); without it a state dict keeps its names, and any
    other nest is written as ``fastst.save_state`` writes one: tensors named by
    their path, the tree and its other leaves in the metadata, so that
    ``fastst.load_state(dst)`` gives the nest back. With
    `verify` (the default) the file is read back and each tensor compared
    with the bytes read again from `src`; with `verify_torch`, also
    with the tensors ``torch.load(src, weights_only=True)`` gives (torch needed).
    With `max_shard_size` (bytes, or "5GB" as the hub writes it) the tensors
    are split, in order, into ``<stem>-00001-of-0000N.safetensors`` files of at
    most that size each (a larger tensor alone in its file), as
    ``fastst.checkpoint`` splits them, and ``<stem>.safetensors.index.json``
    names the file of each tensor. `progress` is called with each number of
    bytes written, then, with `verify`, read back and compared (twice the
    output's bytes in all), and with `verify_torch` compared with torch's;
    `on_phase` with the name of each phase as it begins: "reading" (the
    checkpoint's pickle), "writing" and "verifying" (each file of the output
    in turn), "comparing" (with torch's tensors). A ``tqdm`` bar's ``update``
    and ``set_description`` fit them. With `align` (a power of two), each file's
    data, and as many of its tensors as can, start at multiples of that many
    bytes (see ``fastst.save``).

    The output may hold at most `max_expansion` times the bytes of `src`, plus
    16 MiB (``max_expansion=None``: no bound). A checkpoint stores every byte of
    its tensors, so a real one converts to about its own size; a view with zero
    strides (``torch.zeros(1).expand(10**5, 10**5)``, 40 GB from 1.5 kB) is
    refused, naming the tensor, its shape and strides, before anything is written.
    """
    source = os.fsdecode(src)
    return _torch_file(source, os.fsdecode(dst), OutputBudget.of_files([source], max_expansion),
                       key=key, verify=verify, verify_torch=verify_torch,
                       max_shard_size=max_shard_size, fsync=fsync, progress=progress,
                       on_phase=on_phase, align=align)


def _torch_file(source: str, dst: str, budget: OutputBudget, *, key: Optional[str] = None,
                verify: bool = True, verify_torch: bool = False,
                max_shard_size: Union[int, str, None] = None, fsync: bool = False,
                progress: Progress = None, on_phase: OnPhase = None,
                shard_of: Optional[_ShardedOutput] = None,
                align: Optional[int] = None) -> ConversionReport:
    """`torch_to_safetensors`; with `shard_of`, the file is one shard of that
    output, written and checked beside `dst` but not put in place yet."""
    start = time.perf_counter()
    report = Reporter(progress, on_phase)
    report.phase("reading")
    with open_torch_checkpoint(source) as checkpoint:
        tensors, state_metadata = flatten(
            checkpoint.tree, source, key, max_text=budget.left(),
            max_repeated=max_repeated_entries(checkpoint.pickle_bytes))
        note = None if key is not None else training_checkpoint_note(
            checkpoint.tree, [name for name, _ in tensors], source)
        # a state tree names every tensor it holds: ties are dropped from state dicts only
        dropped = {} if state_metadata else tied_names(tensors)
        declared = [declare(checkpoint, name, ref) for name, ref in tensors
                    if name not in dropped]
        metadata = {"format": "pt", **state_metadata}
        for name, kept in dropped.items():
            metadata.setdefault(name, kept)
        if shard_of is not None:
            budget.spend(source, declared, metadata)
            files = [shard_of.add(os.path.basename(dst), declared, metadata, fsync=fsync,
                                  progress=report, verify=verify, align=align)]
        elif max_shard_size is None:
            budget.spend(source, declared, metadata)
            write_declared(dst, declared, metadata, fsync=fsync, progress=report, align=align)
            if verify:
                verify_written(dst, declared, report)
            files = [dst]
        else:
            parts = _shards(declared, max_shard_size)
            budget.spend(source, declared, metadata, files=len(parts))
            files = _write_sharded(dst, parts, metadata, fsync=fsync, progress=report,
                                   verify=verify, align=align)
    if verify_torch:
        verify_against_torch(source, [file for file in files if not is_index_name(file)], key,
                             report)
    return ConversionReport(source, dst, len(declared), sum(t.nbytes for t in declared),
                            dropped, time.perf_counter() - start, verify or verify_torch, files,
                            [note] if note else [])


def _shards(declared: List[TensorToWrite], max_shard_size: Union[int, str]
            ) -> List[List[TensorToWrite]]:
    """The tensors of each shard, cut as ``fastst.checkpoint`` cuts them (the
    Hugging Face rule)."""
    entries = [ShardEntry(WriteSpec(t.name, t.code, t.shape, None), t.nbytes) for t in declared]
    groups, _ = split_into_shards(entries, parse_size(max_shard_size))
    by_name = {tensor.name: tensor for tensor in declared}
    return [[by_name[name] for name in group] for group in groups] or [[]]


def _write_sharded(dst: str, parts: List[List[TensorToWrite]], metadata: Dict[str, str], *,
                   fsync: bool, progress: Reporter, verify: bool,
                   align: Optional[int] = None) -> List[str]:
    """Write `parts` as the shards of a checkpoint saved as `dst` (one file when
    there is one part), with its index, as ``save_file(..., max_shard_size=...)``
    puts a checkpoint in place: each file checked before any is renamed, the index
    last, a checkpoint there before opening as itself until then, and its
    leftovers removed after. Returns the paths written, the index last."""
    output = _ShardedOutput(*save_place(dst))
    names = shard_names(output.pattern, len(parts))
    try:
        for name, part in zip(names, parts):
            output.add(name, part, metadata, fsync=fsync, progress=progress, verify=verify,
                       align=align)
    except BaseException:
        output.abort()
        raise
    index = None if len(parts) <= 1 else index_text(
        {tensor.name: name for name, part in zip(names, parts) for tensor in part},
        {"total_size": sum(t.nbytes for part in parts for t in part)})
    return output.commit(index, fsync)


class _ShardedOutput:
    """The files of a sharded checkpoint being converted, saved as `pattern` in
    `directory`: each written under a temporary name and checked, then all put in
    place together with their index (``fastst._format.index.commit_files``), so that a
    checkpoint there before opens as itself until the new index is in place."""

    def __init__(self, directory: str, pattern: str) -> None:
        self.directory, self.pattern = directory, pattern
        self.written: List[AtomicFile] = []

    def add(self, name: str, tensors: List[TensorToWrite], metadata: Optional[Dict[str, str]],
            *, fsync: bool, progress: Reporter, verify: bool,
            align: Optional[int] = None) -> str:
        """Write file `name` (read back and compared with its source, with `verify`)."""
        (file,) = write_files(self.directory, self.pattern,
                              {name: StreamedFile(tensors, metadata, progress, align)}, fsync)
        self.written.append(file)
        if verify:
            verify_written(file.temp, tensors, progress, label=file.target)
        return file.target

    def commit(self, index: Optional[str], fsync: bool) -> List[str]:
        """Put the files in place, the index (its text) last; remove what an
        earlier save left. The paths written, the index last."""
        commit_files(self.directory, self.pattern, self.written, index, fsync)
        names = [os.path.basename(file.target) for file in self.written]
        if index is not None:
            names.append(index_name(self.pattern))
        remove_leftovers(self.directory, self.pattern, set(names))
        return [os.path.join(self.directory, name) for name in names]

    def abort(self) -> None:
        for file in self.written:
            file.abort()


def verify_against_torch(src: str, files: List[str], key: Optional[str],
                         progress: Reporter) -> None:
    """Compare every tensor of `files` with what ``torch.load(src,
    weights_only=True)`` gives for it, byte for byte."""
    import torch     # only here: the conversion itself never imports torch

    progress.phase("comparing")
    tree = torch.load(src, map_location="cpu", weights_only=True)
    expected = dict(flatten(tree, src, key, tensor_type=torch.Tensor)[0])
    for filename in files:
        # the bytes are compared: bfloat16 and float8 come as their bits, without ml_dtypes
        with open_checkpoint(filename, backend="pread", uses_ml_dtypes=False) as reader, \
                reader.iter_tensors() as read:
            for name, array in read:    # the next tensors are read while this one is compared
                tensor = expected[name].detach().contiguous().reshape(-1)
                reference = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
                got = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                if got.tobytes() != bytes(reference):
                    raise SafetensorError(f"{filename}: tensor {name!r} differs from what "
                                          f"torch.load gives for {src}")
                progress(got.size)


def numpy_to_safetensors(src: Any, dst: Any, *, verify: bool = True, fsync: bool = False,
                         progress: Progress = None, on_phase: OnPhase = None,
                         max_expansion: Optional[float] = DEFAULT_MAX_EXPANSION,
                         align: Optional[int] = None) -> ConversionReport:
    """Convert a ``.npy`` file (one tensor, named ``"array"``) or an ``.npz``
    file (its arrays, by their names) to `dst`. Nothing is unpickled: object
    arrays are refused. Arrays are read and written a chunk at a time (but for
    Fortran-ordered arrays in an ``.npz``, read whole). The output may hold at
    most `max_expansion` times the bytes of `src`, plus 16 MiB (None: no bound):
    a compressed ``.npz`` of zeros, 1 MB for 1 GB, is refused before anything is
    written. `progress`, `on_phase` and `align`: as for ``torch_to_safetensors``."""
    source = os.fsdecode(src)
    return _numpy_file(source, os.fsdecode(dst), OutputBudget.of_files([source], max_expansion),
                       verify=verify, fsync=fsync, progress=progress, on_phase=on_phase,
                       align=align)


def _numpy_file(source: str, dst: str, budget: OutputBudget, *, verify: bool = True,
                fsync: bool = False, progress: Progress = None, on_phase: OnPhase = None,
                align: Optional[int] = None) -> ConversionReport:
    from ._npz import declared_arrays
    start = time.perf_counter()
    report = Reporter(progress, on_phase)
    report.phase("reading")
    with declared_arrays(source) as declared:
        budget.spend(source, declared, None)
        write_declared(dst, declared, None, fsync=fsync, progress=report, align=align)
        if verify:
            verify_written(dst, declared, report)
    return ConversionReport(source, dst, len(declared), sum(t.nbytes for t in declared), {},
                            time.perf_counter() - start, verify, [dst])


NUMPY_MAGIC = b"\x93NUMPY"


def is_numpy_file(path: str) -> bool:
    """A ``.npy`` file, or a zip of ``.npy`` members (``.npz``)."""
    with open(path, "rb") as fh:
        head = fh.read(6)
    if head == NUMPY_MAGIC:
        return True
    if head[:4] != b"PK\x03\x04":
        return False
    import zipfile
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except ZIP_ERRORS:
        return False
    return bool(names) and all(name.endswith(".npy") for name in names)


def is_torch_checkpoint(path: str) -> bool:
    """Whether `path` looks like a ``torch.save`` file (by its first bytes)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    return head[:4] == b"PK\x03\x04" and not is_numpy_file(path) or head[:1] == b"\x80"


LEGACY_TORCH_START = b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little")  # the magic, pickled
CONVERTIBLE_HEAD_BYTES = LOCAL_HEADER.size + 256


def convertible_kind(head: bytes) -> Optional[str]:
    """What ``fastst convert`` takes a file that begins with `head` (its first
    CONVERTIBLE_HEAD_BYTES) for: "a PyTorch checkpoint (torch.save)", "a NumPy .npz
    archive" or "a NumPy .npy file"; None for another file. A zip archive is told by
    the name of its first member (``<name>/data.pkl`` as torch writes it, ``*.npy``
    as NumPy does), a legacy torch file by the magic number it pickles first."""
    if head.startswith(NUMPY_MAGIC):
        return "a NumPy .npy file"
    if head.startswith(LEGACY_TORCH_START):
        return "a PyTorch checkpoint (torch.save)"
    if len(head) < LOCAL_HEADER.size:
        return None
    signature, name_length, _ = LOCAL_HEADER.unpack_from(head)
    first = head[LOCAL_HEADER.size:LOCAL_HEADER.size + name_length]
    if signature != b"PK\x03\x04" or len(first) != name_length:
        return None
    if first.endswith(b"/data.pkl"):
        return "a PyTorch checkpoint (torch.save)"
    return "a NumPy .npz archive" if first.endswith(b".npy") else None


def convert(src: Any, dst: Any = None, **options: Any) -> List[ConversionReport]:
    """Convert a file or a directory (see ``convert_directory``); a file's kind
    (torch or NumPy) is told by its contents. `dst` defaults to `src` with the
    ``.safetensors`` suffix (``pytorch_model.bin`` -> ``model.safetensors``).
    `options` are those of ``torch_to_safetensors`` (``max_expansion`` and ``align``
    included; ``key``, ``verify_torch`` and ``max_shard_size`` do not apply to NumPy
    files). A safetensors file is refused (SafetensorError): there is nothing to convert."""
    source = os.fsdecode(src)
    if os.path.isdir(source):
        return convert_directory(source, dst, **options)
    if is_safetensors_file(source):
        raise SafetensorError(f"{source}: already a safetensors file, nothing to convert "
                              f"(`fastst verify` checks it, `fastst inspect` lists it)")
    target = os.fsdecode(dst) if dst is not None else os.path.join(
        os.path.dirname(source), safetensors_name(os.path.basename(source)))
    if os.path.isdir(target):
        target = os.path.join(target, safetensors_name(os.path.basename(source)))
    budget = OutputBudget.of_files([source], options.pop("max_expansion",
                                                         DEFAULT_MAX_EXPANSION))
    return [_convert_file(source, target, budget, options)]


def _convert_file(source: str, target: str, budget: OutputBudget, options: Dict[str, Any]
                  ) -> ConversionReport:
    if is_numpy_file(source):
        options = dict(options)
        if options.pop("max_shard_size", None) is not None:
            raise SafetensorError(f"{source}: a .npy/.npz file is converted to one file; "
                                  f"--max-shard-size is for torch checkpoints")
        options.pop("key", None)
        options.pop("verify_torch", None)   # no torch.load to compare with
        return _numpy_file(source, target, budget, **options)
    return _torch_file(source, target, budget, **options)


def is_safetensors_file(path: str) -> bool:
    """Whether `path` begins as a safetensors file does: the little-endian length
    of a JSON header that fits in the file, then ``{``."""
    with open(path, "rb") as fh:
        head = fh.read(9)
        size = os.fstat(fh.fileno()).st_size
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") <= size - 8


def safetensors_name(name: str) -> str:
    """The safetensors file name for checkpoint `name`, as the hub names them:
    ``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``."""
    stem, _ = os.path.splitext(name)
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model"):]
    return stem + ".safetensors"


CHECKPOINT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy")
INDEX_SUFFIX = ".bin.index.json"
SAFETENSORS_INDEX = ".safetensors.index.json"
MAX_INDEX_BYTES = 100_000_000    # the largest index read, as safe_open reads one


def convert_directory(src: str, dst: Optional[str] = None, **options: Any
                      ) -> List[ConversionReport]:
    """Convert every checkpoint file in directory `src` into `dst` (default:
    `src` itself); other files (``config.json``, tokenizers) are copied when `dst`
    is another directory. A ``*.bin.index.json`` becomes a
    ``*.safetensors.index.json`` naming the converted shards. `options` are those
    of ``convert``; the output of all the checkpoints together may hold at most
    `max_expansion` times their bytes, plus 16 MiB. A folder without a
    checkpoint (empty, or already converted) is refused with a SafetensorError
    before anything is written.

    A symbolic link in `src` counts as the file it points to when that file lies
    in `src` (or, for a snapshot of the Hugging Face cache,
    ``.../snapshots/<revision>``, in the cache's ``.../blobs``): it is converted
    or copied as a regular file under the link's name. A link that leads out of
    the folder is refused before anything is written: converting a folder must
    not copy files from elsewhere (``tokenizer.json -> ~/.ssh/id_ed25519``) into
    its output."""
    source = os.fsdecode(src)
    target = source if dst is None else os.fsdecode(dst)
    files = folder_files(source)
    paths = dict(files)
    indexes = [(path, name, read_index(LocalFile(path), max_size=MAX_INDEX_BYTES,
                                       shard_suffix=".bin"))
               for name, path in files if name.endswith(INDEX_SUFFIX)]
    in_shards = {shard for _, _, index in indexes for shard in index.shards}
    checkpoints = [(path, name) for name, path in files if not name.endswith(INDEX_SUFFIX)
                   and name.endswith(CHECKPOINT_SUFFIXES) and name not in in_shards
                   and (is_torch_checkpoint(path) or is_numpy_file(path))]
    if not checkpoints and not indexes:
        raise SafetensorError(_nothing_to_convert(source, files))
    converted = {name for _, name in checkpoints} | in_shards | {name for _, name, _ in indexes}
    budget = OutputBudget.of_files(
        [path for path, _ in checkpoints] + [paths[shard] for shard in in_shards
                                             if shard in paths],
        options.pop("max_expansion", DEFAULT_MAX_EXPANSION))
    os.makedirs(target, exist_ok=True)
    copy = not os.path.samefile(source, target)
    reports: List[ConversionReport] = []
    for path, name in checkpoints:
        reports.append(_convert_file(path, os.path.join(target, safetensors_name(name)),
                                     budget, options))
    for path, name, index in indexes:
        reports += _convert_sharded(path, index, paths, os.path.join(
            target, name[:-len(INDEX_SUFFIX)].replace("pytorch_model", "model")
            + ".safetensors.index.json"), budget, options)
    for name, path in files:
        if copy and name not in converted:
            shutil.copy2(path, os.path.join(target, name))
    return reports


def _nothing_to_convert(folder: str, files: List[Tuple[str, str]]) -> str:
    found = sum(name.endswith(".safetensors") for name, _ in files)
    return (f"{folder}: nothing to convert: no torch checkpoint (.bin, .pt, .pth, .ckpt) "
            f"and no .npy/.npz file in this folder"
            + (f"; it holds {found} .safetensors file(s) already" if found else ""))


def _convert_sharded(path: str, index: CheckpointIndex, paths: Dict[str, str], target: str,
                     budget: OutputBudget, options: Dict[str, Any]) -> List[ConversionReport]:
    """Convert the shards a PyTorch checkpoint's index (`index`, read from `path`)
    names, and write the index of the converted checkpoint at `target`: the files
    put in place together, as a sharded save puts them (see ``_ShardedOutput``).
    Names written once as tied weights are left out of the weight map."""
    missing = [shard for shard in index.shards if shard not in paths]
    if missing:
        raise SafetensorError(f"{path}: shard {missing[0]!r} is not in the folder")
    stem = os.path.basename(target)[:-len(SAFETENSORS_INDEX)]
    output = _ShardedOutput(os.path.dirname(target), stem + "{suffix}.safetensors")
    options = {name: value for name, value in options.items() if name != "max_shard_size"}
    reports = []
    try:
        for shard in index.shards:
            reports.append(_torch_file(paths[shard], os.path.join(
                output.directory, safetensors_name(shard)), budget, shard_of=output, **options))
    except BaseException:
        output.abort()
        raise
    dropped = {name for report in reports for name in report.dropped}
    text = index_text({name: safetensors_name(shard) for name, shard in index.weight_map.items()
                       if name not in dropped}, index.metadata or {})
    output.commit(text, options.get("fsync", False))
    return reports


def folder_files(folder: str) -> List[Tuple[str, str]]:
    """The regular files of `folder`, as (name, path to read), in name order: a
    symbolic link by the path of the file it points to, which must lie in the
    folder (or in the blobs of the Hugging Face cache, for one of its
    snapshots). Subfolders, and links to them, are left out."""
    roots = _roots(folder)
    files = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.islink(path):
            resolved = os.path.realpath(path)
            if not any(os.path.commonpath([root, resolved]) == root for root in roots):
                raise SafetensorError(
                    f"{path}: a symbolic link to {resolved}, outside {folder}: refused "
                    f"(a folder's conversion reads only its own files; copy that file in to "
                    f"convert it)")
            path = resolved
        if os.path.isfile(path):
            files.append((name, path))
    return files


def _roots(folder: str) -> List[str]:
    """Where the links of `folder` may lead: the folder, and for a snapshot of the
    Hugging Face cache (``models--org--name/snapshots/<revision>``, whose files
    are links to ``../../blobs/<hash>``) the cache's blobs of the same model."""
    root = os.path.realpath(folder)
    roots = [root]
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        roots.append(os.path.join(os.path.dirname(parent), "blobs"))
    return roots
