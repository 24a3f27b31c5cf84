"""HTTP(S) objects read by byte ranges through the standard library's ``http.client``.

A read's parts (``fastst._io.ranged.PartQueue``, sized and counted by its ``Pace``) are
taken by threads, as many at once as the pace allows; each thread holds a connection
open from one request to the next and reads its answers' bodies from the socket
straight into the arrays (``readinto``), the GIL released while it waits. aiohttp
(fsspec's HTTP file system) and obstore hand each piece of a body over as a new
bytes object to be copied into place, aiohttp on one event-loop thread; on a fast
link that copy and the Python around it were the limit (bench/RESULTS.md, "Object
stores").

Every answer is held to what ``fastst._io.ranged.checked_answer`` asks of it, and its
body is read one socket read at a time, never past the bytes it should hold; every
wait (connecting, each socket read of an answer, its head and the bodies of redirects
included) is bounded by the read timeout and by the call's deadline, after which the
call raises ``TimeoutError``. Informational answers (1xx: ``100 Continue``, ``103
Early Hints``...) before an answer are skipped, 16 in a row at most. Redirects are
followed (10 at most), once at opening for the parts that follow (a signed location
that expires is looked up again from the URL given); credentials go to the URL's own
host only.
"""
from __future__ import annotations

import base64
import errno
import functools
import http.client
import io
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import weakref
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from .._core import SafetensorError
from .ranged import (READ_PIECE, Limits, ObjectVersion, PartQueue, Range, RangedObject, Scatter,
                     Span, Tally, changed, check_version, checked_answer, precondition,
                     precondition_failed, shown_url, too_long, translated)

SCHEMES = {"http": 80, "https": 443}
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 10
EXPIRED = (401, 403, 404, 410)   # what a signed location answers once it has expired
SMALL_BODY = 64 << 10            # a redirect's or an error's body read to keep its connection
MAX_INFORMATIONAL = 16           # informational answers (1xx) skipped in a row, at most
# fsspec's HTTP options that shape its own caching and listings: nothing to this client
IGNORED_OPTIONS = ("skip_instance_cache", "use_listings_cache", "listings_expiry_time",
                   "block_size", "cache_type", "cache_options", "simple_links", "same_scheme",
                   "size_policy", "encoded")
CLIENT_OPTIONS = ("timeout", "headers")          # of client_kwargs
PRIVATE_HEADERS = ("authorization", "cookie", "proxy-authorization")


def refusal(url: str, options: Mapping[str, Any]) -> Optional[str]:
    """None where this client reads `url` with `options` (fastst's own keys taken out);
    else what it does not take."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        return f"{scheme}:// URLs are read through fsspec"
    for key, value in options.items():
        if key in IGNORED_OPTIONS or (key == "headers" and _are_headers(value)):
            continue
        if key == "client_kwargs" and _are_client_options(value):
            continue
        return f"storage_options[{key!r}] is taken by fsspec's HTTP file system only"
    return None


def _are_headers(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(name, str) and isinstance(said, str) for name, said in value.items())


def _are_client_options(value: Any) -> bool:
    if not isinstance(value, Mapping) or any(key not in CLIENT_OPTIONS for key in value):
        return False
    timeout = value.get("timeout")
    return _are_headers(value.get("headers", {})) and (
        timeout is None or hasattr(timeout, "sock_read"))


class Target(NamedTuple):
    """Where a request goes: a URL cut into what a connection and a request need."""
    url: str
    scheme: str
    host: str
    port: int
    path: str        # with its query, quoted

    @property
    def origin(self) -> Tuple[str, str, int]:
        return self.scheme, self.host, self.port


def target_of(url: str) -> Target:
    """The Target of an ``http(s)://`` URL; its user and password, where it has them,
    become a Basic Authorization header (see `_credentials`)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES or not parts.hostname:
        raise SafetensorError(f"{shown_url(url)}: not an http:// or https:// URL with a host")
    try:
        port = parts.port or SCHEMES[scheme]
    except ValueError as error:
        raise SafetensorError(f"{shown_url(url)}: {error}") from None
    path = urllib.parse.quote(parts.path or "/", safe="/%:@!$&'()*+,;=~")
    if parts.query:
        path += "?" + urllib.parse.quote(parts.query, safe="/%:@!$&'()*+,;=~?")
    return Target(url, scheme, parts.hostname, port, path)


def _credentials(url: str) -> Dict[str, str]:
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return {}
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return {"Authorization": f"Basic {token}"}


class Call:
    """One call's state, shared by its threads under `lock`: when it must end, whether
    it was cancelled (its first error), and the sockets its requests wait on, shut
    down to end those waits at once."""

    def __init__(self, lock: threading.Lock, seconds: float) -> None:
        self.condition = threading.Condition(lock)
        self.deadline = time.monotonic() + seconds
        self.error: Optional[BaseException] = None
        self.workers = 0
        self.sockets: set = set()

    def wait_on(self, sock: socket.socket, timeout: float) -> None:
        """Before a wait on `sock`: at most `timeout` seconds, and none past the
        deadline or once the call is cancelled."""
        left = self.deadline - time.monotonic()
        if self.error is not None:
            raise ConnectionAbortedError("the call was cancelled")
        if left <= 0:
            raise TimeoutError("the call's deadline passed")
        sock.settimeout(min(timeout, left))

    # a set's add and discard are atomic, and fail() shuts down a copy of it: no lock
    def watch(self, sock: socket.socket) -> None:
        self.sockets.add(sock)

    def unwatch(self, sock: socket.socket) -> None:
        self.sockets.discard(sock)

    def fail(self, error: BaseException) -> None:
        """Keep the call's first error and end every wait of its other requests."""
        with self.condition:
            if self.error is None:
                self.error = error
            for sock in list(self.sockets):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.condition.notify_all()


class CallReader(io.RawIOBase):
    """A socket's bytes read for a call: each read waits no longer than the read
    timeout, nor past the call's deadline, and ends when the call is cancelled (the
    socket watched while it waits)."""

    def __init__(self, raw: io.RawIOBase, sock: socket.socket, call: Call,
                 timeout: float) -> None:
        super().__init__()
        self.raw, self.sock, self.call, self.timeout = raw, sock, call, timeout
        # TLS has no scattering read, nor has Windows
        self.scatters = hasattr(sock, "recvmsg_into") and not isinstance(sock, ssl.SSLSocket)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> Optional[int]:
        got: Optional[int] = self._when_ready(self.raw.readinto, buffer)
        return got

    def readinto_each(self, buffers: List[memoryview]) -> int:
        """As `readinto`, the bytes read going into `buffers` in turn (one
        ``recvmsg_into``; only where `scatters`)."""
        got: int = self._when_ready(self.sock.recvmsg_into, buffers)[0]
        return got

    def _when_ready(self, read: Callable[[Any], Any], into: Any) -> Any:
        """``read(into)`` once the socket has bytes to read (see the class)."""
        self.call.watch(self.sock)     # before wait_on looks at whether it was cancelled
        try:
            self.call.wait_on(self.sock, self.timeout)
            return read(into)
        finally:
            self.call.unwatch(self.sock)

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()


class CallResponse(http.client.HTTPResponse):
    """An answer read for a call, its head and its body through a `CallReader`; the
    informational answers (1xx but 101) before it skipped, MAX_INFORMATIONAL in a row
    at most."""

    def __init__(self, sock: socket.socket, *args: Any, call: Call, timeout: float,
                 object_url: str, **kwargs: Any) -> None:
        super().__init__(sock, *args, **kwargs)
        # the buffered reader over the socket's raw reader, this one between them
        self.fp = io.BufferedReader(CallReader(self.fp.detach(), sock, call, timeout))
        self.object_url = object_url

    def _read_status(self) -> Tuple[str, int, str]:
        for _ in range(MAX_INFORMATIONAL + 1):
            version, status, reason = super()._read_status()  # type: ignore[misc]
            if not 100 <= status < 200 or status == 101:
                return version, status, reason
            http.client.parse_headers(self.fp)    # its head, skipped
        raise SafetensorError(f"{self.object_url}: the server sent more than "
                              f"{MAX_INFORMATIONAL} informational answers (1xx) in a row")


class Connections:
    """Connections kept open between requests, by origin, each lent to one thread at a
    time. A process forked with some open forgets them: they are the parent's."""

    def __init__(self, connect_timeout: float, most_idle: int) -> None:
        self.connect_timeout = connect_timeout
        self.most_idle = most_idle
        self.idle: Dict[Tuple[str, str, int], List[http.client.HTTPConnection]] = {}
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.context: Optional[ssl.SSLContext] = None

    def take(self, target: Target) -> Tuple[http.client.HTTPConnection, bool]:
        """A connection to `target`'s origin, and whether it served a request before."""
        with self.lock:
            self._forget_if_forked()
            kept = self.idle.get(target.origin)
            if kept:
                return kept.pop(), True
        return self.new(target), False

    def new(self, target: Target) -> http.client.HTTPConnection:
        if target.scheme == "https":
            if self.context is None:
                self.context = ssl.create_default_context()
            return http.client.HTTPSConnection(target.host, target.port,
                                               timeout=self.connect_timeout,
                                               context=self.context)
        return http.client.HTTPConnection(target.host, target.port,
                                          timeout=self.connect_timeout)

    def give(self, target: Target, connection: http.client.HTTPConnection) -> None:
        """Keep `connection` (its last answer read whole) for the next request."""
        with self.lock:
            self._forget_if_forked()
            kept = self.idle.setdefault(target.origin, [])
            if len(kept) < self.most_idle:
                kept.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self.lock:
            for kept in self.idle.values():
                for connection in kept:
                    connection.close()
            self.idle.clear()

    def _forget_if_forked(self) -> None:
        if os.getpid() != self.pid:
            for kept in self.idle.values():
                for connection in kept:
                    connection.close()    # this process's descriptor only: no shutdown
            self.idle.clear()
            self.pid = os.getpid()


class Exchange(NamedTuple):
    """A request answered: where it went, its connection, and the head of its answer
    (the body is the taker's to read or drop)."""
    target: Target
    connection: http.client.HTTPConnection
    answer: http.client.HTTPResponse

    def end(self, connections: Optional[Connections] = None) -> None:
        """Be done with an answer whose body is not wanted: a small one of declared
        length is read and its connection kept (in `connections`); any other closes
        the connection."""
        answer, length = self.answer, self.answer.length
        if (connections is not None and not answer.chunked and length is not None
                and length <= SMALL_BODY and not answer.will_close):
            try:
                answer.read()
                connections.give(self.target, self.connection)
                return
            except (OSError, http.client.HTTPException):
                pass
        self.connection.close()


class Head(NamedTuple):
    """What looking an object up told of it."""
    location: Target     # where its bytes were found, after redirects
    size: Optional[int]
    etag: Optional[str]
    modified: Optional[str]
    ranges_ignored: bool


class HttpRanges(RangedObject):
    """Byte ranges of the object an ``http(s)://`` URL names, read by this client (see
    the module): what ``fastst.remote.open_object`` gives for such a URL.

    Making one looks the object up: a HEAD (and, where that gives no size or is
    refused, as a URL signed for GET refuses it, a GET of its first byte), following
    redirects. Called, or through ``fetch_into``, it fetches ranges as
    ``RangedObject`` says, each request with ``If-Match`` on the ETag seen at
    opening (``If-Unmodified-Since`` its Last-Modified date, from a server that gives
    no strong ETag).

    Parameters
    ----------
    url : str
        An ``http://`` or ``https://`` URL.
    storage_options : mapping
        ``headers`` sent with every request, and ``client_kwargs`` with
        ``timeout`` (an ``aiohttp.ClientTimeout``: its ``sock_connect``,
        ``sock_read`` and ``total``) and ``headers``, as fsspec's HTTP file system
        takes them; other keys are fsspec's caching options, or fastst's own.
    limits : Limits
        The bounds of its reads.

    Raises
    ------
    FileNotFoundError
        When the server has no such object (404).
    PermissionError
        When it refuses it (401, 403).
    SafetensorError
        When it gives no size for it, or redirects too often.
    OSError
        When the server fails (`TimeoutError` when it does not answer in time).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any], limits: Limits) -> None:
        super().__init__()
        self.url, self.label, self.limits = url, shown_url(url), limits
        self.pace = limits.pace(url)
        client = storage_options.get("client_kwargs", {})
        self.connect_timeout, self.read_timeout = _timeouts(client.get("timeout"), limits)
        self.headers = {**client.get("headers", {}), **storage_options.get("headers", {}),
                        **_credentials(url), "Accept-Encoding": "identity"}
        self.given = target_of(url)
        self.connections = Connections(self.connect_timeout, limits.max_requests)
        weakref.finalize(self, self.connections.close)
        self.lock = threading.Lock()    # the pace, a call's tally, the location
        _OPEN.add(self)
        head = self._look_up("opening it")
        if head.size is None:
            raise SafetensorError(f"{self.label}: the store gives no size for the object (it is "
                                  f"read by byte ranges, which need one)")
        self.location = head.location
        self.size = head.size
        self.etag = head.etag
        self.version = ObjectVersion(self.label, head.size, head.etag, head.modified)
        self.identity = tuple(self.version)
        self.ranges_ignored = head.ranges_ignored
        self.condition = precondition(head.etag, head.modified)

    # -- reading ------------------------------------------------------------

    def _fetch(self, ranges: Sequence[Range], spans: List[Span], targets: List[Scatter],
               on_bytes: Optional[Callable[[int], None]]) -> None:
        call = Call(self.lock, self.limits.seconds_for(sum(length for _, length in ranges)))
        parts = PartQueue(spans, self.pace, self.ranges_ignored)
        tally = Tally(self.pace, on_bytes)
        try:
            self._fetch_parts(call, parts, tally, spans, targets)
        except Exception as error:
            part = getattr(error, "fastst_range", None)
            doing = (f"reading {len(ranges)} byte ranges" if part is None else
                     f"reading bytes [{part[0]}, {part[0] + part[1]})")
            raise translated(error, self.url, doing)
        return None

    def _fetch_parts(self, call: Call, parts: PartQueue, tally: Tally, spans: List[Span],
                     targets: List[Scatter]) -> None:
        """The parts, fetched by threads as many at once as the pace allows (by this
        thread where there is one part only); the first error ends them all."""
        with self.lock:
            self.pace.start_at_first_byte()
            first = parts.next()
        if first is None:
            return
        if not parts:
            self._fetch_part(call, tally, spans, targets, first)
            return

        def work(part: Optional[Tuple[int, int, int]]) -> None:
            try:
                while part is not None:
                    self._fetch_part(call, tally, spans, targets, part)
                    with call.condition:
                        more = call.error is None and call.workers <= self.pace.allowed
                        part = parts.next() if more else None
            except BaseException as error:
                call.fail(error)
            finally:
                with call.condition:
                    call.workers -= 1
                    call.condition.notify_all()

        threads: List[threading.Thread] = []

        def start(part: Optional[Tuple[int, int, int]]) -> None:
            thread = threading.Thread(target=work, args=(part,), daemon=True,
                                      name="fastst-http")
            call.workers += 1
            threads.append(thread)
            thread.start()

        try:
            with call.condition:
                start(first)
                while True:
                    while (call.error is None and call.workers < self.pace.allowed
                           and parts):
                        start(parts.next())
                    if call.workers == 0:
                        break
                    if not parts:
                        self.pace.starved = True
                    # woken by a thread's end, or soon enough to start those a better
                    # pace allows
                    call.condition.wait(self.pace.MIN_WINDOW / 4)
        except BaseException as error:   # an interrupt: end the requests, then go
            call.fail(error)
            raise
        finally:
            for thread in threads:
                thread.join()
        if call.error is not None:
            raise call.error

    def _fetch_part(self, call: Call, tally: Tally, spans: List[Span],
                    targets: List[Scatter], part: Tuple[int, int, int]) -> None:
        k, offset, size = part
        span = spans[k]
        into = targets[k].part(offset - span.offset, offset - span.offset + size)
        with self.lock:
            asked = tally.part_asked()

        def progress(count: int) -> None:
            with self.lock:
                asked(count)

        try:
            got = self._get(call, offset, size, into, progress)
        except BaseException as error:
            error.fastst_range = (offset, size)   # type: ignore[attr-defined]
            raise
        if got < size:
            with self.lock:
                span.holes.append((offset + got, offset + size))

    def _get(self, call: Call, offset: int, length: int, into: Scatter,
             progress: Callable[[int], None]) -> int:
        """Bytes [offset, offset + length) into `into`; returns how many came (fewer
        where the answer was cut short). A location that redirects led to and that
        now refuses (it expired) is looked up again from the URL, once."""
        headers = {**self.condition, "Range": f"bytes={offset}-{offset + length - 1}"}
        location = self.location
        exchange = self._request(call, "GET", location, headers)
        if exchange.answer.status in EXPIRED and location != self.given:
            exchange.end()
            self._look_up_again(location)
            exchange = self._request(call, "GET", self.location, headers)
        progress(0)     # its head: the part's time to its first byte
        try:
            got, whole = self._read_answer(exchange, offset, length, into, progress)
        except BaseException:
            exchange.connection.close()
            raise
        if whole:
            self.ranges_ignored = True
        if whole or not exchange.answer.isclosed():
            exchange.connection.close()   # the rest of the body goes unread, with it
        else:
            self.connections.give(exchange.target, exchange.connection)
        return got

    def _read_answer(self, exchange: Exchange, offset: int, length: int, into: Scatter,
                     progress: Callable[[int], None]) -> Tuple[int, bool]:
        """Check an answer to a ranged GET and read its body into `into`: the bytes
        read, and whether the body goes on (the whole object: left unread)."""
        asked = f"bytes [{offset}, {offset + length})"
        answer = exchange.answer
        if answer.status == 412:
            raise precondition_failed(self.label, f"reading {asked}")
        _refuse_failure(self.label, answer, f"reading {asked}")
        _refuse_encoding(self.label, answer, asked)
        said = answer.headers
        declared = None if answer.chunked else answer.length
        body, whole = checked_answer(self.version, offset, length, answer.status,
                                     said.get("Content-Range"), declared, said.get("ETag"),
                                     said.get("Last-Modified"))
        if declared is not None:
            got = _read_declared(answer, into, min(body, declared), progress)
            if got == declared:
                answer.close()    # read whole: the connection serves the next request
            return got, whole
        got = _read_undeclared(answer, into, body, progress)
        if not whole and got == body:
            if answer.read1(1):
                raise too_long(self.label, offset, length, body)
            answer.close()
        return got, whole

    # -- requests -------------------------------------------------------------

    def _request(self, call: Call, method: str, start: Target,
                 headers: Dict[str, str]) -> Exchange:
        """`method` on `start`, following redirects, to the answer that is not one.
        Credentials are not sent past the origin of the URL given."""
        sent = {**self.headers, **headers}
        target = start
        for _ in range(MAX_REDIRECTS + 1):
            if target.origin != self.given.origin:
                sent = {name: value for name, value in sent.items()
                        if name.lower() not in PRIVATE_HEADERS}
            exchange = self._exchange(call, method, target, sent)
            location = exchange.answer.getheader("Location")
            if exchange.answer.status not in REDIRECTS or not location:
                return exchange
            exchange.end(self.connections)
            target = target_of(urllib.parse.urljoin(target.url, location))
        raise SafetensorError(f"{self.label}: more than {MAX_REDIRECTS} redirects")

    def _exchange(self, call: Call, method: str, target: Target,
                  headers: Dict[str, str]) -> Exchange:
        """One request and the head of its answer, on a kept connection where there is
        one (asked again on a new connection when a kept one was closed by the
        server meanwhile)."""
        connection, kept = self.connections.take(target)
        while True:
            try:
                return self._send(call, target, connection, method, headers)
            except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
                    http.client.RemoteDisconnected):
                connection.close()
                if not kept or call.error is not None:
                    raise
                connection, kept = self.connections.new(target), False
            except BaseException:
                connection.close()
                raise

    def _send(self, call: Call, target: Target, connection: http.client.HTTPConnection,
              method: str, headers: Dict[str, str]) -> Exchange:
        if connection.sock is None:
            left = call.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the call's deadline passed")
            connection.timeout = min(self.connect_timeout, left)
            connection.connect()
        call.wait_on(connection.sock, self.read_timeout)    # sending the request
        connection.response_class = functools.partial(  # type: ignore[assignment]
            CallResponse, call=call, timeout=self.read_timeout, object_url=self.label)
        connection.request(method, target.path, headers=headers)
        return Exchange(target, connection, connection.getresponse())

    # -- looking the object up ----------------------------------------------

    def _look_up(self, doing: str) -> Head:
        """The object's size, version and location: a HEAD, or, where that gives no
        size (or is refused), a GET of its first byte, whose Content-Range gives it."""
        call = Call(self.lock, self.limits.seconds_for(0))
        try:
            exchange = self._request(call, "HEAD", self.given, {})
            exchange.end(self.connections)
            answer = exchange.answer
            if answer.status == 404:
                raise FileNotFoundError(errno.ENOENT, "No such object", self.label)
            size = _size_said(answer) if answer.status == 200 else None
            if size is None:
                return self._look_up_by_get(call, doing)
            no_ranges = (answer.getheader("Accept-Ranges") or "").strip().lower() == "none"
            return _head(exchange.target, size, answer, no_ranges)
        except Exception as error:
            raise translated(error, self.url, doing)

    def _look_up_by_get(self, call: Call, doing: str) -> Head:
        exchange = self._request(call, "GET", self.given, {"Range": "bytes=0-0"})
        answer = exchange.answer
        exchange.connection.close()    # whatever its body, nothing of it is wanted
        if answer.status == 200:       # the range ignored: its length is the object's
            length = None if answer.chunked else answer.length
            return _head(exchange.target, length, answer, True)
        if answer.status not in (206, 416):   # 416: an empty object has no first byte
            _refuse_failure(self.label, answer, doing)
        match = _TOTAL.match(answer.getheader("Content-Range") or "")
        size = int(match.group(1)) if match and match.group(1) != "*" else None
        return _head(exchange.target, size, answer, False)

    def _look_up_again(self, expired: Target) -> None:
        """Look the object up from the URL again, where `expired`, the location its
        redirects led to, refuses a request: the same object, found anew."""
        with self.lock:
            if self.location != expired:
                return      # another thread found it anew
        head = self._look_up("opening it again (its location expired)")
        if head.size != self.size:
            raise changed(self.version, f"found again as {head.size} bytes, was "
                                        f"{self.size}", "it again")
        check_version(self.version, head.etag, head.modified, "it again")
        with self.lock:
            self.location = head.location


_OPEN: weakref.WeakSet[HttpRanges] = weakref.WeakSet()    # given new locks in a fork's child


def _new_locks_in_a_forked_child() -> None:
    """Give each object locks of its own in a forked child: a thread of the parent may
    have held one when it forked, and no thread of the child would release it."""
    for ranges in _OPEN:
        ranges.lock = threading.Lock()
        ranges.connections.lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_in_a_forked_child)

_TOTAL = re.compile(r"^\s*bytes\s+(?:\d+-\d+|\*)/(\d+|\*)\s*$", re.IGNORECASE)


def _head(target: Target, size: Optional[int], answer: http.client.HTTPResponse,
          ranges_ignored: bool) -> Head:
    return Head(target, size, answer.getheader("ETag"), answer.getheader("Last-Modified"),
                ranges_ignored)


def _size_said(answer: http.client.HTTPResponse) -> Optional[int]:
    said = (answer.getheader("Content-Length") or "").strip()
    encoding = (answer.getheader("Content-Encoding") or "identity").strip().lower()
    return int(said) if said.isdigit() and encoding == "identity" else None


def _timeouts(timeout: Any, limits: Limits) -> Tuple[float, float]:
    """(connect, read) timeouts: `limits`' unless ``client_kwargs['timeout']`` (an
    ``aiohttp.ClientTimeout``, as fsspec's HTTP file system takes it) sets them."""
    if timeout is None:
        return limits.connect_timeout, limits.read_timeout
    connect = (getattr(timeout, "sock_connect", None) or getattr(timeout, "connect", None)
               or limits.connect_timeout)
    read = getattr(timeout, "sock_read", None) or limits.read_timeout
    total = getattr(timeout, "total", None)
    if total:
        connect, read = min(connect, total), min(read, total)
    return connect, read


def _refuse_failure(label: str, answer: http.client.HTTPResponse, doing: str) -> None:
    """Raise for an answer that is an error: 404 as FileNotFoundError, 401 and 403 as
    PermissionError, any other of 400 and above as OSError."""
    status = answer.status
    if status == 404:
        raise FileNotFoundError(errno.ENOENT, "No such object", label)
    if status in (401, 403):
        raise PermissionError(errno.EACCES, f"{doing}: the server refused it "
                                            f"({status} {answer.reason})", label)
    if status >= 400:
        raise OSError(f"{label}: {doing} failed: HTTP {status} {answer.reason}")


def _refuse_encoding(label: str, answer: http.client.HTTPResponse, asked: str) -> None:
    encoding = (answer.getheader("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise SafetensorError(f"{label}: the server sent {asked} encoded ({encoding}), not as "
                              f"the object holds them")


def _read_declared(answer: http.client.HTTPResponse, into: Scatter, count: int,
                   progress: Callable[[int], None]) -> int:
    """The first `count` bytes of a body of declared length, read into `into` one
    socket read at a time, straight from the socket (``readinto1`` of the answer's
    buffered reader); fewer where the body ends early. Where the buffers are smaller
    than a read (the arrays of small tensors), a read fills several of them, once the
    buffered reader has handed over what it holds: a read a buffer cost each small
    tensor a wait on the socket and a pass of the GIL between the request threads."""
    stream = answer.fp
    reader = stream.raw
    scatters = isinstance(reader, CallReader) and reader.scatters
    direct = False      # the buffered reader holds none of the body: read the socket
    done = 0
    while done < count:
        most = min(READ_PIECE, count - done)
        if direct:
            got = reader.readinto_each(into.windows(done, most))
        else:
            window = into.window(done, most)
            if scatters and window.nbytes < most:
                got, direct = _take_buffered(stream, into, done, most)
            else:
                got = stream.readinto1(window)
        if not got:
            break
        done += got
        progress(got)
    return done


def _take_buffered(stream: io.BufferedReader, into: Scatter, at: int, most: int
                   ) -> Tuple[int, bool]:
    """What `stream` holds (reading the socket once where it holds nothing), `most`
    bytes at most, put into `into` from `at` on: how many, and whether that was all it
    held."""
    held = stream.peek()        # all it holds
    taken = held[:most]
    into.put(at, taken)
    stream.read(len(taken))     # from what it holds: no read of the socket
    return len(taken), len(held) <= most


def _read_undeclared(answer: http.client.HTTPResponse, into: Scatter, count: int,
                     progress: Callable[[int], None]) -> int:
    """The first `count` bytes of a chunked body, or one that ends with its
    connection, read a piece at a time; fewer where it ends early."""
    done = 0
    while done < count:
        piece = answer.read1(min(READ_PIECE, count - done))
        if not piece:
            break
        into.put(done, piece)
        done += len(piece)
        progress(len(piece))
    return done
