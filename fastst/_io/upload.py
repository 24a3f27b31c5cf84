"""Writing to a URL: a plan streamed up (`save_plan`: an S3 multipart upload, a staged
upload where the store stages, one put elsewhere), and `SpooledUpload`, a local spool
file that is sent up whole when it is complete."""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple

from .._core import SafetensorError, WritePlan
from .files import write_atomically
from .fsspec import S3_PROTOCOLS, file_system_of, protocols_of
from .ranged import Limits, read_limits, shown_url, translated

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped, unused-ignore]

# Stores whose files honour autocommit=False: the object appears at commit, and
# discard leaves the previous one. Elsewhere a save is one put of the whole file.
STAGED_PROTOCOLS = ("s3", "s3a", "gs", "gcs")


def save_plan(plan: WritePlan, target: str,
              storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Write a `WritePlan` to a URL: what ``save_file`` does for one.

    On S3 and Google Cloud Storage the file is streamed up in parts and the
    object appears only once complete; a failed save aborts the upload and
    leaves the previous object. On S3 the parts (``part_size`` bytes, 5 MiB at
    least, larger for a file that would need more than S3's 10,000, and then
    fewer at once) go ``max_concurrency`` at once, each cut from the tensors
    while those before it are sent. A ``file://`` URL is written as
    ``save_file`` writes a path (atomically). On other stores the file is put
    whole in one call (atomic where the store's put is).

    Parameters
    ----------
    plan : WritePlan
        The file to write; every tensor must have data.
    target : str
        An fsspec URL.
    storage_options : mapping, optional
        The options of its fsspec file system.

    Raises
    ------
    OSError
        When the store fails (`PermissionError`, `FileNotFoundError` as it
        gives them; `TimeoutError` when it does not answer in time).
    ImportError
        When fsspec, or the package its protocol needs, is not installed.

    Examples
    --------
    >>> import numpy as np, fastst, fsspec
    >>> from fastst.remote import save_plan
    >>> from fastst.writer import plan_write, spec_of_array
    >>> save_plan(plan_write([spec_of_array("y", np.ones(2))], None), "memory://docs/y.safetensors")
    >>> fastst.load_file("memory://docs/y.safetensors")
    {'y': array([1., 1.])}
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """
    options = dict(storage_options or {})
    fs, path = file_system_of(target, options)
    limits = read_limits(target, options)
    try:
        if is_local(fs):
            write_atomically(plan, path)
        elif (protocols_of(fs) & set(S3_PROTOCOLS)
              and plan.total_size > _MultipartUpload.part_size_for(limits, plan.total_size)):
            upload = _MultipartUpload(fs, path, limits, plan.total_size)
            upload.send(lambda file: plan.write_stream(file, shown_url(target)))
        elif is_staged(fs):
            _upload_staged(fs, path, lambda file: plan.write_stream(file, shown_url(target)))
        else:
            fs.pipe_file(path, plan.to_bytes())
    except SafetensorError:
        raise
    except Exception as error:
        raise translated(error, target, "saving")


class _MultipartUpload:
    """A file of `size` bytes written in order into an S3 multipart upload: ``write``
    fills parts of `part_size_for(limits, size)` bytes and sends each as it fills,
    while the next one fills, at most ``limits.max_requests`` in flight (fewer where
    the parts had to grow: a write waits for room, so that no more than
    ``max_requests`` parts of ``part_size`` bytes are held in memory), each within
    ``limits.seconds_for`` its bytes, retries included. Of a part sent it keeps its
    ETag alone. The object appears when the upload completes; until then, and when
    it is aborted, the object stays as it was.

    Parameters
    ----------
    fs : s3fs.S3FileSystem
        The file system (its event loop carries the requests).
    path : str
        The object's bucket and key.
    limits : Limits
        The bounds of the upload (see `read_limits`).
    size : int
        The file's bytes.
    """

    @staticmethod
    def part_size_for(limits: Limits, size: int) -> int:
        """Bytes a part: ``part_size``, but 5 MiB at least (S3 refuses smaller parts
        but for an upload's last), and more where `size` bytes would need more than
        the `MAX_S3_PARTS` that S3 takes."""
        return max(limits.part_size, SMALLEST_S3_PART, -(-size // MAX_S3_PARTS))

    def __init__(self, fs: Any, path: str, limits: Limits, size: int) -> None:
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size = self.part_size_for(limits, size)
        allowed_bytes = limits.max_requests * max(limits.part_size, SMALLEST_S3_PART)
        self.at_once = max(1, allowed_bytes // self.part_size)
        self.seconds = limits.seconds_for(self.part_size)
        self.part = bytearray(self.part_size)
        self.filled = 0
        self.etags: List[Optional[str]] = []   # a part's, once S3 took it
        self.in_flight: Dict[Any, int] = {}    # the future of a part sending, its index
        self.upload_id: Optional[str] = None

    def send(self, write: Callable[[Any], Any]) -> None:
        """Start the upload, `write(self)` the file into it, and complete it: the
        object appears then. Whatever fails on the way (a part, the write) aborts
        the upload, once every part in flight has ended."""
        self.upload_id = self._call("create_multipart_upload")["UploadId"]
        try:
            write(self)
            if self.filled or not self.etags:
                self._send_part(self.part[:self.filled])
            self._settle(0)
            parts = [{"PartNumber": number, "ETag": etag}
                     for number, etag in enumerate(self.etags, 1)]
            self._call("complete_multipart_upload", UploadId=self.upload_id,
                       MultipartUpload={"Parts": parts})
        except BaseException:
            self._abort()
            raise

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            piece = view[:self.part_size - self.filled]
            self.part[self.filled:self.filled + piece.nbytes] = piece
            self.filled += piece.nbytes
            view = view[piece.nbytes:]
            if self.filled == self.part_size:
                self._send_part(self.part)
                self.filled = 0

    def _send_part(self, part: bytearray) -> None:
        """Send `part` (copied: the part being filled is reused) once fewer than
        `at_once` are in flight."""
        import asyncio
        import io

        self._settle(self.at_once - 1)
        # a stream, not bytes: aiohttp sends a bytes body in one write that holds its loop
        body = io.BytesIO(bytes(part))
        request = self.fs._call_s3("upload_part", Bucket=self.bucket, Key=self.key,
                                   UploadId=self.upload_id, PartNumber=len(self.etags) + 1,
                                   Body=body)
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(request, self.seconds),
                                                  self.fs.loop)
        self.in_flight[future] = len(self.etags)
        self.etags.append(None)

    def _settle(self, most: int) -> None:
        """Wait until at most `most` parts are in flight, keeping the ETag of each
        that ended; a part that failed raises, which ends the upload."""
        import concurrent.futures

        while True:
            for future in [future for future in self.in_flight if future.done()]:
                self.etags[self.in_flight.pop(future)] = future.result()["ETag"]
            if len(self.in_flight) <= most:
                return
            concurrent.futures.wait(self.in_flight, return_when=concurrent.futures.FIRST_COMPLETED)

    def _abort(self) -> None:
        import concurrent.futures

        concurrent.futures.wait(self.in_flight)     # each bounded by its deadline
        self._call("abort_multipart_upload", UploadId=self.upload_id)

    def _call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync  # type: ignore[import-untyped, unused-ignore]

        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=self.bucket,
                    Key=self.key, **kwargs)


class SpooledUpload:
    """A file for a URL, written on local disk first and uploaded when complete.

    For the streaming writer, which fills its file in any order, which an
    upload cannot take. `path` is where to write the file; `upload` sends it,
    as ``save_file`` sends a file (in parts where the store stages uploads, so
    the object appears whole or not at all; on S3 a multipart upload whose
    parts go at once, ``max_concurrency`` of them, each ``part_size`` bytes and
    at least 5 MiB), and removes it; `discard`
    removes it. A ``file://`` URL is written in place, with no spool. The
    spool lies in ``tempfile.gettempdir()`` (``TMPDIR``), which needs room
    for the file. A spool is locked (``flock``) while its process lives: the
    spools of processes that ended without removing theirs (killed) are
    removed by the next SpooledUpload.

    Parameters
    ----------
    url : str
        The fsspec URL to upload to.
    storage_options : mapping, optional
        The options of its fsspec file system.

    Attributes
    ----------
    path : str
        The local file to write.
    url : str
        Where it goes.
    label : str
        The URL as messages show it, its credentials hidden.

    Examples
    --------
    >>> import numpy as np, fastst, fsspec
    >>> from fastst.remote import SpooledUpload
    >>> upload = SpooledUpload("memory://docs/z.safetensors", None)
    >>> fastst.save_file({"z": np.zeros(1)}, upload.path)     # on local disk
    >>> upload.upload()
    >>> fastst.load_file("memory://docs/z.safetensors")
    {'z': array([0.])}
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """

    __module__ = "fastst.remote"

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        self.url, self.label = url, shown_url(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.remote_path = file_system_of(url, self.storage_options)
        self.spool: Optional[str] = None
        if is_local(self.fs):
            self.path = self.remote_path
        else:
            _remove_abandoned_spools()
            self.spool, self._lock = _locked_spool()
            self.path = os.path.join(self.spool, os.path.basename(self.remote_path)
                                     or "upload.safetensors")

    def upload(self) -> None:
        """Send the file to the URL, then remove the local spool (also when the
        upload fails). Does nothing for a ``file://`` URL, written in place.

        Raises
        ------
        OSError
            When the store fails (`TimeoutError` when it does not answer in
            time); a staged upload leaves the previous object.
        """
        if self.spool is None:
            return
        try:
            if protocols_of(self.fs) & set(S3_PROTOCOLS):
                self.upload_in_parts()
            elif is_staged(self.fs):
                with open(self.path, "rb") as local:
                    _upload_staged(self.fs, self.remote_path,
                                   lambda file: shutil.copyfileobj(local, file, UPLOAD_PIECE))
            else:
                self.fs.put_file(self.path, self.remote_path)
        except SafetensorError:
            raise
        except Exception as error:
            raise translated(error, self.url, "uploading")
        finally:
            self.discard()

    def upload_in_parts(self) -> None:
        """Send the file to S3 as a multipart upload, ``max_concurrency`` parts at
        once, as ``save_file`` sends one (the upload is aborted when a part fails:
        the previous object stays until the upload completes)."""
        with open(self.path, "rb") as local:
            upload = _MultipartUpload(self.fs, self.remote_path,
                                      read_limits(self.url, self.storage_options),
                                      os.fstat(local.fileno()).st_size)
            upload.send(lambda into: shutil.copyfileobj(local, into, UPLOAD_PIECE))

    def discard(self) -> None:
        """Remove the local spool without uploading it; again does nothing."""
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
            os.close(self._lock)    # removed first: no later upload takes it for abandoned
            self.spool = None


UPLOAD_PIECE = 16 << 20   # bytes a spooled file is uploaded by
SMALLEST_S3_PART = 5 << 20   # S3 refuses smaller parts, but for an upload's last
MAX_S3_PARTS = 10_000        # S3 refuses more parts in one upload
SPOOL_PREFIX, SPOOL_SUFFIX = "fastst-upload-", ".locked"
SPOOL_ATTEMPTS = 8   # spools made in turn while other uploads remove them as abandoned


def _locked_spool() -> Tuple[str, int]:
    """A new spool folder in ``tempfile.gettempdir()`` and a descriptor of it that
    holds its lock (``flock``): the kernel lets go of the lock when the process
    ends, however it ends, which tells later uploads that the folder is abandoned.
    Where the file system has no locks the folder is never taken for abandoned."""
    for _ in range(SPOOL_ATTEMPTS):
        spool = tempfile.mkdtemp(prefix=SPOOL_PREFIX, suffix=SPOOL_SUFFIX)
        try:
            lock = os.open(spool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue     # taken for abandoned, still unlocked, and removed
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)    # taken for abandoned: the upload that locked it removes it
            continue
        except OSError:
            pass
        if _is_open_as(spool, lock):
            return spool, lock
        os.close(lock)
    raise OSError(errno.EAGAIN, f"no spool folder in {tempfile.gettempdir()} stayed ours: "
                                f"other uploads removed {SPOOL_ATTEMPTS} in turn")


def _is_open_as(path: str, fd: int) -> bool:
    try:
        return os.path.samestat(os.stat(path, follow_symlinks=False), os.fstat(fd))
    except FileNotFoundError:
        return False


def _remove_abandoned_spools() -> None:
    """Remove the spool folders in ``tempfile.gettempdir()`` that this user's
    uploads left when their process ended without removing them (killed): those
    whose lock no process holds."""
    try:
        entries = list(os.scandir(tempfile.gettempdir()))
    except OSError:
        return
    for entry in entries:
        if (entry.name.startswith(SPOOL_PREFIX) and entry.name.endswith(SPOOL_SUFFIX)
                and entry.is_dir(follow_symlinks=False)):
            _remove_if_abandoned(entry.path)


def _remove_if_abandoned(spool: str) -> None:
    try:
        lock = os.open(spool, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return     # gone, or another user's
    try:
        if os.fstat(lock).st_uid != os.getuid():
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return     # its upload is alive (or the file system has no locks)
        shutil.rmtree(spool, ignore_errors=True)
    finally:
        os.close(lock)


def is_local(fs: AbstractFileSystem) -> bool:
    return bool(protocols_of(fs) & {"file", "local"})


def is_staged(fs: AbstractFileSystem) -> bool:
    return bool(protocols_of(fs) & set(STAGED_PROTOCOLS))


def _upload_staged(fs: AbstractFileSystem, path: str, write: Callable[[Any], Any]) -> None:
    """`write(file)` into an upload of `path` that is committed when it returns and
    discarded when it raises: the object appears whole or not at all."""
    file = fs.open(path, "wb", autocommit=False)
    try:
        write(file)
        file.close()
        file.commit()
    except BaseException:
        file.discard()
        file.closed = True   # discarded: closing it later must not upload what it held
        raise
