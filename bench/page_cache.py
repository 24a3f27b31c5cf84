"""The page cache, for the cold runs of the benchmarks: a file's pages dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed), and the bytes read from the
disk into it. It imports nothing beyond the standard library."""
from __future__ import annotations

import os


def drop_pages(path: str) -> None:
    """Write the file's dirty pages back, then drop all its pages from the page cache
    (pages that a process still maps stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_bytes() -> int:
    """Bytes this process has had read from storage so far (read_bytes of
    /proc/self/io; 0 where the file system reads no disk, as a tmpfs)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0
