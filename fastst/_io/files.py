"""Files on disk: atomic replacement, preallocation, fsync and bounded copies,
with the platform calls guarded."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import Iterator, Optional, Union

from .._core import WritePlan

PathLike = Union[str, bytes, os.PathLike[str], os.PathLike[bytes]]
TEMP_SUFFIX = ".fastst-tmp"
COPY_BLOCK = 16 << 20   # bytes a copy holds in memory at once, where the kernel cannot copy


class AtomicFile:
    """A new file of `size` bytes written beside `filename` under a temporary name
    (``.<name>.<random>.fastst-tmp``), preallocated, and renamed over `filename` by
    `commit`: readers see the old file or the new one, never a mix. `abort` (or a
    failed commit) removes it and leaves any old file as it was.

    The new file keeps the permission bits (``0o777``) of the file it replaces,
    as a save that writes in place would; a file that replaces none takes those
    of `mode_of` when that file exists, else what ``open()`` gives (``0o666``
    less the umask). While it is written, a file that will take a mode is
    readable by its owner alone. With `follow_symlinks` (the default) a symlink
    at `filename` is written through: the file it points to is replaced;
    without, the symlink itself is."""

    def __init__(self, filename: PathLike, size: int, *, follow_symlinks: bool = True,
                 mode_of: Optional[str] = None) -> None:
        text = os.fsdecode(filename)
        self.target = os.path.realpath(text) if follow_symlinks else os.path.abspath(text)
        directory, base = os.path.split(self.target)
        self.directory = directory
        self.mode_of = mode_of
        self.synced = False
        self.temp = os.path.join(directory, f".{base}.{os.urandom(4).hex()}{TEMP_SUFFIX}")
        private = any(os.path.exists(path) for path in (self.target, mode_of) if path)
        self.fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                          0o600 if private else 0o666)
        try:
            with naming(self.target, f"reserving {size} bytes"):
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
        file.mode_of, file.synced = None, False
        return file

    def finish(self, *, fsync: bool = False) -> None:
        """Close the file, written (flushed to disk first with `fsync`), to commit
        later: a writer of many files holds no descriptor for each."""
        if self.fd >= 0:
            if fsync:
                self._flush()
            os.close(self.fd)
            self.fd = -1

    def commit(self, *, fsync: bool = False) -> None:
        """Close the file and rename it over the target. With `fsync` the file and
        its directory are flushed to disk first, so the new file also survives a
        power loss."""
        try:
            self._take_mode()
            if fsync and not self.synced:
                self._flush()
            self.finish()
            os.replace(self.temp, self.target)
        except BaseException:
            self.abort()
            raise
        if fsync:
            fsync_path(self.directory)

    def _flush(self) -> None:
        if self.fd >= 0:
            with naming(self.target, "flushing it to disk"):
                os.fsync(self.fd)
        else:
            fsync_path(self.temp)
        self.synced = True

    def _take_mode(self) -> None:
        """Give the file the permission bits of the one it replaces (see the class)."""
        for path in (self.target, self.mode_of):
            if path is None:
                continue
            try:
                mode = stat.S_IMODE(os.stat(path).st_mode) & 0o777
            except FileNotFoundError:
                continue
            if self.fd >= 0:
                os.fchmod(self.fd, mode)
            else:
                os.chmod(self.temp, mode)
            return

    def abort(self) -> None:
        """Close and remove the temporary file (again: nothing happens)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.temp)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def naming(path: str, doing: str) -> Iterator[None]:
    """Give an OSError raised within, that names no file (a full disk, a failed
    flush), the file `path` and what was being done to it."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, f"{error.strerror} ({doing})", path) from None


def write_atomically(plan: WritePlan, filename: PathLike, *, fsync: bool = False) -> None:
    """Write a `WritePlan` to `filename`, atomically.

    The file is written beside the target under a temporary name
    (``.<name>.<random>.fastst-tmp``) and renamed over it, so readers see the
    old file or the new one, never a mix, and a failed save leaves the old
    file as it was; the new file keeps the old one's permission bits. What
    ``fastst.save_file`` does with its plan.

    Parameters
    ----------
    plan : WritePlan
        The file to write (see ``plan_write``); every tensor must have data.
    filename : str or bytes or os.PathLike
        The file to write.
    fsync : bool, default False
        Flush the file and its directory to disk before returning, so that
        the new file also survives a power loss.

    Raises
    ------
    OSError
        When the file cannot be written (the temporary file is removed).
    SafetensorError
        When the plan declares tensors without data.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.writer import plan_write, spec_of_array, write_atomically
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> write_atomically(plan_write([spec_of_array("x", np.ones(2))], None), path)
    >>> fastst.load_file(path)["x"].tolist()
    [1.0, 1.0]
    """
    file = AtomicFile(filename, plan.total_size)
    try:
        plan.write_to(file.fd, file.target)
    except BaseException:
        file.abort()
        raise
    file.commit(fsync=fsync)


def write_text_atomically(text: str, filename: PathLike, *, fsync: bool = False,
                          follow_symlinks: bool = True) -> None:
    """Write `text` (UTF-8) to `filename` as ``write_atomically`` writes a file."""
    file = AtomicFile(filename, 0, follow_symlinks=follow_symlinks)
    try:
        data = memoryview(text.encode("utf-8"))
        with naming(file.target, f"writing {len(data)} bytes"):
            while data:
                data = data[os.write(file.fd, data):]
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
        with naming(path or ".", "flushing it to disk"):
            os.fsync(fd)
    finally:
        os.close(fd)
