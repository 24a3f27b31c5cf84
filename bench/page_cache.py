"""The page cache, for the cold runs of the benchmarks: a file's pages dropped with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed). It imports nothing beyond the
standard library."""
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
