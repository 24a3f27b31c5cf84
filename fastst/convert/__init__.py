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

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import numpy as np
import orjson

from .. import SafetensorError, safe_open
from ..checkpoint import ShardEntry, parse_size, split_into_shards
from ..writer import WriteSpec
from ._output import (DEFAULT_MAX_EXPANSION, Declared, OutputBudget, verify_written,
                      write_declared)
from ._torch import declare, flatten, max_repeated_entries, tied_names
from ._torch_files import ZIP_ERRORS, open_checkpoint

__all__ = ["ConversionReport", "torch_to_safetensors", "numpy_to_safetensors", "convert",
           "convert_directory", "is_torch_checkpoint", "safetensors_name",
           "DEFAULT_MAX_EXPANSION"]

Progress = Optional[Callable[[int], None]]


@dataclass
class ConversionReport:
    """What one conversion did: files, counts, bytes, tied names dropped, time."""
    source: str
    destination: str
    tensors: int = 0
    bytes: int = 0
    dropped: Dict[str, str] = field(default_factory=dict)   # dropped name -> name kept
    seconds: float = 0.0
    verified: bool = False
    files: List[str] = field(default_factory=list)   # written: the shards, then the index


def torch_to_safetensors(src: Any, dst: Any, *, key: Optional[str] = None,
                         verify: bool = True, verify_torch: bool = False,
                         max_shard_size: Union[int, str, None] = None, fsync: bool = False,
                         progress: Progress = None,
                         max_expansion: Optional[float] = DEFAULT_MAX_EXPANSION
                         ) -> ConversionReport:
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
    bytes written.

    The output may hold at most `max_expansion` times the bytes of `src`, plus
    16 MiB (``max_expansion=None``: no bound). A checkpoint stores every byte of
    its tensors, so a real one converts to about its own size; a view with zero
    strides (``torch.zeros(1).expand(10**5, 10**5)``, 40 GB from 1.5 kB) is
    refused, naming the tensor, its shape and strides, before anything is written.
    """
    source = os.fsdecode(src)
    return _torch_file(source, os.fsdecode(dst), OutputBudget.of_files([source], max_expansion),
                       key=key, verify=verify, verify_torch=verify_torch,
                       max_shard_size=max_shard_size, fsync=fsync, progress=progress)


def _torch_file(source: str, dst: str, budget: OutputBudget, *, key: Optional[str] = None,
                verify: bool = True, verify_torch: bool = False,
                max_shard_size: Union[int, str, None] = None, fsync: bool = False,
                progress: Progress = None) -> ConversionReport:
    start = time.perf_counter()
    with open_checkpoint(source) as checkpoint:
        tensors, state_metadata = flatten(
            checkpoint.tree, source, key, max_text=budget.left(),
            max_repeated=max_repeated_entries(checkpoint.pickle_bytes))
        if not tensors:
            raise SafetensorError(f"{source}: the checkpoint holds no tensors")
        # a state tree names every tensor it holds: ties are dropped from state dicts only
        dropped = {} if state_metadata else tied_names(tensors)
        declared = [declare(checkpoint, name, ref) for name, ref in tensors
                    if name not in dropped]
        metadata = {"format": "pt", **state_metadata}
        for name, kept in dropped.items():
            metadata.setdefault(name, kept)
        shards = shard_files(dst, declared, max_shard_size)
        budget.spend(source, declared, metadata, files=len(shards))
        for filename, part in shards:
            write_declared(filename, part, metadata, fsync=fsync, progress=progress)
            if verify:
                verify_written(filename, part)
    files = [name for name, _ in shards]
    if len(shards) > 1:
        files.append(write_index(dst, shards))
    if verify_torch:
        verify_against_torch(source, [name for name, _ in shards], key)
    return ConversionReport(source, dst, len(declared), sum(t.nbytes for t in declared),
                            dropped, time.perf_counter() - start, verify or verify_torch, files)


def shard_files(dst: str, declared: List[Declared], max_shard_size: Union[int, str, None]
                ) -> List[Tuple[str, List[Declared]]]:
    """The files to write and the tensors of each: `dst` alone, or shards cut as
    ``fastst.checkpoint`` cuts them (the Hugging Face rule), named
    ``<stem>-00001-of-0000N.safetensors``."""
    if max_shard_size is None:
        return [(dst, declared)]
    entries = [ShardEntry(WriteSpec(t.name, t.code, t.shape, None), t.nbytes) for t in declared]
    groups, _ = split_into_shards(entries, parse_size(max_shard_size))
    if len(groups) <= 1:
        return [(dst, declared)]
    by_name = {tensor.name: tensor for tensor in declared}
    stem = dst[:-len(".safetensors")] if dst.endswith(".safetensors") else dst
    return [(f"{stem}-{k:05d}-of-{len(groups):05d}.safetensors", [by_name[n] for n in group])
            for k, group in enumerate(groups, 1)]


def write_index(dst: str, shards: List[Tuple[str, List[Declared]]]) -> str:
    """Write the ``index.json`` of a sharded checkpoint, as the hub lays it out;
    returns its path."""
    stem = dst[:-len(".safetensors")] if dst.endswith(".safetensors") else dst
    index = {"metadata": {"total_size": sum(t.nbytes for _, part in shards for t in part)},
             "weight_map": {t.name: os.path.basename(filename)
                            for filename, part in shards for t in part}}
    path = stem + ".safetensors.index.json"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2))
    return path


def verify_against_torch(src: str, files: List[str], key: Optional[str]) -> None:
    """Compare every tensor of `files` with what ``torch.load(src,
    weights_only=True)`` gives for it, byte for byte."""
    import torch     # only here: the conversion itself never imports torch

    tree = torch.load(src, map_location="cpu", weights_only=True)
    expected = dict(flatten(tree, src, key, tensor_type=torch.Tensor)[0])
    for filename in files:
        with safe_open(filename, backend="pread") as reader:
            for name in reader.keys():
                tensor = expected[name].detach().contiguous().reshape(-1)
                reference = tensor.view(torch.uint8).numpy() if tensor.numel() else b""
                got = np.ascontiguousarray(reader.get_tensor(name)).reshape(-1).view(np.uint8)
                if got.tobytes() != bytes(reference):
                    raise SafetensorError(f"{filename}: tensor {name!r} differs from what "
                                          f"torch.load gives for {src}")


def numpy_to_safetensors(src: Any, dst: Any, *, verify: bool = True, fsync: bool = False,
                         progress: Progress = None,
                         max_expansion: Optional[float] = DEFAULT_MAX_EXPANSION
                         ) -> ConversionReport:
    """Convert a ``.npy`` file (one tensor, named ``"array"``) or an ``.npz``
    file (its arrays, by their names) to `dst`. Nothing is unpickled: object
    arrays are refused. Arrays are read and written a chunk at a time (but for
    Fortran-ordered arrays in an ``.npz``, read whole). The output may hold at
    most `max_expansion` times the bytes of `src`, plus 16 MiB (None: no bound):
    a compressed ``.npz`` of zeros, 1 MB for 1 GB, is refused before anything is
    written."""
    source = os.fsdecode(src)
    return _numpy_file(source, os.fsdecode(dst), OutputBudget.of_files([source], max_expansion),
                       verify=verify, fsync=fsync, progress=progress)


def _numpy_file(source: str, dst: str, budget: OutputBudget, *, verify: bool = True,
                fsync: bool = False, progress: Progress = None) -> ConversionReport:
    from ._npz import declared_arrays
    start = time.perf_counter()
    with declared_arrays(source) as declared:
        budget.spend(source, declared, None)
        write_declared(dst, declared, None, fsync=fsync, progress=progress)
        if verify:
            verify_written(dst, declared)
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


def convert(src: Any, dst: Any = None, **options: Any) -> List[ConversionReport]:
    """Convert a file or a directory (see ``convert_directory``); a file's kind
    (torch or NumPy) is told by its contents. `dst` defaults to `src` with the
    ``.safetensors`` suffix (``pytorch_model.bin`` -> ``model.safetensors``).
    `options` are those of ``torch_to_safetensors`` (``max_expansion`` included;
    ``key``, ``verify_torch`` and ``max_shard_size`` do not apply to NumPy files)."""
    source = os.fsdecode(src)
    if os.path.isdir(source):
        return convert_directory(source, dst, **options)
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


def safetensors_name(name: str) -> str:
    """The safetensors file name for checkpoint `name`, as the hub names them:
    ``pytorch_model-00001-of-00002.bin`` -> ``model-00001-of-00002.safetensors``."""
    stem, _ = os.path.splitext(name)
    if stem.startswith("pytorch_model"):
        stem = "model" + stem[len("pytorch_model"):]
    return stem + ".safetensors"


CHECKPOINT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".npz", ".npy")
INDEX_SUFFIX = ".bin.index.json"


def convert_directory(src: str, dst: Optional[str] = None, **options: Any
                      ) -> List[ConversionReport]:
    """Convert every checkpoint file in directory `src` into `dst` (default:
    `src` itself); other files (``config.json``, tokenizers) are copied when `dst`
    is another directory. A ``*.bin.index.json`` becomes a
    ``*.safetensors.index.json`` naming the converted shards. `options` are those
    of ``convert``; the output of all the checkpoints together may hold at most
    `max_expansion` times their bytes, plus 16 MiB.

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
    indexes = [(path, name) for name, path in files if name.endswith(INDEX_SUFFIX)]
    checkpoints = [(path, name) for name, path in files if not name.endswith(INDEX_SUFFIX)
                   and name.endswith(CHECKPOINT_SUFFIXES)
                   and (is_torch_checkpoint(path) or is_numpy_file(path))]
    converted = {name for _, name in indexes + checkpoints}
    budget = OutputBudget.of_files([path for path, _ in checkpoints],
                                   options.pop("max_expansion", DEFAULT_MAX_EXPANSION))
    os.makedirs(target, exist_ok=True)
    copy = not os.path.samefile(source, target)
    reports: List[ConversionReport] = []
    for path, name in checkpoints:
        reports.append(_convert_file(path, os.path.join(target, safetensors_name(name)),
                                     budget, options))
    for name, path in files:
        if copy and name not in converted:
            shutil.copy2(path, os.path.join(target, name))
    dropped = {name for report in reports for name in report.dropped}
    for path, name in indexes:
        _convert_index(path, os.path.join(target, name[:-len(INDEX_SUFFIX)].replace(
            "pytorch_model", "model") + ".safetensors.index.json"), dropped)
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


def _convert_index(path: str, target: str, dropped: Set[str]) -> None:
    """The index of a sharded checkpoint, naming the converted shards; names
    written once as tied weights are left out of the weight map."""
    with open(path, "rb") as fh:
        try:
            index = orjson.loads(fh.read())
        except orjson.JSONDecodeError as error:
            raise SafetensorError(f"{path}: not JSON ({error})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            type(k) is str and type(v) is str for k, v in weight_map.items()):
        raise SafetensorError(f"{path}: no weight_map of names to files")
    for shard in set(weight_map.values()):
        if os.path.basename(shard) != shard:
            raise SafetensorError(f"{path}: shard {shard!r} is not a file of the same folder")
    index = {"metadata": index.get("metadata", {}),
             "weight_map": {name: safetensors_name(shard) for name, shard in weight_map.items()
                            if name not in dropped}}
    with open(target, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2))

