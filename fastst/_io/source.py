"""Where a file's bytes are: a local file, a buffer, a binary file object or a URL.

Each kind is a ``Source``: it opens the core's Reader on its bytes, tells which
version of the file it holds (an ``Identity``), reads a small object whole (a
checkpoint's index), names a sibling (a shard beside that index), and takes a
finished file to write. ``as_source`` makes one from whatever the user passed;
nothing above it asks again whether it was given a URL, a file object or a path.
A new kind of place is one class here and one line in ``as_source``.
"""
from __future__ import annotations

import os
import posixpath
import re
import stat
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from .._core import Reader, SafetensorError, WritePlan, file_system_type
from .files import PathLike, write_atomically
from .limits import DEFAULT_BACKEND

if TYPE_CHECKING:
    from .ranged import RangedFetch
    from .upload import SpooledUpload

__all__ = ["Buffer", "FileObject", "Identity", "LocalFile", "NETWORK_FILE_SYSTEMS",
           "NETWORK_READ_THREADS", "Source", "Url", "as_source", "identity_of", "local_version",
           "planned_reading"]

# what may follow a URL scheme's first character, a letter (RFC 3986)
SCHEME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+.-")
NOT_LOCAL = "fsync= and max_shard_size= apply to local paths, not to URLs or file objects"

# File systems whose reads cross a network or a daemon in user space, by statfs f_type
# (linux/magic.h). A map's page faults there wait for a round trip each, one or two
# at a time, where a read plan keeps several large requests in flight (bench/netfs.py).
NETWORK_FILE_SYSTEMS = {
    0x6969: "NFS",
    0x65735546: "FUSE",         # sshfs, virtiofs, s3fs, gcsfuse, GlusterFS...
    0x0BD00BD0: "Lustre",
    0x00C36400: "CephFS",
    0x01021997: "9p",
    0xFF534D42: "CIFS",
    0xFE534D42: "SMB2",
    0x517B: "SMB",
    0x5346414F: "AFS",
    0x6B414653: "kAFS",
    0x73757245: "Coda",
    0x47504653: "GPFS",
}
# the threads a read plan of a file there is shared by, unless read_options sets them:
# they wait on round trips, not on the CPU (bench/netfs.py)
NETWORK_READ_THREADS = 32


# A plain class: a named tuple costs a first open about 0.2 ms to make.
class Identity:
    """One version of a file or object: where it is, and what tells its versions
    apart (a local file's st_dev, st_ino, st_size and st_mtime_ns; an object's
    size, ETag and modification time)."""
    __slots__ = ("location", "version")

    def __init__(self, location: str, version: Tuple[Any, ...]) -> None:
        self.location = location
        self.version = version

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Identity) and self.location == other.location
                and self.version == other.version)

    def __hash__(self) -> int:
        return hash((self.location, self.version))

    def __repr__(self) -> str:
        return f"Identity({self.location!r}, {self.version!r})"

    def changed(self, now: Optional[Identity], what: str, since: str,
                remedy: str) -> SafetensorError:
        """The error for `what` (``"file"``, ``"index"``, ``"shard 'x'"``...) found as
        `now` (None: gone) where this version was seen `since` some event; `remedy`
        says what to do."""
        fields = "device, inode, size, mtime" if self.is_local() else "size, ETag, modified"
        seen_now = "missing" if now is None else now.version
        return SafetensorError(f"{self.location}: {what} changed since {since} ({fields} "
                               f"{self.version}, now {seen_now}); {remedy}")

    def is_local(self) -> bool:
        return not _is_url(self.location)


def local_version(info: os.stat_result) -> Tuple[int, int, int, int]:
    """What tells one version of a local file from another."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def identity_of(reader: Any) -> Optional[Identity]:
    """The version of the file an open handle (a Reader, or any with its
    ``file_identity``) reads; None for a buffer or a file object, which have none."""
    seen = reader.file_identity
    if seen is None:
        return None
    return Identity(os.fsdecode(seen[0]), tuple(seen[1:]))


class Source:
    """Where a safetensors file's bytes are. ``label`` names it in messages."""

    label: str
    backend: str = "ranges"                 # how handles on it read: see ``safe_open``
    local_path: Optional[PathLike] = None   # a local file's (or folder's) path

    def open(self, reader: Reader, *, max_header_size: int) -> None:
        """Open `reader` (a core Reader, or a handle deriving from it) on these bytes."""
        raise NotImplementedError

    def reopen(self, reader: Reader, seen: Identity, *, max_header_size: int, what: str,
               since: str, remedy: str) -> None:
        """Open `reader` again on the version `seen` (by a pickled handle, say): a
        source now holding another version is refused with ``Identity.changed``."""
        raise SafetensorError(f"{self.label}: {self.cannot_reopen()}")

    def cannot_reopen(self) -> str:
        """Why a handle on this source cannot be pickled."""
        return "it cannot be opened again"

    def identity(self) -> Optional[Identity]:
        """The version the source holds now; None where it cannot tell (or the file
        is gone)."""
        return None

    def is_directory(self) -> bool:
        return False

    @property
    def name(self) -> str:
        """The last part of the path or URL."""
        return posixpath.basename(self.label)

    def read_all(self, limit: int, what: str) -> bytes:
        """The whole (small) file, `what` (an index, say); refused past `limit` bytes."""
        raise SafetensorError(f"{self.label}: {what} must be a local file or a URL")

    def sibling(self, name: str) -> Source:
        """The file called `name` in the same folder (a shard beside its index)."""
        raise SafetensorError(f"{self.label}: has no folder to find {name!r} in")

    def write(self, plan: WritePlan, *, fsync: bool = False) -> None:
        """Write the file `plan` lays out here, as a whole."""
        raise SafetensorError(f"{self.label}: cannot be written to")

    def spool(self) -> Optional[SpooledUpload]:
        """Where a file filled in any order (a streaming writer's) is written before
        it comes here: None to write it in place, at a local path."""
        raise TypeError(f"{self.label}: a file filled in pieces is written to a path or a "
                        f"URL, not to a {type(self).__name__}")


class LocalFile(Source):
    """A file (or folder) on a local file system, read by map (``"mmap"``) or by
    ``pread`` into fresh memory (``"pread"``; DEFAULT_BACKEND: ``planned_reading``
    picks), and written atomically."""

    def __init__(self, path: PathLike, backend: str = DEFAULT_BACKEND) -> None:
        self.path = self.local_path = path
        self.label = os.fsdecode(path)
        # where it is whatever the working directory becomes (a pickled handle's)
        self.absolute = os.path.abspath(self.label)
        self.backend, self.threads = planned_reading(self.absolute, backend)

    def __reduce__(self) -> Tuple[Any, ...]:
        return LocalFile, (self.absolute, self.backend)

    def __repr__(self) -> str:
        return f"LocalFile({self.label!r}, {self.backend!r})"

    def open(self, reader: Reader, *, max_header_size: int) -> None:
        reader.open_file(self.path, self.backend, max_header_size=max_header_size,
                         threads=self.threads)

    def reopen(self, reader: Reader, seen: Identity, *, max_header_size: int, what: str,
               since: str, remedy: str) -> None:
        # checked before opening: a file grown since may not even parse within the limit
        now = Identity(self.absolute, local_version(os.stat(self.path)))
        if now.version != seen.version:
            raise seen.changed(now, what, since, remedy)
        self.open(reader, max_header_size=max_header_size)
        opened = identity_of(reader)
        if opened is None or opened.version != seen.version:
            reader.close()
            raise seen.changed(opened, what, since, remedy)

    def identity(self) -> Optional[Identity]:
        try:
            return Identity(self.absolute, local_version(os.stat(self.path)))
        except FileNotFoundError:
            return None

    def is_directory(self) -> bool:
        return os.path.isdir(self.path)

    @property
    def name(self) -> str:
        return os.path.basename(self.label)

    def read_all(self, limit: int, what: str) -> bytes:
        path = self.absolute
        # O_NONBLOCK: a FIFO under the file's name must not wait for a writer
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            status = os.fstat(file.fileno())
            if not stat.S_ISREG(status.st_mode):
                raise SafetensorError(f"{path}: {what} is not a regular file")
            if status.st_size > limit:
                raise SafetensorError(f"{path}: {what} of {status.st_size} bytes exceeds the "
                                      f"limit of {limit} bytes")
            return file.read(limit + 1)

    def sibling(self, name: str) -> LocalFile:
        return LocalFile(os.path.join(os.path.dirname(self.absolute), name), self.backend)

    def write(self, plan: WritePlan, *, fsync: bool = False) -> None:
        write_atomically(plan, self.path, fsync=fsync)

    def spool(self) -> None:
        return None


class Buffer(Source):
    """Bytes in memory (bytes, bytearray, memoryview, mmap), viewed where they lie."""

    backend = "buffer"

    def __init__(self, data: Any) -> None:
        self.data = data
        self.label = "<buffer>"

    @property
    def name(self) -> str:
        return ""    # in no folder

    def open(self, reader: Reader, *, max_header_size: int) -> None:
        reader.open_buffer(self.data, max_header_size=max_header_size)

    def cannot_reopen(self) -> str:
        return "a handle on a buffer cannot be pickled; save the buffer to a file and open that"


class FileObject(Source):
    """A binary file object: read by byte ranges (``seek`` and ``read``), or written
    in order from its position (``write``)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        name = getattr(file, "name", None) or getattr(file, "path", None)
        self.label = name if isinstance(name, str) else f"<{type(file).__name__}>"

    def open(self, reader: Reader, *, max_header_size: int) -> None:
        from .fileobj import FileObjectRanges   # what a file object needs: imported when used

        ranges = FileObjectRanges(self.file, self.label)
        reader.open_ranges(self.label, ranges.size, ranges, max_header_size=max_header_size)

    def cannot_reopen(self) -> str:
        return "a handle on a file object cannot be pickled; open a path or a URL instead"

    @property
    def name(self) -> str:
        return ""    # in no folder

    def write(self, plan: WritePlan, *, fsync: bool = False) -> None:
        if fsync:
            raise SafetensorError(NOT_LOCAL)
        plan.write_stream(self.file, self.label)


class Url(Source):
    """An object that an fsspec URL names (``s3://``, ``gs://``, ``http(s)://``,
    ``memory://``...), with its file system's `storage_options`: read by byte
    ranges, each request holding to the version seen at opening (see
    ``fastst.remote``), and written by an upload. Its `label` is the URL with its
    credentials hidden (``fastst._io.ranged.shown_url``), as messages, reprs and
    reports show it."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None) -> None:
        from .ranged import shown_url   # the transport's: imported when a URL is named

        self.url, self.label = url, shown_url(url)
        self.storage_options: Optional[Dict[str, Any]] = (
            dict(storage_options) if storage_options else None)

    def __reduce__(self) -> Tuple[Any, ...]:
        return Url, (self.url, self.storage_options)

    def __repr__(self) -> str:
        return f"Url({self.label!r})"

    def _ranges(self) -> RangedFetch:
        from .transports import open_object   # a transport: imported when a URL is opened

        return open_object(self.url, self.storage_options)

    def open(self, reader: Reader, *, max_header_size: int) -> None:
        self._open_on(self._ranges(), reader, max_header_size)

    def _open_on(self, ranges: RangedFetch, reader: Reader, max_header_size: int) -> None:
        reader.open_ranges(self.label, ranges.size, ranges, max_header_size=max_header_size,
                           identity=ranges.identity)

    def reopen(self, reader: Reader, seen: Identity, *, max_header_size: int, what: str,
               since: str, remedy: str) -> None:
        ranges = self._ranges()   # asks the store for the object's version first
        now = Identity(self.label, tuple(ranges.identity[1:]))
        if now.version != seen.version:
            raise seen.changed(now, what, since, remedy)
        self._open_on(ranges, reader, max_header_size)

    def identity(self) -> Optional[Identity]:
        try:
            ranges = self._ranges()
        except FileNotFoundError:
            return None
        return Identity(self.label, tuple(ranges.identity[1:]))

    def read_all(self, limit: int, what: str) -> bytes:
        from .transports import read_object

        return read_object(self.url, self.storage_options, limit, what)

    @property
    def name(self) -> str:
        return self._folder_and_name()[1]

    def sibling(self, name: str) -> Url:
        return Url(f"{self._folder_and_name()[0]}/{name}", self.storage_options)

    def _folder_and_name(self) -> Tuple[str, str]:
        """The URL of the object's folder, and the object's name: its path cut at the
        last "/", without a query or a fragment, which belong to the object named
        (a presigned URL's, a download flag)."""
        scheme, rest = self.url.split("://", 1)
        folder, name = posixpath.split(re.split(r"[?#]", rest, maxsplit=1)[0])
        return f"{scheme}://{folder}", name

    def write(self, plan: WritePlan, *, fsync: bool = False) -> None:
        if fsync:
            raise SafetensorError(NOT_LOCAL)
        from .upload import save_plan   # fsspec: imported when a URL is written

        save_plan(plan, self.url, self.storage_options)

    def spool(self) -> SpooledUpload:
        from .upload import SpooledUpload

        return SpooledUpload(self.url, self.storage_options)


def planned_reading(path: str, backend: str) -> Tuple[str, int]:
    """How a local file (or a folder's files) is read: the backend (the caller's;
    for DEFAULT_BACKEND, ``"pread"`` on a network file system, ``NETWORK_FILE_SYSTEMS``, and
    ``"mmap"`` elsewhere or where the file system cannot be told, as for a path not
    there yet, which opening reports), and the threads its read plans are shared by
    where ``read_options`` sets none (``NETWORK_READ_THREADS`` on a network file
    system; 0 elsewhere, for ``read_threads()``)."""
    try:
        network = file_system_type(path) in NETWORK_FILE_SYSTEMS
    except (OSError, ValueError):
        network = False
    if backend is DEFAULT_BACKEND:
        backend = "pread" if network else "mmap"
    return backend, NETWORK_READ_THREADS if network else 0


def as_source(target: Any, storage_options: Optional[Mapping[str, Any]] = None, *,
              backend: str = DEFAULT_BACKEND, writing: bool = False) -> Source:
    """The Source a user's `target` names: a URL string (with its fsspec
    `storage_options`), a path (str, bytes, os.PathLike; read with `backend`, or
    as ``planned_reading`` picks for DEFAULT_BACKEND), or a binary file object (one with
    ``seek`` and ``read``; for `writing`, one with ``write``). A Source is taken
    as it is."""
    if isinstance(target, Source):
        return target
    if isinstance(target, str) and _is_url(target):
        return Url(target, storage_options)
    if isinstance(target, (str, bytes, os.PathLike)):
        source: Source = LocalFile(target, backend)
    elif _is_file_object(target, writing):
        source = FileObject(target)
    else:
        kind = "a writable binary file object" if writing else \
            "a binary file object (with seek and read)"
        raise TypeError(f"expected a path, a URL or {kind}, got {type(target).__name__}")
    if storage_options:
        raise SafetensorError(f"storage_options apply to URLs only, not to "
                              f"{_shown_target(target)}")
    return source


def _is_url(text: str) -> bool:
    """Whether `text` is ``scheme://...``, for fsspec. Told without a regular
    expression, whose compiling every process that opens a file would pay."""
    scheme, separator, _ = text.partition("://")
    return bool(separator) and scheme[:1].isalpha() and set(scheme) <= SCHEME_CHARACTERS


def _is_file_object(target: Any, writing: bool) -> bool:
    needed = ("write",) if writing else ("seek", "read")
    return all(callable(getattr(target, method, None)) for method in needed)


def _shown_target(target: Any) -> str:
    if isinstance(target, (str, bytes, os.PathLike)):
        return f"the path {os.fsdecode(target)!r}"
    return f"a {type(target).__name__}"
