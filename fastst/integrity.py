"""Per-tensor checksums: written beside the tensors, checked on reading or by
``fastst verify``.

A file saved with ``checksum="xxh3_64"`` (or ``"xxh3_128"``) holds, in its
``__metadata__`` under ``"fastst.checksums"``, the JSON text
``{"algorithm": "xxh3_64", "tensors": {"<name>": "<hex digest>", ...}}``: one digest
per tensor, of its bytes as stored (C order, little-endian). Other readers see one
more metadata entry and nothing else. The hashing library (``xxhash``, the
``checksum`` extra) is imported only when checksums are written or checked.
"""
from __future__ import annotations

import os
import re
import sys
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional,
                    Sequence, Set, Tuple)

import numpy as np

from ._progress import byte_bar
from ._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError, WriteSpec, WritePlan, plan_write
from ._handle import (SHARD_NAME_RULE, NumpyHandle, is_plain_shard_name, is_url, open_file,
                      open_remote)

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["CHECKSUM_KEY", "ALGORITHMS", "digest_of", "digests_of", "with_checksums",
           "checksum_metadata", "reserved_checksums", "digests_in_file", "plan_with_checksums",
           "checksums_of",
           "VerifyingHandle", "verify_file", "verify_path", "report_lines"]

CHECKSUM_KEY = "fastst.checksums"
# algorithm -> hex digits of its digest; both are xxhash's XXH3, which runs at memory
# bandwidth (bench/integrity.py); 128 bits make an accidental match unthinkable
ALGORITHMS = {"xxh3_64": 16, "xxh3_128": 32}
HEX = re.compile(r"[0-9a-f]+")
BLOCK_BYTES = 64 << 20     # hashed per step: the unit of progress, and of copies made
PARALLEL_MIN_BYTES = 32 << 20   # below this, threads cost more than they save
MAX_THREADS = 8
PROGRESS_MIN_BYTES = 256 << 20


def _new_hasher(algorithm: str) -> Any:
    try:
        import xxhash
    except ImportError:
        raise ImportError("checksums need the xxhash package: pip install 'fastst[checksum]'"
                          ) from None
    return getattr(xxhash, algorithm)()


def _checked_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"checksum must be one of {', '.join(map(repr, ALGORITHMS))}, "
                         f"got {algorithm!r}")
    return algorithm


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def digest_of(array: npt.NDArray[Any], algorithm: str,
              progress: Optional[Callable[[int], Any]] = None) -> str:
    """The hex digest of `array`'s bytes as a safetensors file stores them: C order,
    little-endian. A C-ordered little-endian array is hashed where it lies; any
    other is converted a block of rows at a time, never copied whole."""
    hasher = _new_hasher(algorithm)
    for block in _stored_bytes(array):
        hasher.update(block)
        if progress is not None:
            progress(len(block))
    digest: str = hasher.hexdigest()
    return digest


def _stored_bytes(array: npt.NDArray[Any]) -> Iterator[npt.NDArray[np.uint8]]:
    big_endian = array.dtype.byteorder == ">"
    if array.flags.c_contiguous and not big_endian:
        flat = array.reshape(-1).view(np.uint8)
        for start in range(0, max(len(flat), 1), BLOCK_BYTES):
            yield flat[start:start + BLOCK_BYTES]
        return
    row_bytes = array[0].nbytes if len(array) else 1
    rows = max(1, BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, len(array), rows):
        block = np.ascontiguousarray(array[start:start + rows])
        if big_endian:
            block = block.astype(block.dtype.newbyteorder("<"))
        yield block.reshape(-1).view(np.uint8)


def with_checksums(specs: Sequence[WriteSpec], metadata: Optional[Mapping[str, str]],
                   algorithm: str) -> Dict[str, str]:
    """`metadata` plus the checksum entry for the tensors `specs` describe."""
    algorithm = _checked_algorithm(algorithm)
    _check_key_is_free(metadata)
    sources = [spec[3] for spec in specs if spec[3] is not None]
    if len(sources) < len(specs):
        name = next(spec[0] for spec in specs if spec[3] is None)
        raise ValueError(f"tensor {name!r}: checksums need each tensor's data before the "
                         f"header is written")
    digests = dict(zip([spec[0] for spec in specs], digests_of(sources, algorithm)))
    return checksum_metadata(metadata, digests, algorithm)


def checksum_metadata(metadata: Optional[Mapping[str, str]], digests: Mapping[str, str],
                      algorithm: str) -> Dict[str, str]:
    """`metadata` plus the checksum entry of `digests` ({tensor: hex digest})."""
    import orjson

    _check_key_is_free(metadata)
    result = dict(metadata or {})
    result[CHECKSUM_KEY] = orjson.dumps(
        {"algorithm": algorithm, "tensors": dict(sorted(digests.items()))}).decode()
    return result


def _check_key_is_free(metadata: Optional[Mapping[str, str]]) -> None:
    if metadata is not None and CHECKSUM_KEY in metadata:
        raise ValueError(f"metadata key {CHECKSUM_KEY!r} is reserved for checksums")


def reserved_checksums(specs: Sequence[WriteSpec], metadata: Optional[Mapping[str, str]],
                       algorithm: str) -> Dict[str, str]:
    """`metadata` plus a checksum entry of all-zero digests: a header written with
    it has exactly the length of the final one, whose digests (hex digits, never
    escaped in JSON) are as long. For the writers that write the header before
    the data (``StreamWriter``); checks that the hashing library is there."""
    algorithm = _checked_algorithm(algorithm)
    _new_hasher(algorithm)
    return checksum_metadata(metadata, {spec[0]: "0" * ALGORITHMS[algorithm] for spec in specs},
                             algorithm)


def digests_in_file(fd: int, plan: WritePlan, algorithm: str) -> Dict[str, str]:
    """{tensor: digest} of the tensors that `plan` placed in the file open at `fd`
    (read and written), hashed from the file through the page cache."""
    import mmap

    names = plan.names()
    mapped = mmap.mmap(fd, plan.total_size, mmap.MAP_SHARED, mmap.PROT_READ)
    arrays: List[npt.NDArray[np.uint8]] = []
    try:
        arrays = [_bytes_in(mapped, plan.data_start, plan.info(name).data_offsets)
                  for name in names]
        return dict(zip(names, digests_of(arrays, algorithm)))
    finally:
        arrays = []        # the views must go before the map is closed
        mapped.close()


def _bytes_in(mapped: Any, data_start: int, offsets: Tuple[int, int]) -> npt.NDArray[np.uint8]:
    begin, end = offsets
    if begin == end:
        return np.empty(0, np.uint8)
    return np.frombuffer(mapped, np.uint8, end - begin, data_start + begin)


def digests_of(arrays: List[npt.NDArray[Any]], algorithm: str) -> List[str]:
    """The digest of each array; xxhash releases the GIL, so large work is spread
    over threads, a tensor each."""
    threads = min(_usable_cores(), len(arrays), MAX_THREADS)
    if threads < 2 or sum(array.nbytes for array in arrays) < PARALLEL_MIN_BYTES:
        return [digest_of(array, algorithm) for array in arrays]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda array: digest_of(array, algorithm), arrays))


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):     # Linux: the cores this process may run on
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def plan_with_checksums(specs: Sequence[WriteSpec], metadata: Optional[Mapping[str, str]],
                        algorithm: Optional[str], **plan_options: Any) -> WritePlan:
    """The WritePlan of `specs` (``plan_write`` with `plan_options`), its metadata
    holding their checksums unless `algorithm` is None."""
    plan = plan_write(specs, metadata, **plan_options)   # checks the specs before hashing
    if algorithm is None:
        return plan
    return plan_write(specs, with_checksums(specs, metadata, algorithm), **plan_options)


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def checksums_of(metadata: Optional[Mapping[str, str]], names: Sequence[str],
                 source: str) -> Optional[Tuple[str, Dict[str, str]]]:
    """(algorithm, {tensor: digest}) from a file's metadata, checked to name only
    the file's tensors (`names`), each once; None when the file has no checksums.
    Tensors the digests leave out are for the caller to name (see
    ``_without_checksum``)."""
    import orjson

    text = (metadata or {}).get(CHECKSUM_KEY)
    if text is None:
        return None
    try:
        document = orjson.loads(text)
    except orjson.JSONDecodeError as error:
        raise SafetensorError(f"{source}: metadata {CHECKSUM_KEY!r} is not valid JSON "
                              f"({error})") from None
    if not isinstance(document, dict) or set(document) != {"algorithm", "tensors"} \
            or not isinstance(document["tensors"], dict):
        raise SafetensorError(f"{source}: metadata {CHECKSUM_KEY!r} must be an object of "
                              f"'algorithm' and 'tensors' (an object)")
    algorithm, digests = document["algorithm"], document["tensors"]
    if algorithm not in ALGORITHMS:
        raise SafetensorError(f"{source}: checksum algorithm {str(algorithm)[:40]!r} is not "
                              f"known (known: {', '.join(ALGORITHMS)})")
    _check_digests(digests, set(names), ALGORITHMS[algorithm], source)
    return algorithm, digests


def _check_digests(digests: Dict[str, Any], names: Set[str], digits: int, source: str) -> None:
    for name, digest in digests.items():
        if name not in names:
            raise SafetensorError(f"{source}: tensor {name[:80]!r} has a checksum but is not "
                                  f"in the file")
        if type(digest) is not str or len(digest) != digits or not HEX.fullmatch(digest):
            raise SafetensorError(f"{source}: tensor {name[:80]!r}: checksum must be "
                                  f"{digits} lowercase hex digits")


def _without_checksum(names: Sequence[str], digests: Mapping[str, str]) -> List[str]:
    """The tensors of `names` that `digests` has no checksum for, in file order."""
    return [name for name in names if name not in digests]


def _some(names: Sequence[str]) -> str:
    """'tensor 'a'' or 'tensors 'a', 'b' and 3 more': a few names of a list."""
    shown = ", ".join(repr(name[:80]) for name in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"tensor {shown}" if len(names) == 1 else f"tensors {shown}{more}"


def _mismatch(algorithm: str, expected: str, actual: str) -> str:
    return (f"checksum mismatch, the data is corrupt ({algorithm} {actual}, the metadata "
            f"says {expected})")


class VerifyingHandle(NumpyHandle):
    """A NumpyHandle that checks each tensor's checksum the first time the tensor
    is read (``safe_open(..., verify=True)``); a partial read (rows, a slice)
    checks the whole tensor first. A file without checksums is refused, and so is
    one whose checksums leave some tensor out, at opening: verifying it could not
    keep its promise. (``verify_file`` checks the other tensors of such a file and
    names each one left out as an error.)"""

    def open_file(self, filename: Any, backend: str = "mmap", *,
                  max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> None:
        super().open_file(filename, backend, max_header_size=max_header_size)
        self._take_checksums()

    def open_ranges(self, source: str, size: int, fetch: Any, *,
                    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                    identity: Any = None) -> None:
        super().open_ranges(source, size, fetch, max_header_size=max_header_size,
                            identity=identity)
        self._take_checksums()

    def _take_checksums(self) -> None:
        names = self.offset_keys()
        found = checksums_of(self.metadata(), names, self.source)
        if found is None:
            raise SafetensorError(f"{self.source}: verify=True, but the file has no "
                                  f"checksums (save it with checksum='xxh3_64')")
        self.algorithm, self.digests = found
        missing = _without_checksum(names, self.digests)
        if missing:
            raise SafetensorError(f"{self.source}: verify=True, but {_some(missing)} "
                                  f"{'has' if len(missing) == 1 else 'have'} no checksum "
                                  f"(the file's checksums cover {len(names) - len(missing)} "
                                  f"of its {len(names)} tensors)")
        self.verified: Set[str] = set()

    def check(self, name: str, array: Optional[npt.NDArray[Any]] = None) -> None:
        """Check tensor `name` (its bytes `array`, else read now) unless done before."""
        if name in self.verified:
            return
        if array is None:
            array = NumpyHandle.get_tensor(self, name)
        actual = digest_of(array, self.algorithm)
        if actual != self.digests[name]:
            raise SafetensorError(f"{self.source}: tensor {name!r}: "
                                  + _mismatch(self.algorithm, self.digests[name], actual))
        self.verified.add(name)

    def get_tensor(self, name: str, *, out: Optional[npt.NDArray[Any]] = None
                   ) -> npt.NDArray[Any]:
        array: npt.NDArray[Any] = super().get_tensor(name, out=out)
        self.check(name, array)
        return array

    def __getitem__(self, name: str) -> npt.NDArray[Any]:
        return self.get_tensor(name)

    def get_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def copy_tensors(self) -> Dict[str, npt.NDArray[Any]]:
        arrays: Dict[str, npt.NDArray[Any]] = super().copy_tensors()
        for name, array in arrays.items():
            self.check(name, array)
        return arrays

    def read_into(self, arrays: Dict[str, npt.NDArray[Any]]) -> None:
        super().read_into(arrays)
        for name, array in arrays.items():
            self.check(name, array)

    def read_rows(self, name: str, first: int, last: int) -> npt.NDArray[Any]:
        self.check(name)
        rows: npt.NDArray[Any] = super().read_rows(name, first, last)
        return rows

    def gather_rows(self, name: str, rows: npt.NDArray[Any]) -> npt.NDArray[Any]:
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather_rows(name, rows)
        return gathered

    def gather(self, name: str, rows: Any, out: Optional[npt.NDArray[Any]] = None
               ) -> npt.NDArray[Any]:
        self.check(name)
        gathered: npt.NDArray[Any] = super().gather(name, rows, out)
        return gathered


# ---------------------------------------------------------------------------
# Verifying files and folders
# ---------------------------------------------------------------------------


def verify_file(path: str, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
                progress: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
    """Check the file at `path`: its structure, then each tensor's checksum when it
    has them. A report: ``file``, ``ok``, ``tensors``, ``bytes``, ``checksum`` (the
    algorithm, or None), ``checked`` (tensors whose checksum was checked) and
    ``errors`` (``{"tensor": name or None, "error": why}``); nothing is raised for
    a bad file. `progress` is called with the bytes hashed as they are."""
    report: Dict[str, Any] = {"file": path, "ok": False, "tensors": 0, "bytes": 0,
                              "checksum": None, "checked": 0, "errors": []}
    try:
        with _opened(path, max_header_size) as reader:
            _verify_open_file(reader, report, progress)
    except (SafetensorError, OSError) as error:
        report["errors"].append({"tensor": None, "error": _without_path(str(error), path)})
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
    covered = len(names) - len(_without_checksum(names, digests))
    for name in names:
        if name not in digests:
            report["errors"].append({"tensor": name, "error": (
                f"has no checksum (the file's checksums cover {covered} of its "
                f"{len(names)} tensors)")})
            continue
        actual = digest_of(reader.get_tensor(name), algorithm, progress)
        report["checked"] += 1
        if actual != digests[name]:
            report["errors"].append({"tensor": name,
                                     "error": _mismatch(algorithm, digests[name], actual)})


def _opened(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> NumpyHandle:
    """The file at `path`, or the object at a URL (read by byte ranges)."""
    if is_url(path):
        return open_remote(path, max_header_size=max_header_size)
    return open_file(path, max_header_size=max_header_size)


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
    """`verify_file` of a file (or a URL); of every ``*.safetensors`` file of a
    folder, with each ``*.index.json`` of the folder checked against its shards:
    every tensor of its weight_map in the shard it names, and no tensor in two
    shards; or of a sharded checkpoint by its ``*.index.json`` (a path or a
    URL): the shards it names, and the index against them. A report: ``path``,
    ``ok``, ``files`` (their reports) and ``errors`` (the index's)."""
    folder = not is_url(path) and os.path.isdir(path)
    if folder:
        files = sorted(os.path.join(path, name) for name in os.listdir(path)
                       if name.endswith(".safetensors"))
        indexes = sorted(os.path.join(path, name) for name in os.listdir(path)
                         if name.endswith(".index.json"))
    elif path.endswith(".index.json"):
        files, indexes = [], [path]
    else:
        files, indexes = [path], []
    checked = [_checked_index(index, max_header_size) for index in indexes]
    index_errors = [error for errors, _ in checked for error in errors]
    if indexes and not folder:    # a checkpoint given by its index: the shards it names
        files = [shard for _, shards in checked for shard in shards]
    bar = _progress_bar(files, max_header_size) if progress else None
    reports = [verify_file(file, max_header_size=max_header_size,
                           progress=None if bar is None else bar.update) for file in files]
    if bar is not None:
        bar.close()
    if folder and not files:
        index_errors.append({"file": path, "error": "no .safetensors file in this folder"})
    return {"path": path, "ok": not index_errors and all(r["ok"] for r in reports),
            "files": reports, "errors": index_errors}


def _progress_bar(files: List[str], max_header_size: int) -> Any:
    """A bar over the bytes to hash when the work is large (see ``byte_bar``)."""
    if not sys.stderr.isatty():
        return None
    total = sum(_checksummed_bytes(file, max_header_size) for file in files)
    return byte_bar(total, "verify") if total >= PROGRESS_MIN_BYTES else None


def _checksummed_bytes(path: str, max_header_size: int) -> int:
    try:
        with _opened(path, max_header_size) as reader:
            metadata = reader.metadata() or {}
            return 0 if CHECKSUM_KEY not in metadata else sum(
                _nbytes(reader, name) for name in reader.offset_keys())
    except (SafetensorError, OSError):
        return 0


def _checked_index(index: str, max_size: int) -> Tuple[List[Dict[str, Any]], List[str]]:
    """What is wrong between the sharded checkpoint index `index` (a path or a URL)
    and its shards, and the paths (URLs) of the shards it names."""
    import orjson

    def error(text: str) -> Dict[str, Any]:
        return {"file": index, "error": text}

    try:
        weight_map = orjson.loads(_index_text(index, max_size)).get("weight_map")
    except (OSError, SafetensorError, orjson.JSONDecodeError, AttributeError) as why:
        return [error(f"cannot be read as JSON: {_without_path(str(why), index)}")], []
    if not isinstance(weight_map, dict) or not all(
            isinstance(shard, str) for shard in weight_map.values()):
        return [error("has no 'weight_map' object of tensor name to shard file name")], []
    folder = os.path.dirname(index)
    shards = sorted(set(weight_map.values()))
    errors = [error(f"shard {shard[:80]!r} is not {SHARD_NAME_RULE}")
              for shard in shards if not is_plain_shard_name(shard)]
    if errors:
        return errors, []
    names_in = _tensor_names(folder, shards)
    errors += [error(f"shard {shard[:80]!r} is missing or unreadable")
               for shard in shards if shard not in names_in]
    where: Dict[str, str] = {}
    for shard, names in names_in.items():
        for name in names:
            if name in where:
                errors.append(error(f"tensor {name[:80]!r} is in two shards: {where[name]} "
                                    f"and {shard}"))
            elif name not in weight_map:
                errors.append(error(f"tensor {name[:80]!r} of {shard} is not in the "
                                    f"weight_map"))
            where[name] = shard
    for name, shard in weight_map.items():
        if shard in names_in and where.get(name) != shard:
            errors.append(error(f"tensor {name[:80]!r} is not in its shard {shard}"))
    return errors, [os.path.join(folder, shard) for shard in shards]


def _index_text(index: str, max_size: int) -> bytes:
    """The bytes of the index file (or object) `index`, refused past `max_size`."""
    if is_url(index):
        from .remote import read_object   # a capability: imported when used

        return read_object(index, None, max_size, "index")
    with open(index, "rb") as file:
        text = file.read(max_size + 1)
    if len(text) > max_size:
        raise SafetensorError(f"{index}: index exceeds the limit of {max_size} bytes")
    return text


def _tensor_names(folder: str, shards: List[str]) -> Dict[str, List[str]]:
    """The tensor names of each shard that can be opened."""
    names = {}
    for shard in shards:
        try:
            with _opened(os.path.join(folder, shard)) as reader:
                names[shard] = reader.offset_keys()
        except (SafetensorError, OSError):
            continue
    return names


def report_lines(report: Dict[str, Any]) -> List[str]:
    """`verify_path`'s report as text, one line per file and per problem."""
    lines = []
    for file in report["files"]:
        status = "ok" if file["ok"] else "FAILED"
        what = (f"{file['checked']} checksums ({file['checksum']})" if file["checksum"]
                else "structure only: the file has no checksums")
        count = f"{file['tensors']} tensor{'' if file['tensors'] == 1 else 's'}"
        lines.append(f"{file['file']}: {status}: {count}, {file['bytes']} bytes, {what}")
        lines += [f"  {file['file']}: " + (f"tensor {e['tensor']!r}: " if e["tensor"] else "")
                  + e["error"] for e in file["errors"]]
    lines += [f"{e['file']}: {e['error']}" for e in report["errors"]]
    return lines
