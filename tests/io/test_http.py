"""fastst's own HTTP client (fastst._io.http): which URLs it reads, connections kept from
one request to the next, redirects and where credentials go, signed locations that
expire, servers that refuse HEAD or give weak ETags, bounded waits, threads, forks.
What every transport must do with hostile answers is tested in test_remote.py."""
import concurrent.futures
import io
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import fastst
from fastst import SafetensorError

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
import fastst.remote  # noqa: E402
from fastst._io.http import CallReader, HttpRanges  # noqa: E402
from servers import RangeServer, http_store, putter, served  # noqa: E402,F401

MiB = 1 << 20
# 1.3 MiB: past the first request, which brings the header and the first 64 KiB
TENSORS = {f"t{k}": np.arange(k * 40_000, (k + 1) * 40_000, dtype=np.float32) for k in range(8)}
DATA = fastst.save(TENSORS)


def timeout():
    aiohttp = pytest.importorskip("aiohttp")
    return aiohttp.ClientTimeout(sock_connect=5, sock_read=30)


TIMEOUT = timeout()


def assert_tensors(got):
    assert sorted(got) == sorted(TENSORS)
    for name, array in TENSORS.items():
        assert got[name].dtype == array.dtype and (got[name] == array).all(), name


def requests_of(server):
    """(method, path) of each request the server took."""
    return [(method, path) for method, path, _ in server.requests]


def http_threads():
    return [thread for thread in threading.enumerate() if thread.name == "fastst-http"]


# ---------------------------------------------------------------------------
# Which transport
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("options, transport", [
    (None, "HttpRanges"),
    ({"headers": {"X-Token": "t"}, "client_kwargs": {"timeout": TIMEOUT}}, "HttpRanges"),
    ({"skip_instance_cache": True, "max_concurrency": 4}, "HttpRanges"),
    ({"transport": "fsspec"}, "UrlRanges"),
    ({"client_kwargs": {"trust_env": True}}, "UrlRanges"),   # only aiohttp takes it
    ({"client_kwargs": {"raise_for_status": False}}, "UrlRanges"),
])
def test_http_urls_are_read_by_the_http_client_unless_options_need_fsspec(
        served, options, transport):
    server, put = served
    url = put("choice.safetensors", DATA)
    assert type(fastst.remote.open_object(url, options)).__name__ == transport
    assert_tensors(fastst.load_file(url, storage_options=options))


NO_FSSPEC = """
import sys
sys.modules.update(fsspec=None, aiohttp=None)     # import fsspec: ImportError
import fastst
tensors = fastst.load_file(sys.argv[1])
print(sorted(tensors), "fsspec" in sys.modules and sys.modules["fsspec"] is not None)
"""


def test_reading_an_http_url_needs_nothing_but_the_standard_library(served):
    server, put = served
    url = put("plain.safetensors", DATA)
    done = subprocess.run([sys.executable, "-c", NO_FSSPEC, url], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split("] ")[-1].strip() == "False", done.stderr[-2000:]
    assert done.stdout.startswith(str(sorted(TENSORS))[:-1])


def test_a_transport_that_cannot_read_the_url_is_refused(served):
    server, put = served
    url = put("refused.safetensors", DATA)
    with pytest.raises(SafetensorError, match=r"storage_options\['transport'\] is 'http', but "
                                              r"storage_options\['client_kwargs'\] is taken "
                                              r"by fsspec's HTTP file system only"):
        fastst.load_file(url, storage_options={"transport": "http",
                                               "client_kwargs": {"trust_env": True}})
    with pytest.raises(SafetensorError, match=r"storage_options\['transport'\] must be one "
                                              r"of 'http', 'fsspec', got 'curl'"):
        fastst.load_file(url, storage_options={"transport": "curl"})
    with pytest.raises(SafetensorError, match="memory:// URLs are read through fsspec"):
        fastst.load_file("memory://x.safetensors", storage_options={"transport": "http"})


# ---------------------------------------------------------------------------
# Connections
# ---------------------------------------------------------------------------


def test_connections_are_kept_from_one_request_to_the_next(served):
    server, put = served
    url = put("kept.safetensors", DATA)
    server.reset_counts()
    with fastst.safe_open(url) as f:
        for name in TENSORS:      # the end of each: past the first request's bytes
            assert (f.get_slice(name)[-20:] == TENSORS[name][-20:]).all()
    assert len(server.gets()) == 1 + len(TENSORS)
    assert server.connections == 1


def test_a_kept_connection_the_server_closed_is_asked_again_on_a_new_one(served):
    server, put = served
    url = put("dropped.safetensors", DATA)
    server.drop_kept = True     # each connection closed after one answer, unannounced
    with fastst.safe_open(url) as f:
        server.reset_counts()
        for name in TENSORS:
            assert (f.get_slice(name)[-20:] == TENSORS[name][-20:]).all()
    assert len(server.gets()) == len(TENSORS) == server.connections


def test_parts_go_in_parallel_and_their_threads_end_with_the_call(served):
    server, put = served
    tensors = {f"big{k}": np.full(2 * MiB, k, np.float32) for k in range(6)}   # 48 MiB
    url = put("parallel.safetensors", fastst.save(tensors))
    server.delay = 0.05
    server.reset_counts()
    loaded = fastst.load_file(url, storage_options={"part_size": 2 * MiB})
    assert all((loaded[name] == array).all() for name, array in tensors.items())
    assert server.most_in_flight >= 2 and not http_threads()
    with fastst.safe_open(url, storage_options={"part_size": 2 * MiB}) as f:
        server.honest_gets, server.mode = 3, "short"
        with pytest.raises(SafetensorError, match="short read"):
            f.get_tensors()
    assert not http_threads()


def test_threads_reading_one_handle_at_once_each_get_their_bytes(served):
    server, put = served
    url = put("shared.safetensors", DATA)
    with fastst.safe_open(url) as f:
        def read(k):
            name = f"t{k % len(TENSORS)}"
            return name, k % 7, f.get_slice(name)[k % 7:k % 7 + 50]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for name, start, rows in pool.map(read, range(64)):
                assert (rows == TENSORS[name][start:start + 50]).all()


# run by the scripts of the tests that fork: fork(child) gives the child's exit code
FORKING = """
import multiprocessing, os, signal, sys, threading, time
import numpy as np
import fastst, fastst.remote

def tensor(k):
    return np.arange(k * 40_000, (k + 1) * 40_000, dtype=np.float32)

def fork(child, how="os.fork"):
    \"\"\"child() in a process forked by os.fork or multiprocessing: its exit code, or
    "hung" where it has not ended within 10 s.\"\"\"
    if how == "multiprocessing":
        process = multiprocessing.get_context("fork").Process(target=child)
        process.start()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
            return "hung"
        return process.exitcode
    pid = os.fork()
    if pid == 0:
        child()
    for _ in range(200):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"
"""

FORKED = FORKING + """
url, how = sys.argv[1:]
with fastst.safe_open(url) as f:
    def child():
        same = (f.get_tensor("t1") == tensor(1)).all()
        if how == "os.fork, os._exit":
            os._exit(0 if same else 1)
        sys.exit(0 if same else 1)     # the handle closed, atexit and finalizers run

    f.get_tensor("t0")                  # the parent keeps a connection open
    print("forking", flush=True)
    sys.stdin.readline()                # the test counts requests from here
    code = fork(child, how)
    print(code, (f.get_tensor("t2") == tensor(2)).all())
"""


@pytest.mark.parametrize("how", ["os.fork, os._exit", "os.fork, sys.exit", "multiprocessing"])
def test_a_process_forked_with_a_handle_open_reads_on_connections_of_its_own(served, how):
    server, put = served
    url = put("forked.safetensors", DATA)
    with subprocess.Popen([sys.executable, "-c", FORKED, url, how], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout.readline() == "forking\n"
        parents = set(server.ports)
        server.reset_counts()
        said, _ = process.communicate("go\n", timeout=60)
    assert said.split() == ["0", "True"]
    child, parent = server.ports      # a GET each: the child's of t1, then the parent's of t2
    assert child not in parents and parent in parents
    assert server.connections == 1    # the child's own; the parent's kept one still serves


FORKED_IN_FLIGHT = FORKING + """
with fastst.safe_open(sys.argv[1], storage_options={"part_size": 4 << 20}) as f:
    got = {}
    reading = threading.Thread(target=lambda: got.update(big=f.get_tensor("big")))
    reading.start()
    time.sleep(0.3)                     # its parts in flight, on connections of their own
    in_flight = reading.is_alive()
    code = fork(lambda: os._exit(0 if (f.get_tensor("t1") == tensor(1)).all() else 1))
    reading.join()
    print(in_flight, code, (got["big"] == 7).all(), (f.get_tensor("t2") == tensor(2)).all())
"""


def test_a_read_in_flight_when_its_process_forks_goes_on_and_the_child_reads_too(served):
    server, put = served
    url = put("in-flight.safetensors", fastst.save({**TENSORS, "big": np.full(4 * MiB, 7,
                                                                              np.float32)}))
    server.rate = 8 * MiB     # a second or so for the 16 MiB tensor
    done = subprocess.run([sys.executable, "-c", FORKED_IN_FLIGHT, url], capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.split() == ["True", "0", "True", "True"], done.stderr[-2000:]


FORKED_LOCKED = FORKING + """
url, which = sys.argv[1:]
ranges = fastst.remote.open_object(url, None)
expected = bytes(ranges([(100, 1000)])[0])      # a connection kept
lock = ranges.lock if which == "the object's" else ranges.connections.lock
held, release = threading.Event(), threading.Event()

def hold():     # as a read's threads do, briefly, to count bytes or start one another
    with lock:
        held.set()
        release.wait()

threading.Thread(target=hold).start()
held.wait()
code = fork(lambda: os._exit(0 if bytes(ranges([(100, 1000)])[0]) == expected else 1))
release.set()
print(code, bytes(ranges([(100, 1000)])[0]) == expected)
"""


@pytest.mark.parametrize("which", ["the object's", "its connections'"])
def test_a_process_forked_while_a_thread_holds_a_lock_of_the_object_reads_it(served, which):
    """No thread of the child releases a lock that a thread of the parent held when it
    forked: the child takes locks of its own."""
    server, put = served
    url = put("locked.safetensors", DATA)
    done = subprocess.run([sys.executable, "-c", FORKED_LOCKED, url, which],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["0", "True"], done.stderr[-2000:]


# ---------------------------------------------------------------------------
# Redirects, credentials, signed locations
# ---------------------------------------------------------------------------


def assert_redirected_once(server, url, path):
    """Read every tensor of `url`, whose `path` `server` redirects to
    /blobs/b.safetensors, then one again: the redirect is followed at opening only."""
    with fastst.safe_open(url) as f:
        assert_tensors(f.get_tensors())
        f.get_tensor("t3")
    assert requests_of(server) == [("HEAD", path), ("HEAD", "/blobs/b.safetensors")] + \
        [("GET", "/blobs/b.safetensors")] * 3


def test_redirects_are_followed_once_at_opening(served):
    server, put = served
    put("blobs/b.safetensors", DATA)
    server.redirects["/models/a.safetensors"] = "/blobs/b.safetensors"
    server.reset_counts()
    assert_redirected_once(server, f"{server.url}/models/a.safetensors",
                           "/models/a.safetensors")


def test_credentials_go_to_the_urls_own_host_only(served):
    server, put = served
    with RangeServer({"/blob": DATA}) as elsewhere:
        server.redirects["/model.safetensors"] = f"{elsewhere.url}/blob"
        secret = {"headers": {"Authorization": "Bearer s3cret"}}
        assert_tensors(fastst.load_file(f"{server.url}/model.safetensors",
                                        storage_options=secret))
        assert_tensors(fastst.load_file(
            f"http://me:pass@127.0.0.1:{server.server.server_address[1]}/model.safetensors"))
        assert len(elsewhere.requests) >= 4 and set(elsewhere.authorizations) == {None}
    assert server.authorizations == ["Bearer s3cret", "Basic bWU6cGFzcw=="]


def ipv6_loopback():
    """Whether this machine has an IPv6 loopback address (::1) to serve on."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback address (::1) here")
def test_an_ipv6_literal_url_is_read_with_its_redirects_and_credentials():
    with RangeServer({"/blobs/b.safetensors": DATA}, host="::1") as server, \
            RangeServer({"/blob": DATA}) as elsewhere:
        port = server.server.server_address[1]
        server.redirects.update({"/a.safetensors": "/blobs/b.safetensors",
                                 "/away.safetensors": f"{elsewhere.url}/blob"})
        assert_redirected_once(server, f"http://me:pass@[::1]:{port}/a.safetensors",
                               "/a.safetensors")
        assert set(server.hosts) == {f"[::1]:{port}"}
        assert set(server.authorizations) == {"Basic bWU6cGFzcw=="}
        assert_tensors(fastst.load_file(f"http://me:pass@[::1]:{port}/away.safetensors"))
        assert elsewhere.gets() and set(elsewhere.authorizations) == {None}


def test_an_expired_location_is_looked_up_again_from_the_url(served):
    server, put = served
    put("signed/1", DATA)
    server.redirects["/model.safetensors"] = "/signed/1"
    with fastst.safe_open(f"{server.url}/model.safetensors") as f:
        server.refused.add("/signed/1")     # the signature expired
        put("signed/2", DATA)
        server.redirects["/model.safetensors"] = "/signed/2"
        server.reset_counts()
        assert (f.get_tensor("t5") == TENSORS["t5"]).all()
        assert requests_of(server) == [("GET", "/signed/1"), ("HEAD", "/model.safetensors"),
                                       ("HEAD", "/signed/2"), ("GET", "/signed/2")]
        put("signed/3", fastst.save({"other": np.zeros(3)}))
        server.refused.add("/signed/2")
        server.redirects["/model.safetensors"] = "/signed/3"
        with pytest.raises(SafetensorError, match="changed since it was opened"):
            f.get_tensor("t5")


def test_a_redirect_loop_is_refused(served):
    server, put = served
    server.redirects.update({"/a": "/b", "/b": "/a"})
    with pytest.raises(SafetensorError, match=r"more than 10 redirects"):
        fastst.safe_open(f"{server.url}/a")
    assert len(server.requests) == 11


# ---------------------------------------------------------------------------
# What servers say of their objects
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("status", [403, 405])
def test_an_object_whose_server_refuses_head_is_sized_by_a_get_of_its_first_byte(
        served, status):
    server, put = served
    url = put("signed.safetensors", DATA)
    server.head_status = status      # a URL signed for GET only, say
    server.reset_counts()
    assert_tensors(fastst.load_file(url))
    assert server.gets()[0][2] == "bytes=0-0"


@pytest.mark.parametrize("options", [None, {"transport": "fsspec"}])
def test_weak_etags_hold_reads_to_the_modification_date(served, options):
    server, put = served
    server.weak_etags = True    # If-Match never matches a weak ETag
    url = put("weak.safetensors", DATA)
    assert_tensors(fastst.load_file(url, storage_options=options))
    with fastst.safe_open(url, storage_options=options) as f:
        server.mode = "change"   # each GET after the first sees a new version
        f.get_tensor("t0")
        with pytest.raises(SafetensorError, match="changed since it was opened"):
            f.get_tensor("t0")


def test_an_encoded_answer_is_refused(served):
    server, put = served
    url = put("gzip.safetensors", DATA)
    server.encoding = "gzip"
    with pytest.raises(SafetensorError, match=r"sent bytes \[0, \d+\) encoded \(gzip\), not "
                                              r"as the object holds them"):
        fastst.safe_open(url)


def test_a_trickling_server_gives_a_timeout_within_the_deadline(monkeypatch):
    """A byte every 50 ms never trips a 0.5 s read timeout; the call's deadline (1 s,
    and 256 KiB a second of what it asks) still ends it."""
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)
    with RangeServer({"/slow.safetensors": DATA}) as server:
        server.mode = "trickle"
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer in time while reading bytes"):
            fastst.safe_open(f"{server.url}/slow.safetensors")
        assert time.monotonic() - started < 10    # the deadline: 1 s + 64 KiB at 256 KiB/s
        assert server.bytes_sent < 100


@pytest.fixture
def one_second_deadline(monkeypatch):
    """Timeouts of 0.5 s to connect and 0.5 s to read: a call's deadline of 1 s, and
    256 KiB a second of what it asks."""
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)


def test_a_trickling_body_read_into_many_arrays_times_out_within_the_deadline(
        one_second_deadline):
    """As a trickled body into one array does, where each read of the socket would
    fill several arrays (1 s + 640 KB at 256 KiB/s)."""
    tensors = {f"t{k}": np.full(20_000, k, np.float32) for k in range(8)}
    with RangeServer({"/many.safetensors": fastst.save(tensors)}) as server:
        with fastst.safe_open(f"{server.url}/many.safetensors") as f:
            server.mode, before = "trickle", server.bytes_sent
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer in time while reading"):
                f.get_tensors()
            assert time.monotonic() - started < 10
        assert server.bytes_sent - before < 1_000    # a byte each 50 ms a request


@pytest.mark.parametrize("trickled", ["HEAD", "GET of byte 0", "ranged GET"])
def test_a_server_that_trickles_its_head_times_out_within_the_deadline(
        one_second_deadline, trickled):
    """A byte of a header every 50 ms (for 10 s, then the connection closed) never
    trips the read timeout; the call's deadline ends the wait for the head, at
    opening (a HEAD, or a GET of the first byte where HEAD is refused) as in a read
    (1 s + 156 KiB at 256 KiB/s)."""
    with RangeServer({"/slow.safetensors": DATA}) as server:
        url = f"{server.url}/slow.safetensors"
        server.head_status = 405 if trickled == "GET of byte 0" else None
        server.trickle_heads = {"HEAD": ("HEAD",), "GET of byte 0": ("GET",)}.get(trickled,
                                                                                  ())
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer in time while (opening it|"
                                               "reading bytes)"):
            with fastst.safe_open(url) as f:
                server.trickle_heads = ("GET",)
                server.reset_counts()
                started = time.monotonic()
                f.get_tensor("t1")
        assert time.monotonic() - started < 1 + 0.6 + 3
        assert server.bytes_sent < 100


def test_a_redirect_whose_body_trickles_times_out_within_the_deadline(one_second_deadline):
    """The body of a redirect, read to keep its connection, is read within the
    deadline too (a GET of the first byte, where HEAD is refused)."""
    with RangeServer({"/blob": DATA}) as server:
        server.redirects["/model.safetensors"] = "/blob"
        server.head_status, server.mode = 405, "trickle"
        server.redirect_body = b"r" * 200
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no answer in time while opening it"):
            fastst.safe_open(f"{server.url}/model.safetensors")
        assert time.monotonic() - started < 1 + 3
        assert server.bytes_sent < 100


@pytest.mark.parametrize("informational", [(103,), (100, 102, 103), (103,) * 16])
def test_informational_answers_before_an_answer_are_skipped(served, informational):
    server, put = served
    url = put("hinted.safetensors", DATA)
    server.informational = informational
    server.reset_counts()
    assert_tensors(fastst.load_file(url))
    assert requests_of(server)[0] == ("HEAD", "/hinted.safetensors")
    assert len(server.gets()) == 2     # no GET of the first byte: the HEAD gave a size


@pytest.mark.parametrize("count", [17, 100_000])
def test_more_informational_answers_in_a_row_than_16_are_refused(count):
    """At the 17th, within the deadline and a bounded CPU time, however many the
    server would send."""
    with RangeServer({"/hinted.safetensors": DATA}) as server:
        server.informational = (100,) * count
        cpu = time.thread_time()
        with pytest.raises(SafetensorError, match=r"hinted.safetensors: the server sent more "
                                                  r"than 16 informational answers \(1xx\) "
                                                  r"in a row"):
            fastst.safe_open(f"{server.url}/hinted.safetensors")
        assert time.thread_time() - cpu < 0.5
        assert len(server.requests) == 1


def test_bodies_are_read_from_the_socket_straight_into_the_arrays(served, monkeypatch):
    """A large body's socket reads fill the arrays themselves, not the answer's
    buffer (8 KiB) to be copied from: what goes through that buffer is the heads, the
    file's header, and the last few KiB of an array whose neighbour shares its
    request (a read of less than the buffer fills the buffer)."""
    server, put = served
    tensors = {f"big{k}": np.full(2 * MiB, k, np.float32) for k in range(6)}   # 48 MiB
    url = put("straight.safetensors", fastst.save(tensors))
    into = {"the arrays": 0, "the buffer": 0}
    read, read_each = CallReader.readinto, CallReader.readinto_each

    def counted(reader, buffer):
        got = read(reader, buffer)
        into["the arrays" if memoryview(buffer).nbytes > io.DEFAULT_BUFFER_SIZE
             else "the buffer"] += got or 0
        return got

    def counted_each(reader, buffers):     # views of the arrays, by their ends
        got = read_each(reader, buffers)
        into["the arrays"] += got
        return got

    monkeypatch.setattr(CallReader, "readinto", counted)
    monkeypatch.setattr(CallReader, "readinto_each", counted_each)
    loaded = fastst.load_file(url)
    assert all((loaded[name] == array).all() for name, array in tensors.items())
    assert into["the arrays"] >= 48 * MiB - (128 << 10) and into["the buffer"] < 256 << 10


def answer_on(pair, head_and_body):
    """The answer `head_and_body`, sent by the first socket of `pair` and read from the
    second as the client reads one, its head parsed."""
    from fastst._io.http import Call, CallResponse

    sending, reading = pair
    sending.sendall(head_and_body)
    answer = CallResponse(reading, call=Call(threading.Lock(), 30), timeout=30,
                          object_url="http://127.0.0.1/x")
    answer.begin()
    return answer


def counted_in(reads, read):
    """`read`, a reader's method, noting in `reads` what each call read."""
    def counted(reader, into):
        reads.append(read(reader, into))
        return reads[-1]
    return counted


def test_a_read_of_the_socket_fills_each_array_its_bytes_reach(monkeypatch):
    """Arrays smaller than a read (1 MiB) that follow one another in the body are
    filled by one read of the socket, not one read each (a wait on the socket and
    a pass of the GIL between the request threads an array); the bytes the answer's
    buffered reader took in with the head go first."""
    from fastst._io.http import _read_declared
    from fastst._io.ranged import Scatter

    body = np.random.default_rng(0).integers(0, 256, 40 * 3001, np.uint8).tobytes()
    arrays = [np.zeros(3001, np.uint8) for _ in range(40)]
    reads = []
    monkeypatch.setattr(CallReader, "readinto", counted_in(reads, CallReader.readinto))
    monkeypatch.setattr(CallReader, "readinto_each", counted_in(reads, CallReader.readinto_each))
    pair = socket.socketpair()
    with pair[0], pair[1]:
        answer = answer_on(pair, b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n"
                           % len(body) + body)
        got = _read_declared(answer, Scatter([memoryview(a) for a in arrays]), len(body),
                             lambda count: None)
    assert got == len(body) and b"".join(a.tobytes() for a in arrays) == body
    # the head's read (which brought the buffer's first bytes), then one or two
    assert len(reads) <= 3, reads


def test_a_tls_socket_is_read_one_buffer_at_a_time():
    """TLS has no scattering read (``SSLSocket.recvmsg_into`` raises)."""
    import ssl

    from fastst._io.http import Call

    with socket.socket() as plain, ssl.create_default_context().wrap_socket(
            socket.socket(), server_hostname="localhost", do_handshake_on_connect=False) as tls:
        call = Call(threading.Lock(), 30)
        assert CallReader(plain.makefile("rb", buffering=0), plain, call, 30).scatters
        assert not CallReader(tls.makefile("rb", buffering=0), tls, call, 30).scatters


def test_arrays_of_odd_sizes_loaded_from_a_url_get_their_bytes(served):
    """Arrays of 64 KiB and more (read into place) of sizes that are not a multiple
    of any read, between small ones (staged), in shared requests."""
    server, put = served
    rng = np.random.default_rng(1)
    tensors = {f"t{k:03d}": rng.integers(0, 1 << 30, size, np.int32).view(np.uint8)[:size * 4 - k]
               for k, size in enumerate([16_411, 1_000, 70_001, 250_000, 17, 65_537] * 12)}
    url = put("odd.safetensors", fastst.save(tensors))
    loaded = fastst.load_file(url)
    assert all((loaded[name] == array).all() for name, array in tensors.items())


def test_a_handle_on_a_url_names_its_version_and_its_transport_keeps_it(served):
    server, put = served
    url = put("named.safetensors", DATA)
    ranges = fastst.remote.open_object(url, None)
    assert isinstance(ranges, HttpRanges)
    assert ranges.identity[:2] == (url, len(DATA)) and ranges.etag.startswith('"')
    assert ranges.condition == {"If-Match": ranges.etag}
