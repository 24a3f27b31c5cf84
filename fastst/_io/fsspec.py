"""URLs read through fsspec (with s3fs or aiohttp behind it): `UrlRanges`, the ranged
GETs of each kind of store, each call bounded by its deadline, each answer held to the
version opened. fsspec is imported when such a URL is first opened."""
from __future__ import annotations

import contextlib
import errno
import threading
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Mapping, Optional,
                    Sequence, Tuple)

from .._core import SafetensorError
from . import limits as knobs
from .limits import READ_OPTIONS
from .ranged import (READ_PIECE, Limits, ObjectVersion, Pace, PartQueue, Range, RangedObject,
                     Scatter, Span, Tally, checked_answer, precondition, read_limits, shown_url,
                     too_long, translated)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped, unused-ignore]

HTTP_PROTOCOLS = ("http", "https")
S3_PROTOCOLS = ("s3", "s3a")


class UrlRanges(RangedObject):
    """Byte ranges of the object a URL names: the ``fetch`` through which
    ``safe_open`` reads a URL through fsspec (see `open_object`).

    Making one looks the object up (its size, ETag, modification time).
    Called with a list of ``(offset, length)``, it returns the bytes of each:
    on async stores fetched in parallel, at most `MAX_REQUESTS` at once,
    elsewhere by fsspec's ``cat_ranges``; each with the store's precondition
    on the version seen at opening where it has one, so that an object
    replaced since gives a `SafetensorError`, never a mix of two versions.

    A server that ignores range requests (status 200 and the whole object,
    no ``Accept-Ranges``) is answered from the start of that object: a
    range that starts at byte 0 takes its first bytes and reads no further;
    any other read reads the object whole, once, and is served from that
    copy, as every later one is (see ``RangedObject``); an object over
    `MAX_WHOLE_READ` bytes is refused with a `SafetensorError` that says
    the server ignores range requests.

    Parameters
    ----------
    url : str
        An fsspec URL (``s3://``, ``gs://``, ``https://``, ``memory://``...).
    storage_options : mapping, optional
        The options of its fsspec file system; fastst's timeouts are added
        where they give none (see `with_default_timeouts`).

    Attributes
    ----------
    size : int
        The object's size.
    etag : str or None
        Its ETag, where the store gives one.
    ranges_ignored : bool
        Whether the server is known to ignore range requests (its answer
        to one, or ``Accept-Ranges: none``): the compiled Reader then asks
        for the whole object to read every tensor.

    Raises
    ------
    FileNotFoundError
        When there is no object at `url`.
    IsADirectoryError
        When `url` names a folder.
    SafetensorError
        When the store gives no size for the object, or (when called) the
        object changed since.
    ImportError
        When fsspec, or the package its protocol needs, is not installed.
    OSError
        When the store fails (`TimeoutError` when it does not answer in time).

    Examples
    --------
    >>> import numpy as np, fastst, fsspec
    >>> from fastst.remote import UrlRanges
    >>> fastst.save_file({"x": np.arange(4, dtype=np.int8)}, "memory://docs/x.safetensors")
    >>> ranges = UrlRanges("memory://docs/x.safetensors", None)
    >>> size, (header, data) = ranges.size, ranges([(8, 4), (64, 4)])
    >>> size, bytes(header), list(data)
    (68, b'{"x"', [0, 1, 2, 3])
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """

    __module__ = "fastst.remote"

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        super().__init__()
        self.url, self.label = url, shown_url(url)
        self.storage_options = dict(storage_options or {})
        self.limits = read_limits(url, self.storage_options)
        self.pace = self.limits.pace(url)
        fs, self.path = file_system_of(url, self.storage_options)
        try:
            fs.invalidate_cache(self.path)   # a listing cached earlier may be stale
            info = _bounded(fs, self.limits.seconds_for(0), fs.info, self.path)
        except Exception as error:
            raise translated(error, url, "opening it")
        if info.get("type", "file") != "file":
            raise IsADirectoryError(errno.EISDIR, "Is a directory", self.label)
        if info.get("size") is None:
            raise SafetensorError(f"{self.label}: the store gives no size for the object (it is "
                                  f"read by byte ranges, which need one)")
        self.size = int(info["size"])
        self.etag = info.get("ETag") or info.get("etag") or None
        modified = (info.get("LastModified") or info.get("Last-Modified")
                    or info.get("mtime") or info.get("created"))
        self.version = ObjectVersion(self.label, self.size, self.etag, modified)
        self.identity = tuple(self.version)
        self.ranges_ignored = info.get("partial") is False    # Accept-Ranges: none
        self.fs, self.read_kwargs = _with_precondition(fs, self.storage_options, self.etag,
                                                       modified)

    def _fetch(self, ranges: Sequence[Range], spans: List[Span], targets: List[Scatter],
               on_bytes: Optional[Callable[[int], None]]) -> Optional[List[Any]]:
        try:
            if getattr(self.fs, "async_impl", False):
                get = _range_getter(self.fs)
                _fetch_spans(self.fs, spans, targets, lambda offset, length, into, progress: get(
                    self.fs, self.path, offset, length, self, into, progress),
                    self.pace, self.limits, whole_requests=self.ranges_ignored,
                    on_bytes=on_bytes)
                return None
            else:
                got = _bounded(self.fs, self.limits.seconds_for(sum(
                    length for _, length in ranges)), self.fs.cat_ranges,
                    [self.path] * len(ranges), [offset for offset, _ in ranges],
                    [offset + length for offset, length in ranges], on_error="return",
                    **self.read_kwargs)
        except Exception as error:
            part = getattr(error, "fastst_range", None)
            doing = (f"reading {len(ranges)} byte ranges" if part is None else
                     f"reading bytes [{part[0]}, {part[0] + part[1]})")
            raise translated(error, self.url, doing)
        for (offset, length), item in zip(ranges, got):
            if isinstance(item, BaseException):
                raise translated(item, self.url, f"reading bytes [{offset}, "
                                                 f"{offset + length})")
            if on_bytes is not None:
                on_bytes(length)
        return list(got)


def _bounded(fs: AbstractFileSystem, seconds: float, method: Callable[..., Any], *args: Any,
             **kwargs: Any) -> Any:
    """``method(*args, **kwargs)``, a call of `fs`, given up after `seconds` (see
    ``Limits.seconds_for``) with a TimeoutError. An async file system's call is given
    fsspec's `timeout`, which cancels it (and gives up even while its event loop is
    blocked); any other's runs in a thread of its own, waited for that long: nothing
    can cancel it, so its thread is left to end on its own and its answer dropped."""
    if getattr(fs, "async_impl", False):
        return method(*args, timeout=seconds, **kwargs)
    ended = threading.Event()
    outcome: Dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["answer"] = method(*args, **kwargs)
        except BaseException as error:
            outcome["error"] = error
        finally:
            ended.set()

    threading.Thread(target=call, daemon=True, name="fastst-store").start()
    if not ended.wait(seconds):
        raise TimeoutError(f"the store did not answer in {seconds:.1f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["answer"]


# One ranged GET into memory: (offset, length, into, progress) -> the bytes put at the
# start of `into` (fewer than `length` when the answer was cut short); progress(n) is
# called as each n bytes come in.
PartGetter = Callable[[int, int, Scatter, Callable[[int], None]], Awaitable[int]]


def _fetch_spans(fs: AbstractFileSystem, spans: List[Span], targets: List[Scatter],
                 get: PartGetter, pace: Pace, limits: Limits, whole_requests: bool = False,
                 on_bytes: Optional[Callable[[int], None]] = None) -> None:
    """Spans of an async file system's object, fetched by parts into their targets
    (a span's holes say what an answer cut short left out): a queue of parts that
    `pace` sizes, taken by as many requests at once as it allows, each started as
    soon as one ends. With `whole_requests`, each span is asked for in one request (a
    server that ignores ranges). The first part that fails raises its error, with
    `.fastst_range` its bytes; a call that outlasts its deadline raises TimeoutError
    with every request of it cancelled, retries included (fsspec's ``cat_ranges``
    leaves its requests running when its caller gives up). Where a store's code holds
    the event loop past the deadline, so that nothing can be cancelled, the call
    gives up waiting a second later, and the places of its parts are released: the
    store writes nothing into the targets once it lets the loop run again."""
    import asyncio

    from fsspec.asyn import sync  # type: ignore[import-untyped, unused-ignore]
    from fsspec.exceptions import FSTimeoutError  # type: ignore[import-untyped, unused-ignore]

    parts = PartQueue(spans, pace, whole_requests)
    tally = Tally(pace, on_bytes)
    places: List[Scatter] = []     # where each part started goes
    given_up = threading.Event()

    async def fetch_part(k: int, offset: int, size: int) -> None:
        if given_up.is_set():
            return
        span = spans[k]
        into = targets[k].part(offset - span.offset, offset - span.offset + size)
        places.append(into)
        try:
            got = await get(offset, size, into, tally.part_asked())
        except Exception as error:
            error.fastst_range = (offset, size)   # type: ignore[attr-defined]
            raise
        if got < size:
            span.holes.append((offset + got, offset + size))

    async def fetch_all() -> None:
        running: set = set()
        pace.start_at_first_byte()
        try:
            while True:
                while len(running) < pace.allowed:
                    part = parts.next()
                    if part is None:
                        break
                    running.add(asyncio.ensure_future(fetch_part(*part)))
                if not running:
                    return
                if not parts:
                    pace.starved = True
                # woken by a part's end, or soon enough to start the requests a
                # better pace allows
                ended, running = await asyncio.wait(running, timeout=pace.MIN_WINDOW / 4,
                                                    return_when=asyncio.FIRST_COMPLETED)
                for task in ended:
                    task.result()    # the first error ends the read
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)   # each has ended

    seconds = limits.seconds_for(sum(span.end - span.offset for span in spans))

    async def within_deadline() -> None:
        await asyncio.wait_for(fetch_all(), seconds)

    try:   # `sync` gives up a second after the deadline, whatever holds the loop
        sync(fs.loop, within_deadline, timeout=seconds + 1)
    except FSTimeoutError:
        given_up.set()
        for place in list(places):
            with contextlib.suppress(BufferError):   # none is exported, but be sure
                place.release()   # a write into it raises, in the part's own task
        raise


# One ranged GET per kind of store: (fs, path, offset, length, the UrlRanges: the version
# opened, the precondition's keywords, into, progress) -> the bytes put into `into`.
# _get_http and _get_s3 read no more than asked and check what the answer says of itself
# (and note a server that ignores range requests); _get_other is fsspec's own whole read.
RangeGetter = Callable[[Any, str, int, int, "UrlRanges", Scatter, Callable[[int], None]],
                       Awaitable[int]]


def _range_getter(fs: AbstractFileSystem) -> RangeGetter:
    protocols = protocols_of(fs)
    if protocols & set(HTTP_PROTOCOLS) and hasattr(fs, "set_session"):
        return _get_http
    if protocols & set(S3_PROTOCOLS) and hasattr(fs, "_call_s3"):
        return _get_s3
    return _get_other


async def _get_http(fs: Any, path: str, offset: int, length: int, opened: UrlRanges,
                    into: Scatter, progress: Callable[[int], None]) -> int:
    """Bytes [offset, offset + length) of an HTTP object into `into`, on the aiohttp
    session of fsspec's HTTPFileSystem (whose request options and headers apply)."""
    version = opened.version
    options = {**fs.kwargs, **opened.read_kwargs}
    headers = {**options.pop("headers", {}), "Range": f"bytes={offset}-{offset + length - 1}",
               "Accept-Encoding": "identity"}
    session = await fs.set_session()
    async with session.get(fs.encode_url(path), headers=headers, **options) as response:
        try:
            if response.status == 404:
                raise FileNotFoundError(errno.ENOENT, "No such object", version.label)
            response.raise_for_status()
            said = response.headers
            body, whole = checked_answer(version, offset, length, response.status,
                                         said.get("Content-Range"), response.content_length,
                                         said.get("ETag"), said.get("Last-Modified"))
            got = await _read_into(response.content.read, into, body, version, offset,
                                   length, progress, rest_unread=whole)
            if whole:
                opened.ranges_ignored = True
                response.close()   # the rest of the object goes unread, with the connection
            return got
        except BaseException:
            response.close()   # the connection goes with the answer's unread rest
            raise


async def _get_s3(fs: Any, path: str, offset: int, length: int, opened: UrlRanges,
                  into: Scatter, progress: Callable[[int], None]) -> int:
    """Bytes [offset, offset + length) of an S3 object into `into`: s3fs's GetObject
    (with its IfMatch, its retries), the body read in pieces."""
    version, kwargs = opened.version, opened.read_kwargs
    from s3fs.core import (  # type: ignore[import-untyped, unused-ignore]
        _error_wrapper, version_id_kw)

    bucket, key, version_id = fs.split_path(path)

    async def get_and_read() -> int:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                     Range=f"bytes={offset}-{offset + length - 1}",
                                     **version_id_kw(version_id), **kwargs)
        stream = response["Body"]
        try:
            body, whole = checked_answer(
                version, offset, length,
                response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
                response.get("ContentRange"), response.get("ContentLength"),
                response.get("ETag"), response.get("LastModified"))
            got = await _read_into(stream.read, into, body, version, offset, length,
                                   progress, rest_unread=whole)
            if whole:
                opened.ranges_ignored = True
            return got
        finally:
            stream.close()

    # as s3fs reads a body: an answer cut short is asked again, a refused one is not
    got: int = await _error_wrapper(get_and_read, retries=fs.retries)
    return got


async def _get_other(fs: Any, path: str, offset: int, length: int, opened: UrlRanges,
                     into: Scatter, progress: Callable[[int], None]) -> int:
    """Bytes [offset, offset + length) through fsspec's ``_cat_file``, which reads
    the whole answer: checked to be bytes, and no more than asked."""
    data = await fs._cat_file(path, start=offset, end=offset + length, **opened.read_kwargs)
    asked = f"bytes [{offset}, {offset + length})"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SafetensorError(f"{opened.label}: {asked} came back as a {type(data).__name__}, "
                              f"not bytes")
    count = memoryview(data).nbytes
    if count > length:
        raise SafetensorError(f"{opened.label}: {asked} came back {count} bytes long, not "
                              f"{length} (too long)")
    into.put(0, data)
    progress(count)
    return count


async def _read_into(read: Callable[[int], Awaitable[bytes]], into: Scatter, body: int,
                     version: ObjectVersion, offset: int, length: int,
                     progress: Callable[[int], None], *, rest_unread: bool = False) -> int:
    """An answer's body, which should hold `body` bytes, read in pieces into `into`:
    one byte past them is an error, and nothing beyond it is read; with `rest_unread`
    (a body that goes on, the whole object), its first `body` bytes and not one more.
    Returns the bytes read: fewer than `body` when the body ends early (the Reader
    reports the short read, naming the tensor)."""
    done = 0
    past = 0 if rest_unread else 1
    while done < body + past:
        piece = await read(min(READ_PIECE, body + past - done))
        if not piece:
            break
        if done + len(piece) > body:
            raise too_long(version.label, offset, length, body)
        into.put(done, piece)
        done += len(piece)
        progress(len(piece))
    return done


def file_system_of(url: str, storage_options: Dict[str, Any]) -> Tuple[AbstractFileSystem, str]:
    try:
        from fsspec.core import url_to_fs  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise ImportError(f"{shown_url(url)}: URLs are read through fsspec: pip install fsspec "
                          f"s3fs aiohttp (fastst's 'remote' extra)") from None
    protocol = url.split("://", 1)[0].lower()
    options = with_default_timeouts(protocol, {
        key: value for key, value in storage_options.items() if key not in READ_OPTIONS})
    if protocol in S3_PROTOCOLS:
        high = read_limits(url, storage_options).max_requests
        # s3fs sends the parts of an upload this many at once; botocore's pool of
        # connections (10 unless told) must hold as many requests as a read sends
        options["max_concurrency"] = high
        options["config_kwargs"] = {"max_pool_connections": high, **options["config_kwargs"]}
    try:
        fs, path = url_to_fs(url, **options)
    except ImportError as error:
        raise ImportError(f"{shown_url(url)}: fsspec needs another package for {protocol}:// "
                          f"URLs ({error}); fastst's 'remote' extra installs s3fs and "
                          f"aiohttp") from None
    return fs, path


def with_default_timeouts(protocol: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """``storage_options`` with fastst's connect and read timeouts where the user
    gave none: a store that stalls gives an error instead of a hang.

    Parameters
    ----------
    protocol : str
        The URL's protocol: ``"s3"`` and ``"s3a"`` get botocore's
        ``config_kwargs``, ``"http"`` and ``"https"`` aiohttp's
        ``client_kwargs``; others are returned as they are.
    options : dict
        The user's ``storage_options`` (not changed).

    Returns
    -------
    dict

    Examples
    --------
    >>> from fastst.remote import with_default_timeouts
    >>> with_default_timeouts("s3", {"anon": True})
    {'anon': True, 'config_kwargs': {'connect_timeout': 10.0, 'read_timeout': 60.0}}
    >>> with_default_timeouts("s3", {"config_kwargs": {"read_timeout": 5}})["config_kwargs"]
    {'connect_timeout': 10.0, 'read_timeout': 5}
    """
    if protocol in S3_PROTOCOLS:
        config = {"connect_timeout": knobs.CONNECT_TIMEOUT,
                  "read_timeout": knobs.READ_TIMEOUT,
                  **options.get("config_kwargs", {})}
        return {**options, "config_kwargs": config}
    if protocol in HTTP_PROTOCOLS:
        client = dict(options.get("client_kwargs", {}))
        if "timeout" not in client:
            import aiohttp   # fsspec's HTTP file system needs it already

            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=knobs.CONNECT_TIMEOUT,
                                                      sock_read=knobs.READ_TIMEOUT)
        return {**options, "client_kwargs": client}
    return options


def _with_precondition(fs: AbstractFileSystem, options: Dict[str, Any], etag: Optional[str],
                       modified: Any = None) -> Tuple[AbstractFileSystem, Dict[str, Any]]:
    """The file system and the keywords of each ranged read that read only the
    version of the object whose ETag is `etag`: s3fs passes IfMatch to each GET from its
    ``s3_additional_kwargs`` (a file system of its own, cached by fsspec under
    those options), HTTP sends the headers ``fastst._io.ranged.precondition`` gives
    (If-Match, or If-Unmodified-Since `modified` where the ETag is weak or none)."""
    protocols = protocols_of(fs)
    if protocols & set(HTTP_PROTOCOLS):
        condition = precondition(etag, modified if isinstance(modified, str) else None)
        if not condition:
            return fs, {}
        return fs, {"headers": {**options.get("headers", {}), **condition}}
    if etag is not None and protocols & set(S3_PROTOCOLS):
        extra = {**fs.storage_options.get("s3_additional_kwargs", {}), "IfMatch": etag}
        return type(fs)(**{**fs.storage_options, "s3_additional_kwargs": extra}), {}
    return fs, {}




def protocols_of(fs: AbstractFileSystem) -> set[str]:
    return {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
