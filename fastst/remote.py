"""File objects and fsspec URLs as safetensors files: the header first, then only the
byte ranges asked for, and uploads of whole files to URLs.

The Sources of ``fastst._source`` come here for a binary file object or a URL
(``s3://``, ``gs://``, ``http(s)://``, ``memory://``...); nothing here is
imported by ``import fastst``, and fsspec (with s3fs or aiohttp behind it) only when
a URL is opened. The compiled Reader does the rest (``Reader.open_ranges``): it reads
the prefix and header in one request (two for a header over 64 KiB), coalesces the
byte ranges of neighbouring tensors, cuts big ones into parts fetched in parallel,
and checks that every range came back whole.

A URL is read with a precondition where the store has one: S3 reads carry
``If-Match: <ETag>`` (through s3fs) and HTTP reads the ``If-Match`` header, so an
object replaced after it was opened gives a ``SafetensorError``, never a mix of two
versions. Other stores are checked for length only.
"""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ._core import SafetensorError, WritePlan
from ._files import write_atomically

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped, unused-ignore]

__all__ = ["CONNECT_TIMEOUT", "MAX_REQUESTS", "READ_TIMEOUT", "FileObjectRanges", "SpooledUpload",
           "UrlRanges", "read_object", "save_plan", "with_default_timeouts"]

CONNECT_TIMEOUT = 10.0   # seconds to connect to a store, unless storage_options say otherwise
READ_TIMEOUT = 60.0      # seconds a store may stay silent while answering a request
SLOWEST_RATE = 256 << 10   # bytes a second below which a call's answer counts as stalled
MAX_REQUESTS = 16        # requests a URL's reader keeps in flight at once
HTTP_PROTOCOLS = ("http", "https")
S3_PROTOCOLS = ("s3", "s3a")
# Stores whose files honour autocommit=False: the object appears at commit, and
# discard leaves the previous one. Elsewhere a save is one put of the whole file.
STAGED_PROTOCOLS = ("s3", "s3a", "gs", "gcs")
Range = Tuple[int, int]


def read_object(url: str, storage_options: Optional[Mapping[str, Any]], limit: int,
                what: str) -> bytes:
    """The whole (small) object at `url`: a checkpoint's index, say; refused when
    it is larger than `limit` bytes."""
    ranges = UrlRanges(url, storage_options)
    if ranges.size > limit:
        raise SafetensorError(f"{url}: {what} of {ranges.size} bytes exceeds the limit of "
                              f"{limit} bytes")
    if ranges.size == 0:
        return b""
    (data,) = ranges([(0, ranges.size)])
    if len(data) != ranges.size:
        raise SafetensorError(f"{url}: {what}: the store answered {len(data)} bytes of "
                              f"{ranges.size} (a short read)")
    return bytes(data)


# ---------------------------------------------------------------------------
# File objects
# ---------------------------------------------------------------------------


class FileObjectRanges:
    """Byte ranges of a binary file object, read one at a time under a lock (the
    object has one position); ``readinto`` is used where the object has it."""

    def __init__(self, file: Any) -> None:
        self.file = file
        name = getattr(file, "name", None) or getattr(file, "path", None)
        self.source = name if isinstance(name, str) else f"<{type(file).__name__}>"
        self.lock = threading.Lock()
        self.readinto = getattr(file, "readinto", None)
        try:
            end = file.seek(0, os.SEEK_END)
            self.size = end if isinstance(end, int) else file.tell()
        except (OSError, ValueError) as error:   # a pipe, a socket, a closed file
            raise SafetensorError(f"{self.source}: a file object is read by byte ranges and "
                                  f"must be open and seekable ({error})") from None

    def __call__(self, ranges: Sequence[Range]) -> List[Any]:
        with self.lock:
            return [self.read(offset, length) for offset, length in ranges]

    def read(self, offset: int, length: int) -> Any:
        """Up to `length` bytes at `offset`: fewer only at the end of the file (the
        core then reports the short read)."""
        self.file.seek(offset)
        if self.readinto is None:
            pieces, done = [], 0
            while done < length:
                piece = self.file.read(length - done)
                if not piece:
                    break
                pieces.append(piece)
                done += len(piece)
            return b"".join(pieces)
        buffer = bytearray(length)
        view, done = memoryview(buffer), 0
        while done < length:
            count = self.readinto(view[done:])
            if not count:
                break
            done += count
        return view[:done]


# ---------------------------------------------------------------------------
# URLs, through fsspec
# ---------------------------------------------------------------------------


class UrlRanges:
    """Byte ranges of the object a URL names: on async stores fetched in parallel,
    at most MAX_REQUESTS at once (``_fetch_ranges``), elsewhere by fsspec's
    ``cat_ranges``; each with the store's precondition on the version seen at
    opening where it has one."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        self.url = url
        self.storage_options = dict(storage_options or {})
        fs, self.path = _url_to_fs(url, self.storage_options)
        try:
            fs.invalidate_cache(self.path)   # a listing cached earlier may be stale
            info = fs.info(self.path, **_deadline(fs))
        except Exception as error:
            raise _translated(error, url, "opening it") from error
        if info.get("type", "file") != "file":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", url)
        self.size = int(info["size"])
        self.etag = info.get("ETag") or info.get("etag")
        modified = (info.get("LastModified") or info.get("Last-Modified")
                    or info.get("mtime") or info.get("created"))
        self.identity = (url, self.size, self.etag, modified)
        self.fs, self.read_kwargs = _with_precondition(fs, self.storage_options, self.etag,
                                                       modified)

    def __call__(self, ranges: Sequence[Range]) -> List[Any]:
        try:
            if getattr(self.fs, "async_impl", False):
                got = _fetch_ranges(self.fs, self.path, ranges, self.read_kwargs)
            else:
                got = self.fs.cat_ranges([self.path] * len(ranges),
                                         [offset for offset, _ in ranges],
                                         [offset + length for offset, length in ranges],
                                         on_error="return", **self.read_kwargs)
        except Exception as error:
            raise _translated(error, self.url, f"reading {len(ranges)} byte ranges") from error
        for (offset, length), item in zip(ranges, got):
            if isinstance(item, BaseException):
                raise _translated(item, self.url, f"reading bytes [{offset}, "
                                                  f"{offset + length})") from item
        return list(got)


def _deadline(fs: AbstractFileSystem) -> Dict[str, float]:
    """The keyword that bounds a whole call of an async file system that moves next to
    no data, such as ``info`` (fsspec's `sync` gives up after `timeout` seconds,
    cancelling the call): see ``_seconds_for``."""
    if not getattr(fs, "async_impl", False):
        return {}
    return {"timeout": _seconds_for(0)}


def _seconds_for(size: int) -> float:
    """How long a call that moves `size` bytes may take in all: the connect and read
    timeouts, plus the time `size` bytes take at SLOWEST_RATE. The store's own
    timeouts apply per attempt, and s3fs and botocore retry timed-out attempts many
    times over; this bounds them all."""
    return CONNECT_TIMEOUT + READ_TIMEOUT + size / SLOWEST_RATE


def _fetch_ranges(fs: AbstractFileSystem, path: str, ranges: Sequence[Range],
                  kwargs: Dict[str, Any]) -> List[Any]:
    """Byte ranges of `path` from an async file system, at most MAX_REQUESTS at once,
    each its bytes or the exception that fetching it raised. A call that outlasts
    its deadline raises TimeoutError with every request of it cancelled, retries
    included (fsspec's ``cat_ranges`` leaves its requests running when its caller
    gives up)."""
    import asyncio

    from fsspec.asyn import sync  # type: ignore[import-untyped, unused-ignore]

    async def fetch_all() -> List[Any]:
        slots = asyncio.Semaphore(MAX_REQUESTS)

        async def fetch(offset: int, length: int) -> Any:
            async with slots:
                return await fs._cat_file(path, start=offset, end=offset + length, **kwargs)

        tasks = [asyncio.ensure_future(fetch(offset, length)) for offset, length in ranges]
        try:
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True),
                                               _seconds_for(sum(n for _, n in ranges))))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)   # each has ended

    result: List[Any] = sync(fs.loop, fetch_all)
    return result


def _url_to_fs(url: str, storage_options: Dict[str, Any]) -> Tuple[AbstractFileSystem, str]:
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise ImportError(f"{url}: URLs are read through fsspec; install it with "
                          f"pip install 'fastst[remote]'") from None
    protocol = url.split("://", 1)[0].lower()
    options = with_default_timeouts(protocol, storage_options)
    try:
        fs, path = url_to_fs(url, **options)
    except ImportError as error:
        raise ImportError(f"{url}: fsspec needs another package for {protocol}:// URLs "
                          f"({error}); pip install 'fastst[remote]' installs s3fs and "
                          f"aiohttp") from None
    return fs, path


def with_default_timeouts(protocol: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """storage_options with fastst's connect and read timeouts where the user gave
    none: a store that stalls gives an error instead of a hang."""
    if protocol in S3_PROTOCOLS:
        config = {"connect_timeout": CONNECT_TIMEOUT, "read_timeout": READ_TIMEOUT,
                  **options.get("config_kwargs", {})}
        return {**options, "config_kwargs": config}
    if protocol in HTTP_PROTOCOLS:
        client = dict(options.get("client_kwargs", {}))
        if "timeout" not in client:
            import aiohttp   # fsspec's HTTP file system needs it already

            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT,
                                                      sock_read=READ_TIMEOUT)
        return {**options, "client_kwargs": client}
    return options


def _with_precondition(fs: AbstractFileSystem, options: Dict[str, Any], etag: Optional[str],
                       modified: Any = None) -> Tuple[AbstractFileSystem, Dict[str, Any]]:
    """The file system and the keywords of each ranged read that read only the
    version of the object whose ETag is `etag`: s3fs passes IfMatch to each GET from its
    ``s3_additional_kwargs`` (a file system of its own, cached by fsspec under
    those options), HTTP sends an If-Match header, or, from a server that gives no
    ETag, If-Unmodified-Since its Last-Modified date (`modified`)."""
    protocols = _protocols(fs)
    if protocols & set(HTTP_PROTOCOLS):
        if etag is not None:
            condition = {"If-Match": etag}
        elif isinstance(modified, str):
            condition = {"If-Unmodified-Since": modified}
        else:
            return fs, {}
        return fs, {"headers": {**options.get("headers", {}), **condition}}
    if etag is not None and protocols & set(S3_PROTOCOLS):
        extra = {**fs.storage_options.get("s3_additional_kwargs", {}), "IfMatch": etag}
        return type(fs)(**{**fs.storage_options, "s3_additional_kwargs": extra}), {}
    return fs, {}


def _translated(error: BaseException, url: str, doing: str) -> BaseException:
    """The error to raise for a store's `error`: FileNotFoundError and PermissionError
    as they are; a failed precondition (the object changed) or a body cut short as a
    SafetensorError; a timeout as TimeoutError; anything else as an OSError naming
    the URL."""
    if isinstance(error, (FileNotFoundError, PermissionError, SafetensorError)):
        return error
    if _precondition_failed(error):
        return SafetensorError(f"{url}: the object changed since it was opened (its ETag "
                               f"or modification time no longer matches) while {doing}; "
                               f"open it again to read the new object")
    if type(error).__name__ in ("ClientPayloadError", "ContentLengthError",
                                "IncompleteReadError", "ResponseStreamingError"):
        return SafetensorError(f"{url}: the store's answer was cut short while {doing} "
                               f"({error})")
    if isinstance(error, TimeoutError) or "Timeout" in type(error).__name__:
        return TimeoutError(f"{url}: no answer in time while {doing} ({type(error).__name__}"
                            f"; storage_options set the timeouts)")
    return OSError(f"{url}: {doing} failed: {type(error).__name__}: {error}")


def _precondition_failed(error: BaseException) -> bool:
    seen: Optional[BaseException] = error
    for _ in range(8):   # the chain of causes, as far as a store's wrappers go
        if seen is None:
            return False
        if getattr(seen, "status", None) == 412:
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412"):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def save_plan(plan: WritePlan, target: str,
              storage_options: Optional[Mapping[str, Any]] = None) -> None:
    """Write a WritePlan to the URL `target`.

    On S3 and Google Cloud Storage the file is streamed up in parts and the object
    appears only once complete; a failed save aborts the upload and leaves the
    previous object. A ``file://`` URL is written as ``save_file`` writes a path
    (atomically). On other stores the file is put whole in one call (atomic where
    the store's put is).
    """
    fs, path = _url_to_fs(target, dict(storage_options or {}))
    try:
        if _is_local(fs):
            write_atomically(plan, path)
        elif _is_staged(fs):
            _upload_staged(fs, path, lambda file: plan.write_stream(file, target))
        else:
            fs.pipe_file(path, plan.to_bytes())
    except SafetensorError:
        raise
    except Exception as error:
        raise _translated(error, target, "saving") from error


class SpooledUpload:
    """A file for a URL, written on local disk first (the streaming writer fills
    its file in any order, which an upload cannot take) and uploaded when
    complete: ``path`` is where to write it, ``upload()`` sends it, as
    ``save_file`` sends a file (in parts where the store stages uploads, so the
    object appears whole or not at all), and removes it; ``discard()`` removes
    it. A ``file://`` URL is written in place, with no spool. The spool lies in
    ``tempfile.gettempdir()`` (``TMPDIR``), which needs room for the file."""

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        self.url = url
        self.fs, self.remote_path = _url_to_fs(url, dict(storage_options or {}))
        self.spool: Optional[str] = None
        if _is_local(self.fs):
            self.path = self.remote_path
        else:
            self.spool = tempfile.mkdtemp(prefix="fastst-upload-")
            self.path = os.path.join(self.spool, os.path.basename(self.remote_path)
                                     or "upload.safetensors")

    def upload(self) -> None:
        if self.spool is None:
            return
        try:
            if _is_staged(self.fs):
                with open(self.path, "rb") as local:
                    _upload_staged(self.fs, self.remote_path,
                                   lambda file: shutil.copyfileobj(local, file, UPLOAD_PIECE))
            else:
                self.fs.put_file(self.path, self.remote_path)
        except SafetensorError:
            raise
        except Exception as error:
            raise _translated(error, self.url, "uploading") from error
        finally:
            self.discard()

    def discard(self) -> None:
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)
            self.spool = None


UPLOAD_PIECE = 16 << 20   # bytes a spooled file is uploaded by


def _protocols(fs: AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)


def _is_local(fs: AbstractFileSystem) -> bool:
    return bool(_protocols(fs) & {"file", "local"})


def _is_staged(fs: AbstractFileSystem) -> bool:
    return bool(_protocols(fs) & set(STAGED_PROTOCOLS))


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
