"""Files on disk: atomic replacement, preallocation, fsync and bounded copies,
with the platform calls guarded."""
from __future__ import annotations

import errno
import os
from typing import Union

from ._core import WritePlan

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
TEMP_SUFFIX = ".fastst-tmp"
COPY_BLOCK = 16 << 20   # bytes a copy holds in memory at once, where the kernel cannot copy


class AtomicFile:
    """A new file of `size` bytes written beside `filename` under a temporary name
    (``.<name>.<random>.fastst-tmp``), preallocated, and renamed over `filename` by
    `commit`: readers see the old file or the new one, never a mix. `abort` (or a
    failed commit) removes it and leaves any old file as it was."""

    def __init__(self, filename: PathLike, size: int) -> None:
        self.target = os.path.realpath(os.fsdecode(filename))  # through symlinks: replace their target
        directory, base = os.path.split(self.target)
        self.directory = directory
        self.temp = os.path.join(directory, f".{base}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
        self.fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            _preallocate(self.fd, size)
        except BaseException:
            self.abort()
            raise

    @classmethod
    def written(cls, temp: str, target: str) -> AtomicFile:
        """The AtomicFile of a temporary file `temp` already written and closed
        (by another process, say), to commit over `target` or abort."""
        file = cls.__new__(cls)
        file.target, file.temp, file.fd = target, temp, -1
        file.directory = os.path.dirname(target)
        return file

    def commit(self, *, fsync: bool = False) -> None:
        """Close the file and rename it over the target. With `fsync` the file and
        its directory are flushed to disk first, so the new file also survives a
        power loss."""
        try:
            if self.fd >= 0:
                if fsync:
                    os.fsync(self.fd)
                os.close(self.fd)
                self.fd = -1
            elif fsync:
                fsync_path(self.temp)
            os.replace(self.temp, self.target)
        except BaseException:
            self.abort()
            raise
        if fsync:
            fsync_path(self.directory)

    def abort(self) -> None:
        """Close and remove the temporary file (again: nothing happens)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


def write_atomically(plan: WritePlan, filename: PathLike, *, fsync: bool = False) -> None:
    """Write a WritePlan to `filename` atomically.

    The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the old
    file or the new one, never a mix, and a failed save leaves the old file as it
    was. With `fsync` the file and its directory are flushed to disk before
    returning, so the new file also survives a power loss.
    """
    file = AtomicFile(filename, plan.total_size)
    try:
        plan.write_to(file.fd, file.target)
    except BaseException:
        file.abort()
        raise
    file.commit(fsync=fsync)


def copy_range(source_fd: int, source_offset: int, dest_fd: int, dest_offset: int,
               length: int) -> None:
    """Copy `length` bytes between two files at the given offsets, in the kernel
    where it can (copy_file_range), else through one bounded buffer."""
    if hasattr(os, "copy_file_range"):
        try:
            while length > 0:
                copied = os.copy_file_range(source_fd, dest_fd, min(length, 1 << 30),
                                            source_offset, dest_offset)
                if copied == 0:
                    raise OSError(errno.EIO, "the source file ended early")
                source_offset += copied
                dest_offset += copied
                length -= copied
            return
        except OSError as error:
            if error.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
    _copy_through_buffer(source_fd, source_offset, dest_fd, dest_offset, length)


def _copy_through_buffer(source_fd: int, source_offset: int, dest_fd: int, dest_offset: int,
                         length: int) -> None:
    buffer = bytearray(min(length, COPY_BLOCK))
    view = memoryview(buffer)
    while length > 0:
        count = os.preadv(source_fd, [view[:min(length, len(buffer))]], source_offset)
        if count == 0:
            raise OSError(errno.EIO, "the source file ended early")
        written = 0
        while written < count:
            written += os.pwrite(dest_fd, view[written:count], dest_offset + written)
        source_offset += count
        dest_offset += count
        length -= count


def _preallocate(fd: int, size: int) -> None:
    # Reserves the blocks up front: a full disk fails here, before any data is written.
    # Where that cannot be done (macOS, some file systems) the file is only sized,
    # so that pieces can land anywhere in it, and a full disk shows on the writes.
    if size <= 0:
        return
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except OSError as error:
            if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
    os.ftruncate(fd, size)


def fsync_path(path: str) -> None:
    """Flush the file or directory at `path` to disk."""
    fd = os.open(path or ".", os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
