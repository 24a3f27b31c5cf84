"""File objects and URLs as safetensors files: the header first, then only the byte
ranges asked for, and uploads of whole files to URLs.

The Sources of ``fastst._source`` come here for a binary file object or a URL
(``s3://``, ``gs://``, ``http(s)://``, ``memory://``...); nothing here is
imported by ``import fastst``. A URL is read by one of two transports (`open_object`
chooses): ``http(s)://`` by fastst's own HTTP client (``fastst._http``: the standard
library's ``http.client`` in threads, each part read from its socket straight into
its array), every other URL, and an ``http(s)://`` one whose ``storage_options`` only
fsspec takes, through fsspec (with s3fs or aiohttp behind it), imported only when
such a URL is opened. The compiled Reader does the rest (``Reader.open_ranges``): it
reads the prefix and header in one request (two for a header over 64 KiB), coalesces
the byte ranges of neighbouring tensors, cuts big ones into parts fetched in
parallel, and checks that every range came back whole.

A URL is read with a precondition where the store has one: S3 reads carry
``If-Match: <ETag>`` (through s3fs) and HTTP reads the ``If-Match`` header, so an
object replaced after it was opened gives a ``SafetensorError``, never a mix of two
versions. A store may ignore it, or ignore the range: each S3 and HTTP answer is
also held to what it says of itself (status 206, its Content-Range, ETag and
Last-Modified against the object seen at opening), and its body is read in pieces,
never past the bytes asked for (``fastst._ranged.checked_answer``). Other stores
are checked for length (and to answer with bytes) only; every store's calls are
bounded by their deadline (see ``_bounded``).

Examples
--------
Any fsspec URL is read and written as a path is (``memory://`` needs no server):

>>> import numpy as np, fastst, fsspec
>>> fastst.save_file({"x": np.arange(4, dtype=np.int8)}, "memory://docs/x.safetensors")
>>> with fastst.safe_open("memory://docs/x.safetensors") as f:
...     f.backend, f.get_slice("x")[1:3].tolist()
('ranges', [1, 2])
>>> fsspec.filesystem("memory").rm("/docs", recursive=True)
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import tempfile
import threading
from typing import (TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Mapping, Optional,
                    Sequence, Tuple)

from ._core import SafetensorError, WritePlan
from ._files import write_atomically
from ._ranged import (READ_PIECE, Limits, ObjectVersion, Pace, PartQueue, Range, RangedFetch,
                      RangedObject, Scatter, Span, Tally, checked_answer, precondition, shown_url,
                      too_long, translated)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem  # type: ignore[import-untyped, unused-ignore]

__all__ = ["CONNECT_TIMEOUT", "MAX_REQUESTS", "MAX_WHOLE_READ", "PART_SIZE", "READ_TIMEOUT",
           "START_REQUESTS", "FileObjectRanges", "Pace", "SpooledUpload", "UrlRanges",
           "open_object", "read_object", "save_plan", "with_default_timeouts"]

CONNECT_TIMEOUT = 10.0
"""Seconds to connect to a store (S3, HTTP), unless ``storage_options`` say otherwise
(``config_kwargs={"connect_timeout": ...}`` for S3, ``client_kwargs={"timeout": ...}``
for HTTP): a store that does not answer gives an error instead of a hang."""
READ_TIMEOUT = 60.0
"""Seconds a store (S3, HTTP) may stay silent while answering a request, unless
``storage_options`` say otherwise; a call as a whole may take this, plus
`CONNECT_TIMEOUT`, plus the time its bytes take at 256 KiB a second, retries
included."""
MAX_REQUESTS = 32
"""The most requests the reader of a URL keeps in flight at once, on stores read
in parallel (HTTP(S), S3, GCS...), unless ``storage_options`` say otherwise
(``max_concurrency``). A read starts with `START_REQUESTS` and adds requests while
that makes the bytes come faster: see `Pace`."""
START_REQUESTS = 4
"""Requests in flight when the reader of a URL starts: a few large ones, which a fast
link fills alone. A URL on a store that the process read before starts at the level
that read reached instead (see `Pace`)."""
PART_SIZE = 8 << 20
"""The largest request (8 MiB) of the reader of a URL, unless ``storage_options`` say
otherwise (``part_size``): the byte ranges of a read are fetched in parts of at most
this size, smaller ones at the end so that every connection stays busy to the last
byte."""
MAX_WHOLE_READ = 1 << 30
"""The largest object (1 GiB) read whole, in one request, from a server that ignores
range requests (it answers them with status 200 and the whole object, as
``python -m http.server`` does): the first read past the object's first bytes reads it
whole, and the handle serves every later read from that copy, held in memory until it
is closed (each file of a checkpoint on its own). Reading past the first bytes of a
larger object raises a `SafetensorError` that says the server ignores range requests;
nothing past the bytes asked for is read."""
# fastst's own keys in storage_options, taken out before a transport sees them
READ_OPTIONS = ("max_concurrency", "part_size", "transport")
TRANSPORTS = ("http", "fsspec")
HTTP_PROTOCOLS = ("http", "https")
S3_PROTOCOLS = ("s3", "s3a")
# Stores whose files honour autocommit=False: the object appears at commit, and
# discard leaves the previous one. Elsewhere a save is one put of the whole file.
STAGED_PROTOCOLS = ("s3", "s3a", "gs", "gcs")


def open_object(url: str, storage_options: Optional[Mapping[str, Any]]) -> RangedFetch:
    """The object a URL names, opened for ranged reads by the transport that suits it:
    fastst's HTTP client for an ``http(s)://`` URL (``storage_options`` of
    ``headers``, ``client_kwargs={"timeout": ..., "headers": ...}`` and fsspec's
    caching keys, which it has no use for), fsspec for any other URL or options;
    ``storage_options={"transport": "fsspec"}`` (or ``"http"``) chooses.

    Parameters
    ----------
    url : str
        The object's URL.
    storage_options : mapping, optional
        fastst's bounds (``max_concurrency``, ``part_size``, ``transport``) and the
        transport's options.

    Returns
    -------
    RangedFetch
        A `UrlRanges`, or the HTTP client's ``HttpRanges``: the fetch the compiled
        Reader calls, with the object's ``size`` and ``identity``.

    Raises
    ------
    SafetensorError
        When ``transport`` names no transport, or ``"http"`` for a URL or options
        that the HTTP client does not take.

    Examples
    --------
    >>> import fsspec
    >>> from fastst.remote import open_object
    >>> fsspec.filesystem("memory").pipe("/docs/blob", b"0123456789")
    >>> blob = open_object("memory://docs/blob", None)
    >>> type(blob).__name__, blob.size, [bytes(part) for part in blob([(2, 3)])]
    ('UrlRanges', 10, [b'234'])
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """
    options = dict(storage_options or {})
    transport = options.get("transport")
    if transport is not None and transport not in TRANSPORTS:
        raise SafetensorError(f"{shown_url(url)}: storage_options['transport'] must be one of "
                              f"{', '.join(map(repr, TRANSPORTS))}, got {transport!r}")
    if transport != "fsspec":
        from . import _http

        refused = _http.refusal(url, {key: value for key, value in options.items()
                                      if key not in READ_OPTIONS})
        if refused is None:
            return _http.HttpRanges(url, options, read_limits(url, options))
        if transport == "http":
            raise SafetensorError(f"{shown_url(url)}: storage_options['transport'] is 'http', but "
                                  f"{refused}")
    return UrlRanges(url, options)


def read_limits(url: str, storage_options: Mapping[str, Any]) -> Limits:
    """The bounds a read of `url` works within: this module's constants, but for the
    most requests in flight and the largest part where `storage_options` give them
    (``max_concurrency``, ``part_size``)."""
    bounds = []
    for key, default in (("max_concurrency", MAX_REQUESTS), ("part_size", PART_SIZE)):
        value = storage_options.get(key, default)
        if type(value) is not int or value < 1:
            raise SafetensorError(f"{shown_url(url)}: storage_options[{key!r}] must be an "
                                  f"integer >= 1, "
                                  f"got {value!r}")
        bounds.append(value)
    return Limits(CONNECT_TIMEOUT, READ_TIMEOUT, START_REQUESTS, bounds[0], bounds[1],
                  MAX_WHOLE_READ)


def read_object(url: str, storage_options: Optional[Mapping[str, Any]], limit: int,
                what: str) -> bytes:
    """The whole of a small object at a URL: a checkpoint's index, say.

    Parameters
    ----------
    url : str
        An fsspec URL.
    storage_options : mapping, optional
        The options of its fsspec file system.
    limit : int
        The most bytes read: a larger object is refused before any is.
    what : str
        What messages call the object (``"index"``).

    Returns
    -------
    bytes

    Raises
    ------
    FileNotFoundError
        When there is no object at `url`.
    SafetensorError
        When the object is larger than `limit`, or the store answers fewer
        bytes than it holds.
    OSError
        When the store fails (`TimeoutError` when it does not answer in time).

    Examples
    --------
    >>> import fsspec
    >>> from fastst.remote import read_object
    >>> fsspec.filesystem("memory").pipe("/docs/index.json", b'{"weight_map": {}}')
    >>> read_object("memory://docs/index.json", None, 1000, "index")
    b'{"weight_map": {}}'
    >>> read_object("memory://docs/index.json", None, 10, "index")
    Traceback (most recent call last):
      ...
    fastst._core.SafetensorError: memory://docs/index.json: index of 18 bytes exceeds the limit of 10 bytes
    >>> fsspec.filesystem("memory").rm("/docs", recursive=True)
    """
    ranges = open_object(url, storage_options)
    if ranges.size > limit:
        raise SafetensorError(f"{ranges.label}: {what} of {ranges.size} bytes exceeds the "
                              f"limit of {limit} bytes")
    if ranges.size == 0:
        return b""
    (data,) = ranges([(0, ranges.size)])
    if len(data) != ranges.size:
        raise SafetensorError(f"{ranges.label}: {what}: the store answered {len(data)} bytes "
                              f"for {ranges.size} ("
                              f"{'a short read' if len(data) < ranges.size else 'too long'})")
    return bytes(data)


# ---------------------------------------------------------------------------
# File objects
# ---------------------------------------------------------------------------


class FileObjectRanges:
    """Byte ranges of a binary file object: the ``fetch`` through which
    ``safe_open`` reads a file object.

    Called with a list of ``(offset, length)``, it returns the bytes of each,
    read one range at a time under a lock (the object has one position),
    through ``readinto`` where the object has it. An answer longer than asked,
    or not bytes, is refused; a short one is returned as it is (the reader
    reports it, naming the tensor).

    Parameters
    ----------
    file : binary file object
        Open, with ``seek`` and ``read``.
    label : str
        What messages call it.

    Attributes
    ----------
    size : int
        The file's size (found by seeking to its end).

    Raises
    ------
    SafetensorError
        When the file object is closed or cannot seek (a pipe, a socket).

    Examples
    --------
    >>> import io
    >>> from fastst.remote import FileObjectRanges
    >>> ranges = FileObjectRanges(io.BytesIO(b"0123456789"), "<digits>")
    >>> ranges.size, [bytes(part) for part in ranges([(2, 3), (8, 2)])]
    (10, [b'234', b'89'])
    """

    def __init__(self, file: Any, label: str) -> None:
        self.file = file
        self.source = label     # what messages call it
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
        core then reports the short read).

        Raises
        ------
        SafetensorError
            When the file object gives more bytes than asked for, or something
            else than bytes.
        """
        self.file.seek(offset)
        if self.readinto is None:
            pieces, done = [], 0
            while done < length:
                piece = self.file.read(length - done)
                if not piece:
                    break
                if not isinstance(piece, (bytes, bytearray, memoryview)):
                    raise SafetensorError(f"{self.source}: the file object's read returned "
                                          f"a {type(piece).__name__}, not bytes")
                done += self.within(memoryview(piece).nbytes, length - done, "read")
                pieces.append(piece)
            return b"".join(pieces)
        buffer = bytearray(length)
        view, done = memoryview(buffer), 0
        while done < length:
            count = self.readinto(view[done:])
            if not count:
                break
            done += self.within(count, length - done, "readinto")
        return view[:done]

    def within(self, count: Any, room: int, call: str) -> int:
        """`count`, the bytes the file object's `call` says it gave when asked for at
        most `room`.

        Raises
        ------
        SafetensorError
            When `count` is more than `room`, or not a count.
        """
        if not isinstance(count, int) or count < 0:
            raise SafetensorError(f"{self.source}: the file object's {call} returned "
                                  f"{count!r}, not a count of bytes")
        if count > room:
            raise SafetensorError(f"{self.source}: the file object's {call} gave {count} "
                                  f"bytes when asked for {room} (too long)")
        return count


# ---------------------------------------------------------------------------
# URLs, through fsspec
# ---------------------------------------------------------------------------


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

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        super().__init__()
        self.url, self.label = url, shown_url(url)
        self.storage_options = dict(storage_options or {})
        self.limits = read_limits(url, self.storage_options)
        self.pace = self.limits.pace(url)
        fs, self.path = _url_to_fs(url, self.storage_options)
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
    protocols = _protocols(fs)
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


def _url_to_fs(url: str, storage_options: Dict[str, Any]) -> Tuple[AbstractFileSystem, str]:
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
    those options), HTTP sends the headers ``fastst._ranged.precondition`` gives
    (If-Match, or If-Unmodified-Since `modified` where the ETag is weak or none)."""
    protocols = _protocols(fs)
    if protocols & set(HTTP_PROTOCOLS):
        condition = precondition(etag, modified if isinstance(modified, str) else None)
        if not condition:
            return fs, {}
        return fs, {"headers": {**options.get("headers", {}), **condition}}
    if etag is not None and protocols & set(S3_PROTOCOLS):
        extra = {**fs.storage_options.get("s3_additional_kwargs", {}), "IfMatch": etag}
        return type(fs)(**{**fs.storage_options, "s3_additional_kwargs": extra}), {}
    return fs, {}


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


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
    fs, path = _url_to_fs(target, options)
    limits = read_limits(target, options)
    try:
        if _is_local(fs):
            write_atomically(plan, path)
        elif (_protocols(fs) & set(S3_PROTOCOLS)
              and plan.total_size > _MultipartUpload.part_size_for(limits, plan.total_size)):
            upload = _MultipartUpload(fs, path, limits, plan.total_size)
            upload.send(lambda file: plan.write_stream(file, shown_url(target)))
        elif _is_staged(fs):
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

    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
        self.url, self.label = url, shown_url(url)
        self.storage_options = dict(storage_options or {})
        self.fs, self.remote_path = _url_to_fs(url, self.storage_options)
        self.spool: Optional[str] = None
        if _is_local(self.fs):
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
            if _protocols(self.fs) & set(S3_PROTOCOLS):
                self.upload_in_parts()
            elif _is_staged(self.fs):
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
