"""Per-tensor checksums, THE format and its writing: a file saved with
``checksum="xxh3_64"`` (or ``"xxh3_128"``) holds, in its ``__metadata__`` under
``"fastst.checksums"``, the JSON text
``{"algorithm": "xxh3_64", "tensors": {"<name>": "<hex digest>", ...}}``: one digest
per tensor, of its bytes as stored (C order, little-endian). Other readers see one
more metadata entry and nothing else. The hashing library (``xxhash``, the
``checksum`` extra) is imported only when checksums are written or checked.

Checking them is ``fastst.integrity``'s job (and ``safe_open(verify=True)``'s).
"""
from __future__ import annotations

import re
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional,
                    Sequence, Set, Tuple)

import numpy as np

from .._core import SafetensorError, WritePlan, plan_write, usable_cpus

if TYPE_CHECKING:
    import numpy.typing as npt

    from .._core import WriteSpec

__all__ = ["ALGORITHMS", "CHECKSUM_KEY", "checksum_metadata", "checksums_of", "digest_of",
           "digests_in_file", "digests_of", "mismatch", "plan_with_checksums",
           "reserved_checksums", "some_tensors", "with_checksums", "without_checksum"]

CHECKSUM_KEY = "fastst.checksums"
"""The ``__metadata__`` key under which a file saved with ``checksum=`` holds its
tensors' checksums, as the JSON text ``{"algorithm": ..., "tensors": {name: hex
digest}}``; reserved: metadata given to a saver with checksums may not use it."""
# both are xxhash's XXH3, which runs at memory bandwidth (bench/integrity.py); 128 bits
# make an accidental match unthinkable
ALGORITHMS = {"xxh3_64": 16, "xxh3_128": 32}
"""The checksum algorithms, by name (what ``checksum=`` takes), each with the number of
hex digits of its digest: ``{"xxh3_64": 16, "xxh3_128": 32}``."""
HEX = r"[0-9a-f]+"   # a pattern, compiled when a digest is first checked
BLOCK_BYTES = 64 << 20     # hashed per step: the unit of progress, and of copies made
PARALLEL_MIN_BYTES = 32 << 20   # below this, threads cost more than they save
MAX_THREADS = 8


def _new_hasher(algorithm: str) -> Any:
    try:
        import xxhash
    except ImportError:
        raise ImportError("checksums need the xxhash package: pip install xxhash (fastst's "
                          "'checksum' extra)") from None
    return getattr(xxhash, algorithm)()


def _checked_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"checksum must be one of {', '.join(map(repr, ALGORITHMS))}, "
                         f"got {algorithm!r}")
    return algorithm




def digest_of(array: npt.NDArray[Any], algorithm: str,
              progress: Optional[Callable[[int], Any]] = None) -> str:
    """The hex digest of an array's bytes as a safetensors file stores them: C
    order, little-endian.

    A C-ordered little-endian array is hashed where it lies; any other is
    converted a block of rows at a time, never copied whole.

    Parameters
    ----------
    array : numpy.ndarray
        The tensor.
    algorithm : "xxh3_64" or "xxh3_128"
        The checksum algorithm (see `ALGORITHMS`).
    progress : callable, optional
        Called with the number of bytes hashed, a block (64 MiB) at a time.

    Returns
    -------
    str
        Lowercase hex digits, 16 or 32 of them.

    Raises
    ------
    ImportError
        When the ``xxhash`` package is not installed.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.integrity import digest_of
    >>> array = np.arange(4, dtype=np.int32)
    >>> digest_of(array, "xxh3_64")
    'a1d0bd893c9531ac'
    >>> digest_of(array.astype(">i4"), "xxh3_64")       # the bytes as stored: the same
    'a1d0bd893c9531ac'
    """
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
    """`metadata` plus the checksum entry of the tensors `specs` describe, hashed now.

    Parameters
    ----------
    specs : sequence of WriteSpec
        The tensors, each with its data.
    metadata : mapping of str to str or None
        The metadata to add the entry to (not changed).
    algorithm : "xxh3_64" or "xxh3_128"
        The checksum algorithm.

    Returns
    -------
    dict of str to str

    Raises
    ------
    ValueError
        When `algorithm` is not known, `metadata` holds `CHECKSUM_KEY`, or a
        spec has no data.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.integrity import with_checksums
    >>> from fastst.writer import spec_of_array
    >>> with_checksums([spec_of_array("a", np.arange(4, dtype=np.int32))], {"k": "v"}, "xxh3_64")
    {'k': 'v', 'fastst.checksums': '{"algorithm":"xxh3_64","tensors":{"a":"a1d0bd893c9531ac"}}'}
    """
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
    """`metadata` plus the checksum entry of digests already computed.

    Parameters
    ----------
    metadata : mapping of str to str or None
        The metadata to add the entry to (not changed).
    digests : mapping of str to str
        Tensor name -> hex digest.
    algorithm : str
        The algorithm of the digests.

    Returns
    -------
    dict of str to str

    Raises
    ------
    ValueError
        When `metadata` holds `CHECKSUM_KEY`.

    Examples
    --------
    >>> from fastst.integrity import checksum_metadata
    >>> checksum_metadata(None, {"b": "00" * 8, "a": "ff" * 8}, "xxh3_64")
    {'fastst.checksums': '{"algorithm":"xxh3_64","tensors":{"a":"ffffffffffffffff","b":"0000000000000000"}}'}
    """
    from fastst._json import dumps

    _check_key_is_free(metadata)
    result = dict(metadata or {})
    result[CHECKSUM_KEY] = dumps(
        {"algorithm": algorithm, "tensors": dict(sorted(digests.items()))}).decode()
    return result


def _check_key_is_free(metadata: Optional[Mapping[str, str]]) -> None:
    if metadata is not None and CHECKSUM_KEY in metadata:
        raise ValueError(f"metadata key {CHECKSUM_KEY!r} is reserved for checksums")


def reserved_checksums(specs: Sequence[WriteSpec], metadata: Optional[Mapping[str, str]],
                       algorithm: str) -> Dict[str, str]:
    """`metadata` plus a checksum entry of all-zero digests, as long as the final
    ones.

    A header written with it has exactly the length of the final one, whose
    digests (hex digits, never escaped in JSON) are as long: for the writers
    that write the header before the data (``StreamWriter``), then rewrite it
    in place.

    Parameters
    ----------
    specs : sequence of WriteSpec
        The tensors (their data may be None).
    metadata : mapping of str to str or None
        The metadata to add the entry to.
    algorithm : "xxh3_64" or "xxh3_128"
        The checksum algorithm.

    Returns
    -------
    dict of str to str

    Raises
    ------
    ValueError
        When `algorithm` is not known, or `metadata` holds `CHECKSUM_KEY`.
    ImportError
        When the ``xxhash`` package is not installed (checked now, before any
        byte is written).

    Examples
    --------
    >>> from fastst.integrity import reserved_checksums
    >>> from fastst.writer import declared_specs
    >>> reserved_checksums(declared_specs({"a": ("F32", [2])}), None, "xxh3_64")
    {'fastst.checksums': '{"algorithm":"xxh3_64","tensors":{"a":"0000000000000000"}}'}
    """
    algorithm = _checked_algorithm(algorithm)
    _new_hasher(algorithm)
    return checksum_metadata(metadata, {spec[0]: "0" * ALGORITHMS[algorithm] for spec in specs},
                             algorithm)


def digests_in_file(fd: int, plan: WritePlan, algorithm: str) -> Dict[str, str]:
    """The digest of each tensor that a plan placed in a file, hashed from the file
    through the page cache.

    Parameters
    ----------
    fd : int
        The file, open for reading and writing (it is mapped).
    plan : WritePlan
        The plan the file was written by.
    algorithm : "xxh3_64" or "xxh3_128"
        The checksum algorithm.

    Returns
    -------
    dict of str to str
        Tensor name -> hex digest, in file order.

    Raises
    ------
    OSError
        When the file cannot be mapped, or is shorter than the plan.

    Examples
    --------
    >>> import numpy as np, os, tempfile
    >>> from fastst.integrity import digests_in_file
    >>> from fastst.writer import plan_write, spec_of_array
    >>> plan = plan_write([spec_of_array("a", np.arange(4, dtype=np.int32))], None)
    >>> fd = os.open(os.path.join(tempfile.mkdtemp(), "x.safetensors"), os.O_RDWR | os.O_CREAT)
    >>> plan.write_to(fd)
    >>> digests_in_file(fd, plan, "xxh3_64")
    {'a': 'a1d0bd893c9531ac'}
    >>> os.close(fd)
    """
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
    """The digest of each array (see `digest_of`), large work spread over threads.

    xxhash releases the GIL, so arrays of 32 MiB and more in all are hashed by
    up to 8 threads, a tensor each.

    Parameters
    ----------
    arrays : list of numpy.ndarray
        The tensors.
    algorithm : "xxh3_64" or "xxh3_128"
        The checksum algorithm.

    Returns
    -------
    list of str
        The digests, in the order of `arrays`.

    Raises
    ------
    ImportError
        When the ``xxhash`` package is not installed.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.integrity import digests_of
    >>> digests_of([np.arange(4, dtype=np.int32), np.zeros(0)], "xxh3_64")
    ['a1d0bd893c9531ac', '2d06800538d394c2']
    """
    threads = min(usable_cpus(), len(arrays), MAX_THREADS)
    if threads < 2 or sum(array.nbytes for array in arrays) < PARALLEL_MIN_BYTES:
        return [digest_of(array, algorithm) for array in arrays]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda array: digest_of(array, algorithm), arrays))

def plan_with_checksums(specs: Sequence[WriteSpec], metadata: Optional[Mapping[str, str]],
                        algorithm: Optional[str], **plan_options: Any) -> WritePlan:
    """The `WritePlan` of tensors, its metadata holding their checksums unless
    `algorithm` is None: how every saver plans a file.

    The specs are checked by ``plan_write`` before anything is hashed.

    Parameters
    ----------
    specs : sequence of WriteSpec
        The tensors, each with its data when `algorithm` is given.
    metadata : mapping of str to str or None
        The header's ``__metadata__``.
    algorithm : "xxh3_64" or "xxh3_128" or None
        The checksum algorithm; None for no checksums.
    **plan_options
        Passed to ``plan_write`` (``header_padding=``...).

    Returns
    -------
    WritePlan

    Raises
    ------
    SafetensorError
        When the specs are not valid (see ``plan_write``).
    ValueError
        When `algorithm` is not known, or `metadata` holds `CHECKSUM_KEY`.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> from fastst.integrity import plan_with_checksums
    >>> from fastst.writer import spec_of_array
    >>> plan = plan_with_checksums([spec_of_array("a", np.ones(2))], None, "xxh3_128")
    >>> plan.to_bytes() == fastst.save({"a": np.ones(2)}, checksum="xxh3_128")
    True
    """
    plan = plan_write(specs, metadata, **plan_options)   # checks the specs before hashing
    if algorithm is None:
        return plan
    return plan_write(specs, with_checksums(specs, metadata, algorithm), **plan_options)


# -- the format, as read ------------------------------------------------------------


def checksums_of(metadata: Optional[Mapping[str, str]], names: Sequence[str],
                 label: str) -> Optional[Tuple[str, Dict[str, str]]]:
    """The checksums a file's metadata holds, checked against the file's tensors.

    Parameters
    ----------
    metadata : mapping of str to str or None
        The file's ``__metadata__``.
    names : sequence of str
        The file's tensors: the digests may name only those, each once.
        Tensors the digests leave out are for the caller to name.
    label : str
        What messages call the file.

    Returns
    -------
    tuple of (str, dict of str to str) or None
        ``(algorithm, {tensor: hex digest})``; None when the file has no
        checksums.

    Raises
    ------
    SafetensorError
        When the entry is not valid JSON of the format, names an unknown
        algorithm or a tensor the file does not hold, or a digest is not
        lowercase hex digits of the algorithm's length.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.integrity import checksums_of
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"a": np.arange(4, dtype=np.int32)}, path, checksum="xxh3_64")
    >>> with fastst.safe_open(path) as f:
    ...     checksums_of(f.metadata(), f.offset_keys(), f.source)
    ('xxh3_64', {'a': 'a1d0bd893c9531ac'})
    """
    from fastst._json import JSONDecodeError, loads

    text = (metadata or {}).get(CHECKSUM_KEY)
    if text is None:
        return None
    try:
        document = loads(text)
    except JSONDecodeError as error:
        raise SafetensorError(f"{label}: metadata {CHECKSUM_KEY!r} is not valid JSON "
                              f"({error})") from None
    if not isinstance(document, dict) or set(document) != {"algorithm", "tensors"} \
            or not isinstance(document["tensors"], dict):
        raise SafetensorError(f"{label}: metadata {CHECKSUM_KEY!r} must be an object of "
                              f"'algorithm' and 'tensors' (an object)")
    algorithm, digests = document["algorithm"], document["tensors"]
    if algorithm not in ALGORITHMS:
        raise SafetensorError(f"{label}: checksum algorithm {str(algorithm)[:40]!r} is not "
                              f"known (known: {', '.join(ALGORITHMS)})")
    _check_digests(digests, set(names), ALGORITHMS[algorithm], label)
    return algorithm, digests


def _check_digests(digests: Dict[str, Any], names: Set[str], digits: int, label: str) -> None:
    for name, digest in digests.items():
        if name not in names:
            raise SafetensorError(f"{label}: tensor {name[:80]!r} has a checksum but is not "
                                  f"in the file")
        if type(digest) is not str or len(digest) != digits or not re.fullmatch(HEX, digest):
            raise SafetensorError(f"{label}: tensor {name[:80]!r}: checksum must be "
                                  f"{digits} lowercase hex digits")


def without_checksum(names: Sequence[str], digests: Mapping[str, str]) -> List[str]:
    """The tensors of `names` that `digests` has no checksum for, in file order."""
    return [name for name in names if name not in digests]


def some_tensors(names: Sequence[str]) -> str:
    """'tensor 'a'' or 'tensors 'a', 'b' and 3 more': a few names of a list."""
    shown = ", ".join(repr(name[:80]) for name in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"tensor {shown}" if len(names) == 1 else f"tensors {shown}{more}"


def mismatch(algorithm: str, expected: str, actual: str) -> str:
    return (f"checksum mismatch, the data is corrupt ({algorithm} {actual}, the metadata "
            f"says {expected})")
