"""What the tests read of memory, the page cache and descriptors: the bytes of a file's
mappings that this process has in memory, the pages of a file the page cache holds, a
file's pages dropped from it, the bytes the process has read from storage and its write
calls, and the descriptors it holds open (Linux's /proc/self/smaps, mincore, posix_fadvise,
/proc/self/io and /proc/self/fd)."""
from __future__ import annotations

import ctypes
import mmap
import os

import pytest


def resident_bytes(path) -> int:
    """Bytes of `path`'s mappings in this process that are in memory (pages mapped)."""
    return mapped_bytes(path, "Rss:")


def pmd_mapped_bytes(path) -> int:
    """Bytes of `path`'s mappings in this process mapped by 2 MiB entries (a page
    cache folio of 2 MiB, mapped whole)."""
    return mapped_bytes(path, "FilePmdMapped:")


def map_flags(path) -> set:
    """The flags of `path`'s mappings in this process (VmFlags in /proc/self/smaps: "rr"
    for one advised MADV_RANDOM, "hg" MADV_HUGEPAGE), those of any of them."""
    return {flag for values in smaps_values(path, "VmFlags:") for flag in values}


def flags_of_memory_at(address: int) -> set:
    """The flags (VmFlags in /proc/self/smaps) of the mapping of this process that
    holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return set(fields[1:])
    raise LookupError(f"no mapping holds {address:#x}")


def mapped_bytes(path, field: str) -> int:
    """The sum of a field of /proc/self/smaps (in kB there) over `path`'s mappings."""
    return sum(int(values[0]) << 10 for values in smaps_values(path, field))


def smaps_values(path, field: str):
    """The values of a field of /proc/self/smaps (the words after its name), one
    list a mapping of `path`."""
    target, inside = os.path.realpath(path), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):          # a mapping's first line
                inside = len(fields) == 6 and fields[5] == target
            elif inside and fields[0] == field:
                yield fields[1:]


def cached_pages(path, begin: int = 0, end: int = -1) -> int:
    """Pages of the file in the page cache (mincore over a map of it), of those that
    hold its bytes [begin, end) (-1: to its end)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vector = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        try:
            assert libc.mincore(address, size, vector) == 0
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    end = size if end < 0 else min(end, size)
    pages = vector.raw[begin // mmap.PAGESIZE:-(-end // mmap.PAGESIZE)]
    return sum(byte & 1 for byte in pages)


def drop_or_skip(path) -> None:
    """Drop the file's pages from the page cache, or skip the test where the file
    system keeps them."""
    if not dropped_from_page_cache(path):
        pytest.skip("this file system keeps the file in the page cache")


def read_bytes() -> int:
    """Bytes this process (all its threads) has had read from storage so far, into the
    page cache or past it (Linux's /proc/self/io)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("read_bytes:"))


def write_calls() -> int:
    """Write calls (write, writev, pwrite...) this process (all its threads) has made
    so far (Linux's /proc/self/io)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("syscw:"))


def dropped_from_page_cache(path) -> bool:
    """Write the file back and drop its pages from the page cache: whether none is left
    there (a tmpfs keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_pages(path) == 0


def open_descriptors() -> dict:
    """This process's open descriptors, each with what it points to.

    Compare these rather than counts: other tests' threads (an HTTP client's pool, a
    cluster's) may close descriptors of their own at any time."""
    described = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            described[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:     # closed since it was listed (the listing's own, for one)
            pass
    return described


def opened_since(before: dict) -> dict:
    """The descriptors open now that were not open at `before` (an `open_descriptors()`)."""
    return {fd: target for fd, target in open_descriptors().items()
            if before.get(fd) != target}


def descriptors_on(*paths) -> int:
    """The process's descriptors open on any of `paths`."""
    names = {str(path) for path in paths}
    return sum(target in names for target in open_descriptors().values())
