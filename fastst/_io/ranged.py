"""Reading an object by ranged requests, whatever carries them: the bounds a read works
within, the version of the object opened and the checks each answer is held to, how
many requests go at once and how large (``Pace``), the contract of the fetch through
which the compiled Reader reads such an object (``RangedFetch``), and ``RangedObject``,
on which transports build it.

Two transports build on it: ``fastst._io.http`` (HTTP(S) through the standard library's
``http.client``, threads reading straight into the arrays) and ``fastst.remote``'s
``UrlRanges`` (any fsspec URL, on fsspec's event loop). Each carries parts; this module
says which parts, and whether an answer is the bytes asked of the object opened.
"""
from __future__ import annotations

import bisect
import re
import threading
import time
import traceback
import urllib.parse
from typing import (Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Protocol,
                    Sequence, Tuple)

import numpy as np

from .._core import SafetensorError
from . import limits as knobs
from .progress import PROGRESS_MIN_BYTES, ByteBar, byte_bar

SLOWEST_RATE = 256 << 10   # bytes a second below which a call's answer counts as stalled
SMALLEST_PART = 4 << 20   # parts are cut no smaller than this, but for a range's last
READ_PIECE = 1 << 20     # most bytes taken from an answer's body at a time
JOINED_GAP = 4 << 10     # ranges of a fetch_into this close share a request, the gap dropped
Range = Tuple[int, int]


class Limits(NamedTuple):
    """The bounds a read of one object works within: ``fastst.remote``'s constants,
    with the bounds a call's ``storage_options`` give."""
    connect_timeout: float
    read_timeout: float
    start_requests: int
    max_requests: int
    part_size: int
    max_whole_read: int

    def seconds_for(self, size: int) -> float:
        """How long a call that moves `size` bytes may take in all: the connect and
        read timeouts, plus the time `size` bytes take at SLOWEST_RATE. A store's own
        timeouts apply per attempt, and s3fs and botocore retry timed-out attempts
        many times over; this bounds them all."""
        return self.connect_timeout + self.read_timeout + size / SLOWEST_RATE

    def pace(self, url: Optional[str] = None) -> Pace:
        """A new `Pace` within these bounds: `start_requests` at first, `max_requests`
        at most, parts of `part_size` at most; for a `url` on a store that this
        process read before (the same scheme and host), at the level its last read
        reached (see `Pace`)."""
        parts = None if url is None else _url_parts(url)
        store = None if parts is None else (parts[0] + parts[1].rpartition("@")[2],
                                            self.max_requests, self.part_size)
        return Pace(self.start_requests, self.max_requests, self.part_size, store)


# The level (requests allowed, settled) that the last read of each store reached, by the
# `store` of its Pace: a new object on it goes on from there.
LEARNED: Dict[Any, Tuple[int, bool]] = {}


class ObjectVersion(NamedTuple):
    """The object a URL named when it was opened: each answer must be from it."""
    label: str       # the URL as messages show it (``shown_url``)
    size: int
    etag: Optional[str]
    modified: Any


class Pace:
    """How many requests the reader of one URL keeps in flight, and how large they
    are: learned while it reads, and kept from one read to the next, and for the
    next URL on the same `store` (a checkpoint's shards, the next load of a file).

    It starts with `low` requests and, as TCP's slow start does, doubles them each
    time that makes the bytes come in at least `GROWTH` times faster than at the level
    measured before, up to `high`; it quadruples them while each request brings less
    than `CAPPED_RATE` bytes a second, and multiplies them by 8 while each brings less
    than half that (a store that caps each connection, as S3, GCS and CDNs do: many
    more are needed, and a small file would be read before doubling found them). When a level does not pay (`CHANCES` windows in a row), it goes back
    to the last that did and keeps it. A level is measured over a window of at least
    `MIN_WINDOW` seconds and `LATENCIES` times a request's time to its first byte,
    from the first byte of a read on, and from one such time after the level was
    raised (when the requests added bring their first bytes), while every request it
    allows has a part to fetch (a read too small to fill them teaches nothing). Parts
    are `part_size` bytes, smaller once fewer remain than would keep every request
    busy to the last byte.

    Parameters
    ----------
    low, high : int
        The requests in flight at first, and at most.
    part_size : int
        The largest request, in bytes.
    store : hashable, optional
        What tells the store read, and these bounds, apart: a Pace made for a
        store that one made before learned a level on starts at that level.

    Attributes
    ----------
    allowed : int
        The requests in flight now allowed.
    settled : bool
        Whether it stopped adding requests.

    Examples
    --------
    >>> from fastst.remote import Pace
    >>> pace = Pace(2, 16, 8 << 20)
    >>> def seen(second, mib):   # bytes come in: by then, `mib` MiB in all
    ...     pace.progress(second, mib << 20)
    ...     return pace.allowed
    >>> seen(0, 0), seen(1, 200)        # a read's first byte, then 200 MiB/s with 2
    (2, 4)
    >>> seen(1, 200), seen(2, 600)      # the 2 added bring bytes: 400 MiB/s with 4
    (4, 8)
    >>> seen(2, 600), seen(3, 1100), seen(4, 1600)   # 500 MiB/s with 8, twice: back to 4
    (8, 8, 4)
    >>> pace.settled
    True
    >>> capped = Pace(2, 32, 8 << 20)   # each request brings 40 MiB/s: 4 times as many
    >>> capped.progress(0, 0); capped.progress(1, 80 << 20); capped.allowed
    8
    >>> slow = Pace(2, 32, 8 << 20)     # each brings 20 MiB/s: 8 times as many
    >>> slow.progress(0, 0); slow.progress(1, 40 << 20); slow.allowed
    16
    >>> pace.part_for(64 << 20), pace.part_for(40 << 20)   # smaller parts at the end
    (8388608, 5242880)
    """

    __module__ = "fastst.remote"

    GROWTH = 1.3
    CHANCES = 2
    MIN_WINDOW = 0.05
    LATENCIES = 2
    CAPPED_RATE = 64 << 20

    def __init__(self, low: int, high: int, part_size: int, store: Any = None) -> None:
        self.high = high
        self.part_size = part_size
        self.store = store
        self.allowed, self.settled = LEARNED.get(store, (min(low, high), low >= high))
        self.best_rate = 0.0
        self.best_allowed = self.allowed
        self.misses = 0          # windows in a row that the level now allowed did not pay
        self.latency = 0.0
        self.window: Optional[Tuple[float, int]] = None   # (when it began, bytes by then)
        self.waiting = True      # for a read's first byte, which opens the window
        self.quiet_until = 0.0   # a raised level is measured from then on
        self.starved = False     # a request found no part during the window

    def start(self, now: float, done: int) -> None:
        """Begin measuring at `now`, `done` bytes having come in so far."""
        self.window, self.starved, self.waiting = (now, done), False, False

    def start_at_first_byte(self) -> None:
        """Begin measuring when the next byte comes in (a read's first)."""
        self.waiting = True

    def first_byte_after(self, seconds: float) -> None:
        """Note a request's time to its first byte."""
        self.latency = seconds if not self.latency else 0.7 * self.latency + 0.3 * seconds

    def progress(self, now: float, done: int) -> None:
        """Note that `done` bytes have come in by `now`; judge the level when its
        window is over."""
        if self.settled:
            return
        if self.waiting or self.window is None:
            if now >= self.quiet_until:
                self.start(now, done)
            return
        began, before = self.window
        if now - began < max(self.MIN_WINDOW, self.LATENCIES * self.latency):
            return
        if self.starved:
            self.start(now, done)
            return
        level = self.allowed
        self.judge((done - before) / (now - began))
        self.start(now, done)
        if self.allowed > level:
            self.waiting, self.quiet_until = True, now + self.latency

    def judge(self, rate: float) -> None:
        """Take `rate` (bytes a second) as what the level now allowed gives: double
        the level when it pays (4 or 8 times it while requests are capped), else, after
        `CHANCES` windows that did not, go back to the last that did and keep it."""
        if rate >= self.best_rate * self.GROWTH:
            self.best_rate, self.best_allowed, self.misses = rate, self.allowed, 0
            per_request = rate / self.allowed
            step = (8 if per_request < self.CAPPED_RATE / 2 else
                    4 if per_request < self.CAPPED_RATE else 2)
            self.allowed = min(self.high, step * self.allowed)
            self.settled = self.best_allowed >= self.high
        elif self.misses < self.CHANCES - 1:
            self.misses += 1     # one window can be unlucky on a busy machine
        else:
            self.allowed, self.settled = self.best_allowed, True
        if self.store is not None:
            LEARNED[self.store] = self.allowed, self.settled

    @property
    def smallest_part(self) -> int:
        """The smallest part cut, but for a range's last."""
        return min(SMALLEST_PART, self.part_size)

    def part_for(self, remaining: int) -> int:
        """The size of the next part when `remaining` bytes are still to be asked for."""
        return max(self.smallest_part, min(self.part_size, remaining // (2 * self.allowed)))


class Span:
    """Neighbouring ranges of one read, fetched by parts cut from it into one
    `Scatter`. `holes` are the (start, end) of bytes a part did not bring (an answer
    cut short)."""

    def __init__(self, offset: int) -> None:
        self.offset = self.end = offset
        self.ranges: List[Range] = []
        self.holes: List[Range] = []

    def got(self, offset: int, length: int) -> int:
        """The bytes of range [offset, offset + length) up to its first missing one."""
        end = offset + length
        for first, last in self.holes:
            if first < end and last > offset:
                end = max(first, offset)
        return end - offset

    def view_of(self, buffer: memoryview, offset: int, length: int) -> memoryview:
        """The bytes of range [offset, offset + length) in `buffer`, the span's, up to
        its first missing byte."""
        return buffer[offset - self.offset:offset - self.offset + self.got(offset, length)]


class Scatter:
    """Where the bytes of a span, or of a part of one, go: buffers laid end to end (the
    arrays of neighbouring tensors, say), each filled in turn. An answer's body is
    read into its `window` at each point, straight from the socket."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.views = [view for view in views if view.nbytes]
        self.starts = [0]
        for view in self.views:
            self.starts.append(self.starts[-1] + view.nbytes)
        self.nbytes = self.starts[-1]

    def part(self, start: int, stop: int) -> Scatter:
        """Bytes [start, stop) of these."""
        views = []
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            at, view = self.starts[k], self.views[k]
            views.append(view[start - at:min(stop, self.starts[k + 1]) - at])
            start, k = self.starts[k + 1], k + 1
        return Scatter(views)

    def window(self, at: int, most: int) -> memoryview:
        """The bytes from `at` on that one buffer holds, `most` at most."""
        k = bisect.bisect_right(self.starts, at) - 1
        return self.views[k][at - self.starts[k]:at - self.starts[k] + most]

    def windows(self, at: int, most: int, count: int = 64) -> List[memoryview]:
        """The bytes from `at` on, `most` at most, in the buffers that hold them, the
        first `count` of those at most: for a read that scatters into several."""
        k = bisect.bisect_right(self.starts, at) - 1
        out = []
        while most > 0 and k < len(self.views) and len(out) < count:
            view = self.views[k][at - self.starts[k]:at - self.starts[k] + most]
            out.append(view)
            at, most, k = at + view.nbytes, most - view.nbytes, k + 1
        return out

    def put(self, at: int, data: Any) -> None:
        """Copy `data` in, from `at` on."""
        data = memoryview(data).cast("B")
        while data.nbytes:
            window = self.window(at, data.nbytes)
            window[:] = data[:window.nbytes]
            at, data = at + window.nbytes, data[window.nbytes:]

    def release(self) -> None:
        """Let go of the buffers: writing into them through this raises from now on."""
        for view in self.views:
            view.release()


def spans_of(ranges: Sequence[Range]) -> List[Span]:
    """The ranges, those that follow on in the object joined into one span."""
    spans: List[Span] = []
    for offset, length in ranges:
        if not spans or offset != spans[-1].end:
            spans.append(Span(offset))
        spans[-1].ranges.append((offset, length))
        spans[-1].end = offset + length
    return spans


def joined(ranges: Sequence[Range], views: Sequence[memoryview]
           ) -> Tuple[List[Span], List[Scatter], List[int]]:
    """Spans of `ranges`, each to be fetched into its view: ranges that follow on in
    the object, or with at most JOINED_GAP bytes between them (read into a scrap
    buffer), joined into one span, whatever their order given. Returns the spans,
    the Scatter of each, and the span of each range."""
    scrap = memoryview(bytearray(JOINED_GAP))   # junk: written at once by any part
    spans: List[Span] = []
    pieces: List[List[memoryview]] = []
    span_of = [0] * len(ranges)
    for k in sorted(range(len(ranges)), key=lambda k: ranges[k][0]):
        offset, length = ranges[k]
        gap = offset - spans[-1].end if spans else -1
        if not 0 <= gap <= JOINED_GAP:    # overlapping ranges are never joined
            spans.append(Span(offset))
            pieces.append([])
        elif gap:
            pieces[-1].append(scrap[:gap])
        spans[-1].ranges.append((offset, length))
        spans[-1].end = offset + length
        pieces[-1].append(views[k])
        span_of[k] = len(spans) - 1
    return spans, [Scatter(views) for views in pieces], span_of


class PartQueue:
    """The parts a read of `spans` is cut into, handed out in order: each as large as
    `pace` says for what remains, the last of a span never a crumb; with
    `whole_requests`, each span in one part (a server that ignores ranges). A part is
    (the span's number, its offset in the object, its size). It holds where the next
    part starts, not a list of them: a read of many spans costs no memory more."""

    def __init__(self, spans: List[Span], pace: Pace, whole_requests: bool = False) -> None:
        self.spans, self.pace, self.whole_requests = spans, pace, whole_requests
        self.remaining = sum(span.end - span.offset for span in spans)
        self._start_at(0)

    def __bool__(self) -> bool:
        return self.k < len(self.spans)

    def next(self) -> Optional[Tuple[int, int, int]]:
        """The next part, or None when every part has been handed out."""
        if not self:
            return None
        k, offset = self.k, self.offset
        span = self.spans[k]
        rest = span.end - offset
        size = rest if self.whole_requests else self.pace.part_for(self.remaining)
        smallest = self.pace.smallest_part
        if rest <= size or (rest < size + smallest and rest <= self.pace.part_size):
            size = rest     # the span's last part: no crumb left behind
            self._start_at(k + 1)
        else:
            self.offset = offset + size
        self.remaining -= size
        return k, offset, size

    def _start_at(self, k: int) -> None:
        """Hand out the parts of span `k` next, or of the first after it with bytes."""
        while k < len(self.spans) and self.spans[k].end <= self.spans[k].offset:
            k += 1
        self.k = k
        self.offset = self.spans[k].offset if k < len(self.spans) else 0


class Tally:
    """The bytes the parts of one read have brought, told to its `pace` (and to
    `on_bytes`, a download bar's) as they come in. Its callers take turns (one event
    loop, or a lock)."""

    def __init__(self, pace: Pace, on_bytes: Optional[Callable[[int], None]]) -> None:
        self.pace, self.on_bytes = pace, on_bytes
        self.done = 0

    def part_asked(self) -> Callable[[int], None]:
        """The progress of a part asked for now: called with each count of bytes that
        come in; its first call (a count of 0 where the answer's head came first)
        notes the part's time to its first byte."""
        asked = time.monotonic()
        first = True

        def progress(count: int) -> None:
            nonlocal first
            now = time.monotonic()
            if first:
                self.pace.first_byte_after(now - asked)
                first = False
            self.done += count
            self.pace.progress(now, self.done)
            if self.on_bytes is not None and count:
                self.on_bytes(count)

        return progress


# ---------------------------------------------------------------------------
# Credentials in URLs
# ---------------------------------------------------------------------------

# A query parameter whose name holds one of these, whatever its case, is a credential:
# token, access_token, X-Amz-Security-Token, sig, Signature, X-Amz-Signature,
# X-Amz-Credential, password, key, api_key, secret, auth, session...
SECRET_WORDS = ("auth", "credential", "key", "pass", "pwd", "secret", "session", "sig",
                "token")
HIDDEN = "***"
# Whatever runs around a "://" up to a space or a quote, in another library's text:
# nothing here tells a URL from a path (fastst._io.source does), it only hides.
URL_IN_TEXT = re.compile(r"[\w+.-]+://[^\s'\"<>]+")


def shown_url(url: str) -> str:
    """`url` as messages, reprs, reports and progress bars show it: the user and
    password before its host, and the value of each query parameter named as a
    credential (a name that holds one of SECRET_WORDS, whatever its case), replaced
    by ``***``. Requests go to the URL as given; only what is shown is this.

    Examples
    --------
    >>> shown_url("https://alice:pw@host/m.safetensors?X-Amz-Signature=abc&v=2")
    'https://***:***@host/m.safetensors?X-Amz-Signature=***&v=2'
    >>> shown_url("s3://bucket/model.safetensors")
    's3://bucket/model.safetensors'
    """
    parts = _url_parts(url)
    if parts is None:
        return url
    scheme, authority, rest = parts
    user, at, host = authority.rpartition("@")
    if at:
        authority = f"{HIDDEN}:{HIDDEN}@{host}" if ":" in user else f"{HIDDEN}@{host}"
    path, mark, query = rest.partition("?")
    parameters = [parameter.partition("=") for parameter in query.split("&")]
    query = "&".join(name + equals + (HIDDEN if equals and _is_secret(name) else value)
                     for name, equals, value in parameters)
    return scheme + authority + path + mark + query


def _url_parts(url: str) -> Optional[Tuple[str, str, str]]:
    """`url` cut into its scheme (with "://"), its authority (user, password, host,
    port) and the rest (path, query, fragment); None where it holds no "://"."""
    scheme, marker, after = url.partition("://")
    if not marker:
        return None
    end = min((at for at in map(after.find, "/?#") if at >= 0), default=len(after))
    return scheme + marker, after[:end], after[end:]


def _is_secret(name: str) -> bool:
    plain = urllib.parse.unquote_plus(name).lower()
    return any(word in plain for word in SECRET_WORDS)


def _secrets_of(url: str) -> List[str]:
    """The credentials `shown_url` hides in `url`, as written and decoded."""
    parts = _url_parts(url)
    if parts is None:
        return []
    _, authority, rest = parts
    user = authority.rpartition("@")[0]
    found = user.split(":", 1) if user else []
    for parameter in rest.partition("?")[2].split("&"):
        name, equals, value = parameter.partition("=")
        if equals and _is_secret(name):
            found.append(value.partition("#")[0])
    decoded = [urllib.parse.unquote_plus(secret) for secret in found]
    return sorted({secret for secret in found + decoded if secret}, key=len, reverse=True)


def hidden_in(text: str, url: str) -> str:
    """`text` (another library's error, say) with every URL in it as `shown_url`
    shows it, and the credentials of `url` hidden wherever else they appear."""
    text = URL_IN_TEXT.sub(lambda found: shown_url(found.group()), text)
    for secret in _secrets_of(url):
        text = text.replace(secret, HIDDEN)
    return text


# ---------------------------------------------------------------------------
# What an answer must say of itself
# ---------------------------------------------------------------------------

WHOLE_READ_ADVICE = ("read the whole file (load_file and get_tensors read an object of up "
                     "to fastst.remote.MAX_WHOLE_READ bytes whole from such a server), "
                     "download it first, or serve it from a server that supports range "
                     "requests")
CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$", re.IGNORECASE)


def checked_answer(version: ObjectVersion, offset: int, length: int, status: Any,
                   content_range: Optional[str], content_length: Optional[int],
                   etag: Optional[str], modified: Any) -> Tuple[int, bool]:
    """How many bytes of the body of an answer to a request for [offset, offset +
    length) to read, and whether the body goes on past them (to be left unread),
    once what the answer says of itself is checked against the request and the
    object opened: status 206 and a Content-Range that starts at `offset`, ends
    within the range and gives the object's size; its version (`check_version`). A
    200 (the range ignored: the whole object) is taken when the whole object was
    asked for, or, when it says it holds the whole object, for a range at its start:
    its first bytes."""
    asked = f"bytes [{offset}, {offset + length})"
    check_version(version, etag, modified, asked)
    if status == 200 and offset == 0 and length == version.size:
        body = length
    elif status == 200 and offset == 0 and content_length == version.size:
        return length, True
    elif status == 200:
        raise SafetensorError(f"{version.label}: the server ignored the range request for "
                              f"{asked} (status 200 with the whole object, not 206 with "
                              f"the range): {WHOLE_READ_ADVICE}")
    elif status != 206:
        raise SafetensorError(f"{version.label}: {asked}: the server answered with status "
                              f"{status}, not 206 Partial Content")
    else:
        body = range_answered(version, offset, length, content_range, asked)
    if content_length is not None and content_length > body:
        raise SafetensorError(f"{version.label}: the answer for {asked} is {content_length} "
                              f"bytes long, more than the {body} it should hold (too long)")
    return body, False


def range_answered(version: ObjectVersion, offset: int, length: int,
                   content_range: Optional[str], asked: str) -> int:
    """The length of the range a 206 answer's Content-Range says it holds, checked
    to start at `offset`, end within the range asked and give the object's size."""
    match = CONTENT_RANGE.match(content_range or "")
    if match is None:
        raise SafetensorError(f"{version.label}: the answer for {asked} does not say which "
                              f"bytes it holds (Content-Range {content_range!r})")
    first, last, total = match.groups()
    if total != "*" and int(total) != version.size:
        raise changed(version, f"its size is now {total} bytes, was {version.size}", asked)
    held = f"bytes [{first}, {int(last) + 1}) (Content-Range {content_range!r})"
    if int(first) != offset or int(last) < int(first):
        raise SafetensorError(f"{version.label}: the server answered {held} to the request "
                              f"for {asked}")
    if int(last) >= offset + length:
        raise SafetensorError(f"{version.label}: the server answered {held} to the request "
                              f"for {asked}: more than asked (too long)")
    return int(last) + 1 - offset


def check_version(version: ObjectVersion, etag: Optional[str], modified: Any,
                  asked: str) -> None:
    """Refuse an answer (while reading `asked`) that is not from the version opened,
    or cannot be shown to be: its ETag must be the one seen at opening; without one
    (or where none was seen), its Last-Modified date must be the one seen. An answer
    that gives neither where the object had one is refused (RFC 9110 has a 206 carry
    the ETag and Last-Modified a 200 would), for a server that ignores If-Match and
    leaves them out would otherwise mix two versions. An object that had neither at
    opening has nothing to compare."""
    if etag and version.etag:
        if etag != version.etag:
            raise changed(version, f"its ETag is now {etag}, was {version.etag}", asked)
        return
    if modified is not None and version.modified is not None:
        if modified != version.modified:
            raise changed(version, f"its Last-Modified is now {modified}, was "
                                   f"{version.modified}", asked)
        return
    lacking = ([f"no ETag (the object's was {version.etag} when opened)"] if version.etag
               else [])
    if version.modified is not None:
        lacking.append(f"no Last-Modified date (the object's was {version.modified})")
    if lacking:
        raise SafetensorError(f"{version.label}: the answer while reading {asked} cannot be "
                              f"shown to be from the object opened: it gives "
                              f"{' and '.join(lacking)}; refused rather than risk mixing two "
                              f"versions of the object")


def precondition(etag: Optional[str], modified: Optional[str]) -> Dict[str, str]:
    """The HTTP headers that hold each read to the version opened: If-Match on a
    strong ETag (a weak one never matches: RFC 9110), else If-Unmodified-Since its
    Last-Modified date."""
    if etag and not etag.startswith("W/"):
        return {"If-Match": etag}
    if modified:
        return {"If-Unmodified-Since": modified}
    return {}


def changed(version: ObjectVersion, what: str, asked: str) -> SafetensorError:
    return SafetensorError(f"{version.label}: the object changed since it was opened ({what}) "
                           f"while reading {asked}; open it again to read the new object")


def too_long(label: str, offset: int, length: int, body: int) -> SafetensorError:
    """The error for an answer's body that goes on past the `body` bytes it holds."""
    return SafetensorError(f"{label}: the answer for bytes [{offset}, {offset + length}) "
                           f"goes on past the {body} bytes it should hold (too long); the "
                           f"rest was not read")


def translated(error: BaseException, url: str, doing: str) -> BaseException:
    """The error to raise (as it is, not ``from`` anything) for a store's `error`
    while `doing` something with `url`: FileNotFoundError, PermissionError and an
    error that names the URL already as they are; a failed precondition (the object
    changed) or a body cut short as a SafetensorError; a timeout as TimeoutError;
    anything else as an OSError naming the URL. Its cause is `error`, unless `error`
    or one of its causes shows a credential (of `url`, or of a URL it names, such as
    a signed location): then its text is given with them hidden, and no cause."""
    label = shown_url(url)
    told = "".join(traceback.format_exception(error))
    shows_credentials = hidden_in(told, url) != told
    new = _translated(error, label, doing, hidden_in(str(error), url))
    if new is error:
        if not shows_credentials:
            return error
        new = _without_credentials(error, url)
    new.__cause__ = None if shows_credentials else error
    return new


def _translated(error: BaseException, label: str, doing: str, told: str) -> BaseException:
    if isinstance(error, (FileNotFoundError, PermissionError, SafetensorError)) or \
            str(error).startswith(f"{label}: "):
        return error
    if _precondition_failed(error):
        return precondition_failed(label, doing)
    if type(error).__name__ in ("ClientPayloadError", "ContentLengthError",
                                "IncompleteReadError", "ResponseStreamingError",
                                "IncompleteRead"):
        return SafetensorError(f"{label}: the store's answer was cut short while {doing} "
                               f"({told})")
    if isinstance(error, TimeoutError) or "Timeout" in type(error).__name__:
        return TimeoutError(f"{label}: no answer in time while {doing} "
                            f"({type(error).__name__}; storage_options set the timeouts)")
    return OSError(f"{label}: {doing} failed: {type(error).__name__}: {told}")


def _without_credentials(error: BaseException, url: str) -> BaseException:
    """An error of `error`'s kind that says what it says, the credentials of `url`
    (and of any URL it names) hidden."""
    if isinstance(error, OSError) and error.errno is not None:
        named = () if error.filename is None else (hidden_in(str(error.filename), url),)
        return type(error)(error.errno, hidden_in(str(error.strerror), url), *named)
    try:
        return type(error)(hidden_in(str(error), url))
    except TypeError:     # a kind made otherwise
        return OSError(hidden_in(str(error), url))


def precondition_failed(label: str, doing: str) -> SafetensorError:
    """The error for a store that refused a read's precondition (status 412)."""
    return SafetensorError(f"{label}: the object changed since it was opened (its ETag "
                           f"or modification time no longer matches) while {doing}; "
                           f"open it again to read the new object")


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
# The fetch the compiled Reader calls
# ---------------------------------------------------------------------------


class RangedFetch(Protocol):
    """What the compiled Reader reads an object by (``Reader.open_ranges``, which
    finds ``fetch_into`` and ``ranges_ignored`` by name) and ``fastst._io.source.Url``
    opens it with: called with a list of ``(offset, length)``, the bytes of each,
    exactly as long (fewer where an answer was cut short: the Reader refuses them);
    ``fetch_into`` puts them into buffers given instead. `url` is the object's
    address, `label` that address as messages show it (``shown_url``), `size` its
    length and `version` what it was when opened (`identity`, the same as a tuple,
    is what the Reader's ``file_identity`` gives); `limits` bound its reads and
    `pace` keeps their requests in flight; `ranges_ignored` tells a server that
    answers range requests with the whole object. The transports implement it on
    ``RangedObject``."""

    url: str
    label: str
    size: int
    version: ObjectVersion
    identity: Tuple[Any, ...]
    limits: Limits
    pace: Pace
    ranges_ignored: bool

    def __call__(self, ranges: Sequence[Range]) -> List[Any]:
        ...

    def fetch_into(self, ranges: Sequence[Range], buffers: Sequence[memoryview]) -> List[int]:
        """Put the bytes of each range into its buffer (a writable memoryview exactly
        as long, not kept past the call); returns the bytes each got, fewer than asked
        where an answer was cut short. The compiled Reader fetches tensors this way,
        straight into their arrays."""
        ...


class RangedObject(RangedFetch):
    """A `RangedFetch` whose transport fetches spans by parts (``_fetch``): ranges
    of one call that follow on, or nearly, share requests.

    From a server that ignores range requests, the first read that needs more than
    the object's first bytes reads it whole, once, and every read after it is
    served from that copy, kept as long as the object (``_whole_for``)."""

    fetched = 0      # bytes asked by earlier calls: where a download bar goes on
    whole: Optional[memoryview] = None   # the object read whole, where ranges are ignored

    def __init__(self) -> None:
        self.whole_read = threading.Lock()

    def __call__(self, ranges: Sequence[Range]) -> List[Any]:
        whole = self._whole_for(ranges)
        if whole is not None:
            return [whole[offset:offset + length] for offset, length in ranges]
        spans = spans_of(ranges)
        # not zeroed: each page is touched once, by the bytes that fill it
        buffers = [memoryview(np.empty(span.end - span.offset, np.uint8)) for span in spans]
        got = self._with_bar(ranges, spans, [Scatter([buffer]) for buffer in buffers])
        if got is not None:
            return got
        return [span.view_of(buffer, offset, length)
                for span, buffer in zip(spans, buffers) for offset, length in span.ranges]

    def fetch_into(self, ranges: Sequence[Range], buffers: Sequence[memoryview]) -> List[int]:
        """Fetched in parts as a call is, neighbouring ranges in shared requests whose
        bodies are read into each buffer in turn."""
        for (offset, length), buffer in zip(ranges, buffers, strict=True):
            if buffer.readonly or buffer.nbytes != length:
                raise ValueError(f"{self.label}: bytes [{offset}, {offset + length}) need a "
                                 f"writable buffer of {length} bytes")
        views = [buffer.cast("B") for buffer in buffers]
        whole = self._whole_for(ranges)
        if whole is not None:
            got: Optional[List[Any]] = [whole[offset:offset + length]
                                        for offset, length in ranges]
        else:
            spans, targets, span_of = joined(ranges, views)
            got = self._with_bar(ranges, spans, targets)
        if got is not None:     # the whole object's, or a transport's own bytes: copied
            counts = [memoryview(item).nbytes for item in got]
            for view, item, count in zip(views, got, counts):
                if count <= view.nbytes:    # else the Reader refuses it as too long
                    view[:count] = item
            return counts
        return [spans[k].got(offset, length) for (offset, length), k in zip(ranges, span_of)]

    def _fetch(self, ranges: Sequence[Range], spans: List[Span], targets: List[Scatter],
               on_bytes: Optional[Callable[[int], None]]) -> Optional[List[Any]]:
        """Fetch `spans` into `targets` (a span's holes say what an answer cut short
        left out), calling `on_bytes(n)` as n bytes come in; or return the bytes of
        each range instead, where the transport gives bytes of its own."""
        raise NotImplementedError

    def _whole_for(self, ranges: Sequence[Range]) -> Optional[memoryview]:
        """The whole object, from which to serve `ranges`: read once where the server
        ignores range requests and `ranges` are more than its first bytes (which the
        start of its answer gives), and kept; None while there is no such copy."""
        if self.whole is not None or not self.ranges_ignored or all(
                offset == 0 and length < self.size for offset, length in ranges):
            return self.whole
        with self.whole_read:     # one read of it, however many threads ask at once
            if self.whole is None:
                self.check_readable_whole()
                buffer = memoryview(np.empty(self.size, np.uint8))
                (span,) = spans_of([(0, self.size)])
                got = self._with_bar([(0, self.size)], [span], [Scatter([buffer])])
                whole = (memoryview(got[0]).cast("B") if got is not None else
                         span.view_of(buffer, 0, self.size))
                if whole.nbytes != self.size:
                    return whole      # cut short: not kept (the Reader reports it)
                self.whole = whole
        return self.whole

    def _with_bar(self, ranges: Sequence[Range], spans: List[Span],
                  targets: List[Scatter]) -> Optional[List[Any]]:
        """``_fetch`` with a download bar."""
        asked = sum(length for _, length in ranges)
        bar = self._download_bar(asked)
        try:
            return self._fetch(ranges, spans, targets, None if bar is None else bar.update)
        finally:
            self.fetched += asked
            if bar is not None:
                bar.close()

    def _download_bar(self, asked: int) -> Optional[ByteBar]:
        """A bar over the object's bytes on a terminal, for a large object and a call
        that asks for a good part of what makes a bar worth drawing; it goes on from
        the bytes earlier calls fetched (a whole-file load is one bar from 0 to 100%),
        and is erased when the call ends."""
        if asked < PROGRESS_MIN_BYTES // 8:
            return None
        return byte_bar(self.size, "download", done=self.fetched)

    def check_readable_whole(self) -> None:
        """Refuse, before asking, to read whole an object over
        ``fastst.remote.MAX_WHOLE_READ`` bytes, from a server that ignores range
        requests.

        Raises
        ------
        SafetensorError
            Saying that the server ignores range requests, and what to do.
        """
        most = self.limits.max_whole_read
        if self.size > most:
            raise SafetensorError(
                f"{self.label}: the server ignores range requests (it answers them with the "
                f"whole object), and the object's {self.size} bytes are more than the "
                f"{most} read whole from such a server (fastst.remote.MAX_WHOLE_READ): "
                f"download it first, or serve it from a server that supports range "
                f"requests")


def read_limits(url: str, storage_options: Mapping[str, Any]) -> Limits:
    """The bounds a read of `url` works within: the constants of ``limits``, but for the
    most requests in flight and the largest part where `storage_options` give them
    (``max_concurrency``, ``part_size``)."""
    bounds = []
    for key, default in (("max_concurrency", knobs.MAX_REQUESTS), ("part_size", knobs.PART_SIZE)):
        value = storage_options.get(key, default)
        if type(value) is not int or value < 1:
            raise SafetensorError(f"{shown_url(url)}: storage_options[{key!r}] must be an "
                                  f"integer >= 1, "
                                  f"got {value!r}")
        bounds.append(value)
    return Limits(knobs.CONNECT_TIMEOUT, knobs.READ_TIMEOUT, knobs.START_REQUESTS, bounds[0],
                  bounds[1], knobs.MAX_WHOLE_READ)


