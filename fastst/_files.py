"""Files on disk: atomic replacement, preallocation and fsync, with the
platform calls guarded."""
from __future__ import annotations

import errno
import os
from typing import Union

from ._core import WritePlan

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
TEMP_SUFFIX = ".fastst-tmp"


def write_atomically(plan: WritePlan, filename: PathLike, *, fsync: bool = False) -> None:
    """Write a WritePlan to `filename` atomically.

    The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the old
    file or the new one, never a mix, and a failed save leaves the old file as it
    was. With `fsync` the file and its directory are flushed to disk before
    returning, so the new file also survives a power loss.
    """
    target = os.path.realpath(os.fsdecode(filename))  # through symlinks: replace their target
    directory, base = os.path.split(target)
    temp = os.path.join(directory, f".{base}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        try:
            _preallocate(fd, plan.total_size)
            plan.write_to(fd, target)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, target)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    if fsync:
        _fsync_directory(directory)


def _preallocate(fd: int, size: int) -> None:
    # Reserves the blocks up front: a full disk fails here, before any data is written.
    # macOS has no posix_fallocate: there the write itself reports a full disk.
    if size > 0 and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
