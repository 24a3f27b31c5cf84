"""Stores on the loopback interface for tests: an HTTP server that honours Range and
If-Match and counts what it sends, with hostile modes; Python's own ``python -m
http.server``, which ignores Range; and S3 (moto in server mode).

Use them as pytest fixtures (``from servers import http_store, s3_store,
simple_http_server``) or as context managers (``with RangeServer() as server``,
``with python_http_server(folder) as url``, ``with counted_http_server(folder) as
(url, requests)``, ``with moto_s3() as options``).
"""
import contextlib
import email.utils
import functools
import hashlib
import http.server
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class RangeServer:
    """A threaded HTTP server on 127.0.0.1 (or `host`, ``"::1"`` say) serving `objects`
    (path -> bytes).

    It answers HEAD and GET, honours ``Range: bytes=a-b`` (206 and Content-Range)
    and ``If-Match`` (412 when the ETag differs), and counts requests, body bytes
    sent and the most requests served at once. Hostile modes, set on ``mode``:
    ``"short"`` sends a body shorter than its Content-Length and closes;
    ``"short-length"`` answers ranges with fewer bytes than asked, honestly
    declared; ``"stall"`` answers GETs only when the test ends; ``"change"``
    replaces each object's content after the first GET (a new ETag);
    ``"ignore-range"`` answers every GET with the whole object (200);
    ``"endless"`` ignores Range and streams a chunked body (200) with no end;
    ``"overlong"`` answers a range with its Content-Range, then a chunked body that
    goes on past it with no end; ``"new-version"`` ignores If-Match and
    If-Unmodified-Since and answers from a new version of the object (the same
    header, every byte after it inverted) with that version's ETag and date;
    ``"range-total"`` sends the right bytes with a Content-Range whose total is one
    byte more than the object; ``"range-start"`` sends the bytes one further on
    than asked, and a Content-Range that says so. An endless body stops when the
    client hangs up, at ``endless_limit`` bytes, or when the test ends. The first
    ``honest_gets`` GETs are answered honestly whatever the mode.
    ``delay`` seconds are waited before each GET's answer (a store's time to first
    byte), and ``rate``, when set, caps what each answer sends to that many bytes a
    second (a store's speed per connection). Each object has a
    Last-Modified date (a content first seen is a second later than the one before
    it), and ``If-Unmodified-Since`` is honoured; ``etags = False`` leaves ETags out,
    ``dates = False`` Last-Modified dates, ``sizes = False`` the Content-Length of
    HEAD answers, and ``gets_leave_out`` names those of "ETag" and "Last-Modified"
    that GET answers leave out; ``accept_ranges`` is what answers say in their
    Accept-Ranges header. Bodies are sent in pieces of 1 MiB,
    each counted as it is sent: a client that hangs up while it is answered is no
    error of the server's, and what it was not sent is not counted.

    What a client must cope with on the web: ``redirects`` maps a path to the
    location (a path or a URL) that HEAD and GET requests for it are sent on to
    (302); ``refused`` holds paths answered 403 (a signed location that expired),
    and ``failures`` maps a path to the status HEAD and GET requests for it get;
    ``head_status``, when set, answers every HEAD with it (a URL signed for GET
    only); ``weak_etags`` gives ETags as ``W/"..."``; ``encoding`` is sent as the
    Content-Encoding of GET answers (whose bodies stay as they are); mode
    ``"trickle"`` sends a body a byte every ``trickle_pause`` seconds;
    ``drop_kept = True`` closes each connection once it has answered, while
    saying it is kept. ``connections`` counts the connections accepted,
    ``authorizations`` holds the Authorization header of each request (None
    without one), ``hosts`` its Host header, and ``ports`` the client's port of
    each, which tells its connection.

    What a client must bound: ``informational`` holds the statuses of informational
    answers (1xx) sent before each answer to a HEAD or a GET (``103 Early Hints``...);
    ``trickle_heads`` the methods (``"HEAD"``, ``"GET"``) whose answers' heads are
    trickled, a byte of a header every ``trickle_pause`` seconds, ``TRICKLED_HEAD``
    bytes at most, after which the connection is closed; ``redirect_body`` is the
    body of each redirect, trickled in mode ``"trickle"``."""

    def __init__(self, objects=None, host="127.0.0.1"):
        self.objects = dict(objects or {})
        self.be_honest()
        self.endless_limit = 2 << 30
        self.versions = {}            # path -> (ETag of the content, its modification time)
        self.requests = []            # (method, path, Range header or None)
        self.bytes_sent = 0
        self.connections = 0
        self.authorizations = []
        self.hosts = []
        self.ports = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.lock = threading.Lock()
        self.released = threading.Event()   # ends stalls
        serving = QuietServer6 if ":" in host else QuietServer
        self.server = serving((host, 0), self.handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self):
        host, port = self.server.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def modified(self, path, data):
        """When the content `data` of `path` was last modified (whole seconds, as
        HTTP dates are): a content not seen before is newer than the last one."""
        tag = etag_of(data)
        with self.lock:
            seen = self.versions.get(path)
            if seen is None or seen[0] != tag:
                seen = self.versions[path] = (tag, max(int(time.time()),
                                                       seen[1] + 1 if seen else 0))
        return seen[1]

    def be_honest(self):
        """No hostile mode, no delay, ETags and sizes given."""
        self.mode = None
        self.honest_gets = 0
        self.delay = 0.0
        self.rate = None
        self.etags = True
        self.dates = True
        self.gets_leave_out = ()
        self.sizes = True
        self.accept_ranges = "bytes"
        self.redirects = {}
        self.refused = set()
        self.failures = {}
        self.head_status = None
        self.weak_etags = False
        self.encoding = None
        self.trickle_pause = 0.05
        self.drop_kept = False
        self.informational = ()
        self.trickle_heads = ()
        self.redirect_body = b""

    def reset_counts(self):
        with self.lock:
            self.requests.clear()
            self.authorizations.clear()
            self.hosts.clear()
            self.ports.clear()
            self.bytes_sent = 0
            self.connections = 0
            self.most_in_flight = 0

    def gets(self):
        return [request for request in self.requests if request[0] == "GET"]

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc_info):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def handler(self):
        store = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True   # headers and body leave without waiting for ACKs

            def log_message(self, *args):
                pass

            def setup(self):
                super().setup()
                with store.lock:
                    store.connections += 1

            def do_HEAD(self):
                store.record(self, "HEAD", None)
                self.mode = None
                if not self.began_answer("200 OK") or self.sent_elsewhere(head=True):
                    return
                data = store.objects.get(self.path)
                if data is None:
                    return self.answer(404, b"", head=True)
                if store.head_status is not None:
                    return self.answer(store.head_status, b"", head=True)
                self.answer(200, data, head=True, etag=etag_of(data),
                            modified=store.modified(self.path, data))

            def do_GET(self):
                asked = self.headers.get("Range")
                with store.counting() as self.request_ends:
                    store.record(self, "GET", asked)
                    self.mode = store.hostile_mode()
                    if self.began_answer("206 Partial Content") and not self.sent_elsewhere():
                        self.get(asked)
                if store.drop_kept:
                    self.close_connection = True     # without a word to the client

            def began_answer(self, status):
                """Send the informational answers, then, for a method whose heads
                are trickled, the head of an answer of `status` trickled until the
                connection is closed: False when it was."""
                try:
                    for start in range(0, len(store.informational), 1000):
                        self.wfile.write(b"".join(
                            f"HTTP/1.1 {code} Informational\r\nLink: </a>\r\n\r\n".encode()
                            for code in store.informational[start:start + 1000]))
                    if self.command not in store.trickle_heads:
                        return True
                    self.wfile.write(f"HTTP/1.1 {status}\r\nX-Slow: ".encode())
                    self.trickle(memoryview(b"z" * TRICKLED_HEAD))
                except OSError:    # the client hung up
                    pass
                self.close_connection = True
                return False

            def sent_elsewhere(self, head=False):
                """Answer a redirected or refused path: True when it was."""
                if self.path in store.refused:
                    self.answer(403, b"expired", head=head)
                    return True
                if self.path in store.failures:
                    self.answer(store.failures[self.path], b"failed", head=head)
                    return True
                location = store.redirects.get(self.path)
                if location is None:
                    return False
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", str(len(store.redirect_body)))
                self.end_headers()
                if not head:
                    self.send_body(memoryview(store.redirect_body))
                return True

            def get(self, asked):
                if store.delay:
                    time.sleep(store.delay)
                data = store.objects.get(self.path)
                if data is None:
                    return self.answer(404, b"")
                if self.mode == "stall":
                    store.released.wait(30)
                    return
                etag, modified = etag_of(data), store.modified(self.path, data)
                if self.mode == "change":
                    store.objects[self.path] = bytes(255 - b for b in data[:64]) + data[64:]
                if self.mode == "new-version":
                    data, modified = new_version(data), modified + 1
                    etag = etag_of(data)
                elif not self.preconditions_hold(etag, modified):
                    return self.answer(412, b"")
                if self.mode == "endless":
                    return self.endless(200, etag=etag, modified=modified)
                match = RANGE.match(asked or "")
                if match is None or self.mode == "ignore-range":
                    return self.answer(200, data, etag=etag, modified=modified)
                first = int(match.group(1))
                last = int(match.group(2)) if match.group(2) else len(data) - 1
                last = min(last, len(data) - 1)
                if first >= len(data):
                    return self.answer(416, b"")
                total = len(data) + (self.mode == "range-total")
                if self.mode == "range-start":
                    first, last = first + 1, min(last + 1, len(data) - 1)
                content_range = f"bytes {first}-{last}/{total}"
                if self.mode == "overlong":
                    return self.endless(206, etag=etag, modified=modified,
                                        content_range=content_range)
                body = memoryview(data)[first:last + 1]
                if self.mode == "short-length":
                    body = body[:len(body) // 2]
                    content_range = f"bytes {first}-{first + len(body) - 1}/{total}"
                self.answer(206, body, etag=etag, modified=modified,
                            content_range=content_range)

            def preconditions_hold(self, etag, modified):
                wanted = self.headers.get("If-Match")
                if wanted is not None and wanted != etag:
                    return False
                since = self.headers.get("If-Unmodified-Since")
                return since is None or modified <= email.utils.parsedate_to_datetime(
                    since).timestamp()

            def endless(self, status, **headers):
                """A chunked body with no end: pieces until the client hangs up."""
                self.send_response(status)
                self.send_header("Transfer-Encoding", "chunked")
                self.headers_of(**headers)
                self.end_headers()
                self.close_connection = True    # no last chunk: the connection just ends
                piece = b"\x5a" * (64 << 10)
                chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
                sent = 0
                while sent < store.endless_limit and not store.released.is_set():
                    with store.lock:
                        store.bytes_sent += len(piece)
                    try:
                        self.wfile.write(chunk)
                    except OSError:    # the client hung up
                        return
                    sent += len(piece)

            def answer(self, status, body, *, head=False, **headers):
                self.send_response(status)
                if store.sizes or not head:
                    self.send_header("Content-Length", str(len(body)))
                self.headers_of(**headers)
                self.end_headers()
                if head:
                    return
                if self.mode == "short" and len(body) > 1:
                    body = body[:len(body) // 2]
                    self.close_connection = True
                self.send_body(memoryview(body))

            def send_body(self, body):
                """`body` a byte at a time in mode "trickle", else in pieces, paced
                where `rate` is set."""
                if self.mode == "trickle":
                    return self.trickle(body)
                rate = store.rate
                step = SEND_PIECE if rate is None else THROTTLED_PIECE
                started = time.monotonic()
                for start in range(0, len(body), step):
                    piece = body[start:start + step]
                    if rate is not None:    # paced: piece k leaves no sooner than k/rate
                        time.sleep(max(0.0, started + start / rate - time.monotonic()))
                    with store.lock:   # counted first: the client may go on before write returns
                        store.bytes_sent += len(piece)
                    if start + step >= len(body):
                        self.request_ends()   # ... to its next request, before this thread ends
                    try:
                        self.wfile.write(piece)
                    except OSError:    # the client hung up
                        self.close_connection = True
                        return

            def trickle(self, body):
                """The body a byte at a time, until the client hangs up or the test
                ends."""
                for start in range(len(body)):
                    if store.released.wait(store.trickle_pause):
                        return
                    try:
                        self.wfile.write(body[start:start + 1])
                    except OSError:
                        self.close_connection = True
                        return
                    with store.lock:
                        store.bytes_sent += 1

            def tells(self, header):
                return self.command != "GET" or header not in store.gets_leave_out

            def headers_of(self, *, etag=None, modified=None, content_range=None):
                self.send_header("Accept-Ranges", store.accept_ranges)
                if store.encoding and self.command == "GET":
                    self.send_header("Content-Encoding", store.encoding)
                if etag and store.etags and self.tells("ETag"):
                    self.send_header("ETag", "W/" + etag if store.weak_etags else etag)
                if modified is not None and store.dates and self.tells("Last-Modified"):
                    self.send_header("Last-Modified", email.utils.formatdate(modified,
                                                                             usegmt=True))
                if content_range:
                    self.send_header("Content-Range", content_range)

        return Handler

    def hostile_mode(self):
        """The mode this GET is answered in: none for the first `honest_gets`."""
        with self.lock:
            if self.honest_gets > 0:
                self.honest_gets -= 1
                return None
            return self.mode

    def record(self, handler, method, asked):
        with self.lock:
            self.requests.append((method, handler.path, asked))
            self.hosts.append(handler.headers.get("Host"))
            self.ports.append(handler.client_address[1])
            self.authorizations.append(handler.headers.get("Authorization"))

    @contextlib.contextmanager
    def counting(self):
        """A GET in flight, from its start until its last byte is about to be sent (the
        `end` it yields, called then) or its handler ends, whichever comes first."""
        ended = False

        def end():
            nonlocal ended
            with self.lock:
                if not ended:
                    ended = True
                    self.in_flight -= 1

        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield end
        finally:
            end()


@contextlib.contextmanager
def range_server_process(objects, rate=None, delay=0.0, timeout=60):
    """A RangeServer serving `objects` (with `rate` and `delay` set) in a process of its
    own, so that its threads do not share the client's interpreter, as a real store's
    do not; yields (URL, counts), where counts() returns the server's
    ``{"most_in_flight": ..., "gets": [(offset, end), ...]}`` so far."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve_in_process, args=(objects, rate, delay, theirs),
                              daemon=True)
    process.start()
    try:
        if not ours.poll(timeout):
            raise TimeoutError(f"the server process said nothing in {timeout} s")
        url = ours.recv()

        def counts():
            ours.send("counts")
            return ours.recv()
        yield url, counts
    finally:
        ours.send("stop")
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        ours.close()


def _serve_in_process(objects, rate, delay, pipe):
    with RangeServer(objects) as server:
        server.rate, server.delay = rate, delay
        pipe.send(server.url)
        while pipe.recv() != "stop":
            with server.lock:
                gets = [asked for method, _, asked in server.requests if method == "GET"]
                pipe.send({"most_in_flight": server.most_in_flight, "gets": gets})


SEND_PIECE = 1 << 20
THROTTLED_PIECE = 64 << 10   # a paced answer's pieces: small, so that its rate is smooth
TRICKLED_HEAD = 200          # bytes of a trickled head: 10 s at the usual pause


class QuietServer(http.server.ThreadingHTTPServer):
    """A threaded HTTP server that takes a client hanging up in silence, and a burst of
    connections at once (socketserver's backlog of 5 drops the rest, which then wait a
    second to try again)."""
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class QuietServer6(QuietServer):
    """A QuietServer on an IPv6 address."""
    address_family = socket.AF_INET6


@functools.lru_cache(maxsize=64)
def new_version(data):
    """`data` as a new version of a safetensors file: the same header, every byte
    after it inverted (the whole of it inverted when it has no header)."""
    start = 8 + int.from_bytes(data[:8], "little") if len(data) >= 8 else 0
    start = start if start <= len(data) else 0
    return data[:start] + bytes(255 - b for b in data[start:])


@functools.lru_cache(maxsize=64)   # bytes cache their hash: a hit costs no pass over them
def etag_of(data):
    return '"' + hashlib.md5(data).hexdigest() + '"'


@contextlib.contextmanager
def moto_s3(bucket="fastst"):
    """S3 on 127.0.0.1 (moto in server mode, on a port the system picks) with `bucket` made;
    yields the storage_options that reach it through s3fs."""
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0,
                                              verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        options = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
                   "client_kwargs": {"endpoint_url": f"http://{host}:{port}",
                                     "region_name": "eu-west-1"},
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 20,
                                     "retries": {"max_attempts": 2}}}
        import s3fs

        # moto keeps its buckets in this process, from one server to the next: start empty
        urllib.request.urlopen(urllib.request.Request(
            f"http://{host}:{port}/moto-api/reset", method="POST"), timeout=30).close()
        s3fs.S3FileSystem(**options).mkdir(bucket)
        yield options
    finally:
        server.stop()


@contextlib.contextmanager
def python_http_server(folder, timeout=30):
    """``python -m http.server`` serving `folder` on 127.0.0.1, on a port the system
    picks (read from what the server prints); yields its URL. It serves whole files
    only: a request for a range is answered with status 200 and the whole file, with
    no Accept-Ranges header, and a folder with an HTML listing."""
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind",
                               "127.0.0.1", "--directory", str(folder)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        with selectors.DefaultSelector() as waiting:
            waiting.register(server.stdout, selectors.EVENT_READ)
            if not waiting.select(timeout):
                raise TimeoutError(f"python -m http.server said nothing in {timeout} s")
        # "Serving HTTP on 127.0.0.1 port 40123 (http://127.0.0.1:40123/) ..."
        said = server.stdout.readline()
        match = re.search(r"\(http://127\.0\.0\.1:(\d+)/\)", said)
        assert match is not None, said
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        server.stdout.close()


@contextlib.contextmanager
def counted_http_server(folder):
    """The standard library's ``SimpleHTTPRequestHandler`` (what ``python -m
    http.server`` serves with, ignoring Range) serving `folder` from a threaded
    server on 127.0.0.1, in this process; yields (URL, requests), the (method, path,
    Range header) of each request taken."""
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(folder), **kwargs)

        def parse_request(self):
            parsed = super().parse_request()
            if parsed:
                requests.append((self.command, self.path, self.headers.get("Range")))
            return parsed

        def log_message(self, *args):
            pass

    server = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def simple_http_server(tmp_path_factory):
    """(URL, folder): ``python -m http.server`` serving a fresh folder (see
    ``python_http_server``); files put in the folder are served at once."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    folder = tmp_path_factory.mktemp("served")
    with python_http_server(folder) as url:
        yield url, folder


@pytest.fixture(scope="module")
def http_store():
    pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    with RangeServer() as server:
        yield server


@pytest.fixture(scope="module")
def s3_store():
    with moto_s3() as options:
        yield options


def putter(server):
    """put(name, data) -> URL: an object on `server`."""
    def put(name, data):
        server.objects["/" + name] = bytes(data)
        return f"{server.url}/{name}"

    return put


@pytest.fixture
def served(http_store):
    """Put objects on the HTTP server; yields (server, put(name, data) -> URL)."""
    http_store.be_honest()
    http_store.objects.clear()
    http_store.reset_counts()
    yield http_store, putter(http_store)
    http_store.be_honest()
