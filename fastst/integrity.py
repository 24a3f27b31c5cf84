"""Checking per-tensor checksums (written by the savers' ``checksum=``, see
``fastst._format.checksums`` for the format): ``verify_file`` and ``verify_path`` (what
``fastst verify`` runs) check files, folders and sharded checkpoints and report
what they find; ``safe_open(..., verify=True)`` checks each tensor on its first read
(a ``VerifyingHandle``). The hashing library (``xxhash``, the ``checksum`` extra) is
imported only when checksums are written or checked.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> from fastst.integrity import report_lines, verify_path
>>> folder = tempfile.mkdtemp()
>>> fastst.save_file({"w": np.ones(4)}, os.path.join(folder, "a.safetensors"), checksum="xxh3_64")
>>> report = verify_path(folder)
>>> report["ok"], [os.path.basename(line) for line in report_lines(report)]
(True, ['a.safetensors: ok: 1 tensor, 32 bytes, 1 checksums (xxh3_64)'])
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError
from ._format.checksums import (ALGORITHMS, CHECKSUM_KEY, checksum_metadata, checksums_of,
                                digest_of, digests_in_file, digests_of, mismatch,
                                plan_with_checksums, reserved_checksums, with_checksums,
                                without_checksum)
from ._format.index import read_index
from ._format.names import is_index_name
from ._handles.handle import NumpyHandle, VerifyingHandle, open_handle
from ._io.progress import byte_bar, is_terminal
from ._io.source import Source, as_source

__all__ = ["CHECKSUM_KEY", "ALGORITHMS", "digest_of", "digests_of", "with_checksums",
           "checksum_metadata", "reserved_checksums", "digests_in_file", "plan_with_checksums",
           "checksums_of", "VerifyingHandle", "verify_file", "verify_path", "report_lines"]


def verify_file(path: str, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                progress: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
    """Check one file: its structure, then each tensor's checksum when it has them.

    Nothing is raised for a bad file: what is wrong goes into the report. A
    file without checksums is checked for structure only (``ok``, with
    ``checksum`` None); one whose checksums leave some tensor out has an error
    naming each.

    Parameters
    ----------
    path : str
        A local file, or a URL.
    max_header_size : int, default 100,000,000
        The largest header accepted, in bytes.
    progress : callable, optional
        Called with the number of bytes hashed, as they are.

    Returns
    -------
    dict
        ``file`` (`path`, a URL's credentials hidden), ``ok`` (bool),
        ``tensors`` (their number), ``bytes`` (their bytes), ``checksum`` (the
        algorithm, or None), ``checked`` (tensors whose checksum was checked) and
        ``errors`` (``{"tensor": name or None, "error": why}``, None for the
        file's own).

    Raises
    ------
    ImportError
        When the file has checksums and ``xxhash`` is not installed.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.integrity import verify_file
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"a": np.arange(4, dtype=np.int32)}, path, checksum="xxh3_64")
    >>> with open(path, "r+b") as file:            # the last byte changed
    ...     _ = file.seek(-1, os.SEEK_END)
    ...     _ = file.write(bytes([1]))
    >>> report = verify_file(path)
    >>> report["ok"], report["checked"], report["errors"][0]["tensor"]
    (False, 1, 'a')
    >>> report["errors"][0]["error"]
    'checksum mismatch, the data is corrupt (xxh3_64 ..., the metadata says a1d0bd893c9531ac)'
    """
    return _verified(as_source(path), max_header_size, progress)


def _verified(source: Source, max_header_size: int,
              progress: Optional[Callable[[int], Any]]) -> Dict[str, Any]:
    """`verify_file`'s report on `source`."""
    report: Dict[str, Any] = {"file": source.label, "ok": False, "tensors": 0, "bytes": 0,
                              "checksum": None, "checked": 0, "errors": []}
    try:
        with _opened(source, max_header_size) as reader:
            _verify_open_file(reader, report, progress)
    except (SafetensorError, OSError) as error:
        report["errors"].append({"tensor": None,
                                 "error": _without_path(str(error), source.label)})
    report["ok"] = not report["errors"]
    return report


def _verify_open_file(reader: NumpyHandle, report: Dict[str, Any],
                      progress: Optional[Callable[[int], Any]]) -> None:
    names = reader.offset_keys()
    report["tensors"] = len(names)
    report["bytes"] = sum(_nbytes(reader, name) for name in names)
    found = checksums_of(reader.metadata(), names, reader.source)
    if found is None:
        return
    algorithm, digests = found
    report["checksum"] = algorithm
    covered = len(names) - len(without_checksum(names, digests))
    for name in names:
        if name not in digests:
            report["errors"].append({"tensor": name, "error": (
                f"has no checksum (the file's checksums cover {covered} of its "
                f"{len(names)} tensors)")})
    # the next tensors are read while this one is hashed
    with reader.iter_tensors([name for name in names if name in digests]) as tensors:
        for name, array in tensors:
            actual = digest_of(array, algorithm, progress)
            report["checked"] += 1
            if actual != digests[name]:
                report["errors"].append({"tensor": name,
                                         "error": mismatch(algorithm, digests[name], actual)})
            del array
    position = {name: k for k, name in enumerate(names)}
    report["errors"].sort(key=lambda error: position[error["tensor"]])


def _opened(target: Any, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> NumpyHandle:
    """The file at a path, the object at a URL (read by byte ranges), or a Source."""
    return open_handle(as_source(target), max_header_size=max_header_size)


def _nbytes(reader: NumpyHandle, name: str) -> int:
    begin, end = reader.info(name).data_offsets
    return int(end - begin)


def _without_path(message: str, path: str) -> str:
    for prefix in (f"{path}: ", f"{os.path.abspath(path)}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def verify_path(path: str, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                progress: bool = False) -> Dict[str, Any]:
    """Check a file, a folder or a sharded checkpoint: what ``fastst verify`` runs.

    `verify_file` of a file (or a URL); of every ``*.safetensors`` file of a
    folder, with each ``*.index.json`` of the folder checked against its
    shards: every tensor of its weight_map in the shard it names, and no
    tensor in two shards; or of a sharded checkpoint by its ``*.index.json``
    (a path or a URL): the shards it names, and the index against them.
    Nothing is raised for bad files.

    Parameters
    ----------
    path : str
        A file, a folder, an ``*.index.json``, or a URL.
    max_header_size : int, default 100,000,000
        The largest header, or index, accepted, in bytes.
    progress : bool, default False
        Draw a progress bar on stderr when it is a terminal and there is much
        to hash (64 MiB or more).

    Returns
    -------
    dict
        ``path``, ``ok`` (bool), ``files`` (each file's `verify_file` report)
        and ``errors`` (the indexes' and the folder's: ``{"file": ...,
        "error": ...}``).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.integrity import verify_path
    >>> folder = tempfile.mkdtemp()
    >>> fastst.save_file({"a": np.zeros(100), "b": np.ones(100)}, folder, max_shard_size=800,
    ...                  checksum="xxh3_64")
    >>> os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
    >>> report = verify_path(folder)
    >>> report["ok"], len(report["files"]), report["errors"][0]["error"]
    (False, 1, "shard 'model-00002-of-00002.safetensors' is missing or unreadable")
    """
    source = as_source(path)
    folder = source.is_directory()
    if folder:
        names = sorted(os.listdir(path))
        files = [as_source(os.path.join(path, name)) for name in names
                 if name.endswith(".safetensors")]
        indexes = [as_source(os.path.join(path, name)) for name in names if is_index_name(name)]
    elif is_index_name(source.name):
        files, indexes = [], [source]
    else:
        files, indexes = [source], []
    checked = [_checked_index(index, max_header_size) for index in indexes]
    index_errors = [error for errors, _ in checked for error in errors]
    if indexes and not folder:    # a checkpoint given by its index: the shards it names
        files = [shard for _, shards in checked for shard in shards]
    bar = _progress_bar(files, max_header_size) if progress else None
    try:
        reports = [_verified(file, max_header_size, None if bar is None else bar.update)
                   for file in files]
    finally:
        if bar is not None:
            bar.close()
    if folder and not files:
        index_errors.append({"file": path, "error": "no .safetensors file in this folder"})
    return {"path": source.label, "ok": not index_errors and all(r["ok"] for r in reports),
            "files": reports, "errors": index_errors}


def _progress_bar(files: List[Source], max_header_size: int) -> Any:
    """A bar over the bytes to hash when the work is large (see ``byte_bar``)."""
    if not is_terminal(sys.stderr):     # no file opened twice for a bar not drawn
        return None
    return byte_bar(sum(_checksummed_bytes(file, max_header_size) for file in files), "verify")


def _checksummed_bytes(source: Source, max_header_size: int) -> int:
    try:
        with _opened(source, max_header_size) as reader:
            metadata = reader.metadata() or {}
            return 0 if CHECKSUM_KEY not in metadata else sum(
                _nbytes(reader, name) for name in reader.offset_keys())
    except (SafetensorError, OSError):
        return 0


def _checked_index(index: Source, max_size: int) -> Tuple[List[Dict[str, Any]], List[Source]]:
    """What is wrong between the sharded checkpoint index `index` and its shards,
    and where the shards it names are."""
    def error(text: str) -> Dict[str, Any]:
        return {"file": index.label, "error": text}

    try:
        parsed = read_index(index, max_size=max_size)
    except (OSError, SafetensorError) as why:
        return [error(_without_path(str(why), index.label))], []
    shards = {shard: index.sibling(shard) for shard in sorted(parsed.shards)}
    names_in = _tensor_names(shards)
    errors = [error(f"shard {shard[:80]!r} is missing or unreadable")
              for shard in shards if shard not in names_in]
    where: Dict[str, str] = {}
    for shard, names in names_in.items():
        for name in names:
            if name in where:
                errors.append(error(f"tensor {name[:80]!r} is in two shards: {where[name]} "
                                    f"and {shard}"))
            elif name not in parsed.weight_map:
                errors.append(error(f"tensor {name[:80]!r} of {shard} is not in the "
                                    f"weight_map"))
            where[name] = shard
    for name, shard in parsed.weight_map.items():
        if shard in names_in and where.get(name) != shard:
            errors.append(error(f"tensor {name[:80]!r} is not in its shard {shard}"))
    return errors, list(shards.values())


def _tensor_names(shards: Dict[str, Source]) -> Dict[str, List[str]]:
    """The tensor names of each shard that can be opened."""
    names = {}
    for shard, source in shards.items():
        try:
            with _opened(source) as reader:
                names[shard] = reader.offset_keys()
        except (SafetensorError, OSError):
            continue
    return names


def report_lines(report: Dict[str, Any]) -> List[str]:
    """`verify_path`'s report as text, one line per file and per problem, as
    ``fastst verify`` prints it.

    Parameters
    ----------
    report : dict
        What `verify_path` returns.

    Returns
    -------
    list of str

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.integrity import report_lines, verify_path
    >>> path = os.path.join(tempfile.mkdtemp(), "plain.safetensors")
    >>> fastst.save_file({"a": np.zeros(2)}, path)
    >>> [line.replace(path, "plain.safetensors") for line in report_lines(verify_path(path))]
    ['plain.safetensors: ok: 1 tensor, 16 bytes, structure only: the file has no checksums']
    """
    lines = []
    for file in report["files"]:
        if file["checksum"] is None and any(e["tensor"] is None for e in file["errors"]):
            # not read (no safetensors file, say): nothing is known of its checksums
            lines.append(f"{file['file']}: FAILED")
        else:
            status = "ok" if file["ok"] else "FAILED"
            what = (f"{file['checked']} checksums ({file['checksum']})" if file["checksum"]
                    else "structure only: the file has no checksums")
            count = f"{file['tensors']} tensor{'' if file['tensors'] == 1 else 's'}"
            lines.append(f"{file['file']}: {status}: {count}, {file['bytes']} bytes, {what}")
        lines += [f"  {file['file']}: " + (f"tensor {e['tensor']!r}: " if e["tensor"] else "")
                  + e["error"] for e in file["errors"]]
    lines += [f"{e['file']}: {e['error']}" for e in report["errors"]]
    return lines
