"""File objects and object stores: reading by byte ranges (HTTP on loopback, S3 through
moto in server mode, memory://, file objects) and saving to URLs."""
import asyncio
import gc
import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import weakref

import numpy as np
import pytest

import fastst
from conftest import WRITABLE_DTYPES, random_array
from fastst import SafetensorError
from fastst._core import Reader

fsspec = pytest.importorskip("fsspec")
import fsspec.asyn  # noqa: E402
pytest.importorskip("aiohttp")
import fastst.remote  # noqa: E402
from fastst._io import upload  # noqa: E402
from servers import (RangeServer, counted_http_server, http_store, moto_s3,  # noqa: E402,F401
                     putter, s3_store, served, simple_http_server)

HEAD_BYTES = 64 << 10    # the first request of a ranged read: prefix and header, read ahead
MiB = 1 << 20


def every_dtype(seed=0):
    rng = np.random.default_rng(seed)
    return {f"t_{code}": random_array(rng, dtype, (3, 5)) for code, dtype in
            WRITABLE_DTYPES.items()}


def assert_same(got, expected):
    assert list(got) == list(expected) or sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes(), name


@pytest.fixture
def served_alone():
    """As `served`, on a server of the test's own: for tests whose requests are
    abandoned (a stalled server), so that anything sent on their behalf after the
    test cannot reach the counts of the shared server's later tests."""
    pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    with RangeServer() as server:
        yield server, putter(server)


@pytest.fixture
def memory_url():
    fs = fsspec.filesystem("memory")
    url = "memory://fastst-tests/model.safetensors"
    yield url
    if fs.exists(url):
        fs.rm(url)


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


def test_every_dtype_round_trips_through_memory_urls(memory_url):
    tensors = every_dtype()
    fastst.save_file(tensors, memory_url, {"k": "v"})
    assert fsspec.filesystem("memory").cat(memory_url) == fastst.save(tensors, {"k": "v"})
    assert_same(fastst.load_file(memory_url), tensors)
    with fastst.safe_open(memory_url) as f:
        assert f.backend == "ranges" and f.metadata() == {"k": "v"}
        assert f.file_identity[:2] == (memory_url, len(fastst.save(tensors, {"k": "v"})))


def test_every_dtype_round_trips_over_http(served):
    server, put = served
    tensors = every_dtype(1)
    url = put("all.safetensors", fastst.save(tensors))
    assert_same(fastst.load_file(url), tensors)
    with fastst.safe_open(url) as f:
        for name, array in tensors.items():
            assert f.get_tensor(name).tobytes() == array.tobytes()
            assert f.get_slice(name)[1:3].tobytes() == array[1:3].tobytes()
            assert f.gather(name, [2, 0, 2]).tobytes() == array[[2, 0, 2]].tobytes()


def test_file_objects_of_every_kind_read_like_the_file(tmp_path, memory_url):
    tensors = every_dtype(2)
    data = fastst.save(tensors)
    path = tmp_path / "m.safetensors"
    path.write_bytes(data)
    fsspec.filesystem("memory").pipe(memory_url, data)

    class ReadOnly:    # seek and read, no readinto, no name
        def __init__(self):
            self.inner = io.BytesIO(data)

        def seek(self, *args):
            return self.inner.seek(*args)

        def read(self, size=-1):
            return self.inner.read(min(size, 7) if size > 0 else size)   # dribbles

    with open(path, "rb") as opened, fsspec.open(memory_url, "rb") as from_fsspec:
        for file in (io.BytesIO(data), opened, from_fsspec, ReadOnly()):
            assert_same(fastst.load_file(file), tensors)
            with fastst.safe_open(file) as f:
                assert f.get_slice("t_F32")[2].tobytes() == tensors["t_F32"][2].tobytes()
    with open(path, "rb") as opened:
        assert fastst.safe_open(opened).source == str(path)


def test_load_into_and_read_rows_fill_from_a_url(served):
    server, put = served
    tensors = {"a": np.arange(40, dtype=np.int32).reshape(10, 4), "b": np.ones(3)}
    url = put("into.safetensors", fastst.save(tensors))
    out = {"a": np.empty((10, 4), np.int32)}
    fastst.load_into(url, out)
    assert (out["a"] == tensors["a"]).all()
    with fastst.safe_open(url) as f:
        assert (f.read_rows("a", 2, 5) == tensors["a"][2:5]).all()


def test_framework_handles_open_urls(memory_url):
    torch = pytest.importorskip("torch")
    fastst.save_file({"w": np.eye(3, dtype=np.float32)}, memory_url)
    with fastst.safe_open(memory_url, framework="pt") as f:
        assert torch.equal(f.get_tensor("w"), torch.eye(3))
        assert torch.equal(f.get_slice("w")[1:], torch.eye(3)[1:])
        again = pickle.loads(pickle.dumps(f))
        assert torch.equal(again.get_tensor("w"), torch.eye(3))


# ---------------------------------------------------------------------------
# What a read moves: bytes and requests
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_object():
    """256 MiB in 256 tensors of 1 MiB."""
    tensors = {f"t{k:03d}": np.full(MiB, k, np.uint8) for k in range(256)}
    return fastst.save(tensors)


def test_one_tensor_of_a_256_mib_object_moves_the_header_and_that_tensor(served, big_object):
    server, put = served
    url = put("big.safetensors", big_object)
    server.reset_counts()
    with fastst.safe_open(url) as f:
        header_end = f.data_start
        array = f.get_tensor("t123")
    assert (array == 123).all() and array.shape == (MiB,)
    # HEAD (size, ETag), the prefix and header (read ahead to HEAD_BYTES), the tensor
    assert [method for method, _, _ in server.requests] == ["HEAD", "GET", "GET"]
    assert header_end < HEAD_BYTES
    assert server.bytes_sent <= HEAD_BYTES + MiB
    assert server.bytes_sent < len(big_object) // 200


def test_rows_of_a_slice_read_only_those_rows(served):
    server, put = served
    matrix = np.arange(4096 * 256, dtype=np.float32).reshape(4096, 256)   # 1 KiB rows
    url = put("rows.safetensors", fastst.save({"m": matrix}))
    with fastst.safe_open(url) as f:
        server.reset_counts()
        rows = f.get_slice("m")[1000:1010]
        assert (rows == matrix[1000:1010]).all()
        assert server.bytes_sent == 10 * 1024 and len(server.gets()) == 1
        server.reset_counts()
        assert (f.gather("m", [3000, 3001, 3002]) == matrix[3000:3003]).all()
        assert server.bytes_sent == 3 * 1024 and len(server.gets()) == 1


def test_neighbouring_tensors_share_one_request(served):
    server, put = served
    tensors = {f"n{k:02d}": np.full(4096, k, np.uint8) for k in range(50)}   # 200 KiB
    url = put("small.safetensors", fastst.save(tensors))
    server.reset_counts()
    assert_same(fastst.load_file(url), tensors)
    assert len(server.gets()) == 2      # the first HEAD_BYTES, then everything past them
    with fastst.safe_open(url) as f:
        server.reset_counts()
        wanted = {f"n{k:02d}": np.empty(4096, np.uint8) for k in range(30, 40)}
        f.read_into(wanted)
        assert all((array == int(name[1:])).all() for name, array in wanted.items())
        assert len(server.gets()) == 1 and server.bytes_sent == 10 * 4096


def test_a_small_file_is_read_in_one_request(served):
    server, put = served
    tensors = {"a": np.arange(100.0), "b": np.zeros((4, 4), np.int8)}
    url = put("tiny.safetensors", fastst.save(tensors))
    server.reset_counts()
    assert_same(fastst.load_file(url), tensors)
    assert len(server.gets()) == 1


def test_big_reads_go_in_parallel_with_bounded_requests_in_flight(served, monkeypatch):
    server, put = served
    tensors = {"big": np.arange(6 * MiB, dtype=np.float32)}   # 24 MiB: three 8 MiB parts
    url = put("parallel.safetensors", fastst.save(tensors))
    monkeypatch.setattr(fastst.remote, "MAX_REQUESTS", 2)
    server.delay = 0.3
    server.reset_counts()
    assert_same(fastst.load_file(url), tensors)
    parts = sorted(parts_asked(server)[1:])
    assert len(parts) >= 3 and all(end - start <= 8 * MiB for start, end in parts)
    assert all(end == start for (_, end), (start, _) in zip(parts, parts[1:]))   # once each
    assert server.most_in_flight == 2


def parts_asked(server):
    """The (start, end) of each range the server's GETs asked for, in order."""
    parts = []
    for _, _, asked in server.gets():
        first, last = asked.split("=")[1].split("-")
        parts.append((int(first), int(last) + 1))
    return parts


# ---------------------------------------------------------------------------
# Hostile stores
# ---------------------------------------------------------------------------


def test_a_missing_object_is_file_not_found(served, memory_url):
    server, put = served
    with pytest.raises(FileNotFoundError):
        fastst.safe_open(f"{server.url}/nothing.safetensors")
    with pytest.raises(FileNotFoundError):
        fastst.load_file(memory_url + ".missing")


@pytest.mark.parametrize("mode", ["short", "short-length", "ignore-range"])
def test_a_store_that_answers_with_the_wrong_length_is_an_error(served, mode):
    server, put = served
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64)}   # 512 KiB: past the first read
    url = put(f"{mode}.safetensors", fastst.save(tensors))
    with fastst.safe_open(url) as f:
        server.mode = mode
        with pytest.raises(SafetensorError, match=url) as error:
            f.get_tensor("big")
    if mode == "short-length":
        assert "tensor 'big'" in str(error.value) and "short read" in str(error.value)
    if mode == "ignore-range":
        assert "ignored the range request" in str(error.value)


@pytest.mark.parametrize("mode", ["short", "short-length"])
def test_a_body_cut_short_while_it_fills_many_arrays_is_an_error(served, mode):
    """Arrays smaller than a read of the socket, each read filling several of them."""
    server, put = served
    tensors = {f"t{k:02d}": np.full(30_000, k, np.float32) for k in range(24)}   # 2.8 MB
    url = put(f"many-{mode}.safetensors", fastst.save(tensors))
    with fastst.safe_open(url) as f:
        server.mode = mode
        with pytest.raises(SafetensorError, match=url) as error:
            f.get_tensors()
    if mode == "short-length":
        assert "short read" in str(error.value) and "tensor 't" in str(error.value)


def test_a_header_length_past_the_object_is_an_error(served):
    server, put = served
    url = put("past.safetensors", struct.pack("<Q", 1 << 20) + b"{}")
    with pytest.raises(SafetensorError, match="the file is truncated: its header describes at "
                                              "least 1048584 bytes, the file holds 10$"):
        fastst.safe_open(url)
    assert len(server.gets()) <= 1


def test_an_object_changed_after_opening_is_an_error_not_a_mix(served):
    server, put = served
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64)}
    url = put("changing.safetensors", fastst.save(tensors))
    with fastst.safe_open(url) as f:
        server.objects["/changing.safetensors"] = fastst.save({"big": -tensors["big"]})
        with pytest.raises(SafetensorError, match="changed since it was opened"):
            f.get_tensor("big")


def test_an_object_changing_between_requests_is_an_error(served):
    server, put = served
    url = put("flip.safetensors", fastst.save({"big": np.zeros(64 * 1024)}))
    server.mode = "change"      # each GET after the first sees a new ETag
    with pytest.raises(SafetensorError, match="changed since it was opened"):
        fastst.load_file(url)


def test_a_server_without_etags_is_held_to_the_modification_time(served):
    server, put = served
    server.etags = False
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64)}
    url = put("dated.safetensors", fastst.save(tensors))
    assert_same(fastst.load_file(url), tensors)        # unchanged: read as it is
    with fastst.safe_open(url) as f:
        server.mode = "change"      # each GET after the first sees a new version
        f.get_tensor("big")         # the GET that changes it, checked against the date opened
        with pytest.raises(SafetensorError, match="changed since it was opened"):
            f.get_tensor("big")


def test_a_stalled_store_gives_a_timeout_not_a_hang(served_alone):
    aiohttp = pytest.importorskip("aiohttp")
    server, put = served_alone
    url = put("stall.safetensors", fastst.save({"a": np.zeros(3)}))
    server.mode = "stall"
    options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_read=0.5)}}
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer in time"):
        fastst.safe_open(url, storage_options=options)
    assert time.monotonic() - started < 20   # far below the stall, whatever the machine


def test_timeouts_are_set_unless_the_storage_options_set_them():
    options = fastst.remote.with_default_timeouts("s3", {"config_kwargs": {"read_timeout": 5}})
    assert options["config_kwargs"] == {"connect_timeout": fastst.remote.CONNECT_TIMEOUT,
                                        "read_timeout": 5}
    options = fastst.remote.with_default_timeouts("https", {})
    assert options["client_kwargs"]["timeout"].sock_read == fastst.remote.READ_TIMEOUT


def test_a_fetch_that_returns_the_wrong_shape_is_an_error():
    data = fastst.save({"a": np.zeros(3)})
    reader = Reader()
    with pytest.raises(SafetensorError, match="one bytes-like per range"):
        reader.open_ranges("x", len(data), lambda ranges: data)
    with pytest.raises(fastst.SafetensorTypeError, match="not a bytes-like"):
        reader.open_ranges("x", len(data), lambda ranges: [object()])
    with pytest.raises(SafetensorError, match="size must be an integer"):
        reader.open_ranges("x", -1, lambda ranges: [])


def test_a_fetch_that_returns_more_than_asked_is_too_long_not_short():
    data = fastst.save({"a": np.arange(10.0)})
    reader = Reader()
    with pytest.raises(SafetensorError, match=r"came back \d+ bytes long, not \d+ \(too long\)"):
        reader.open_ranges("x", len(data), lambda ranges: [data + b"!" for _ in ranges])
    with pytest.raises(SafetensorError, match=r"not \d+ \(a short read\)"):
        reader.open_ranges("x", len(data), lambda ranges: [data[:-1] for _ in ranges])


def test_a_fetch_that_answers_with_a_strided_view_or_too_few_answers_says_so():
    data = fastst.save({"a": np.arange(10.0)})

    def strided(ranges):
        spaced = bytearray(2 * len(data))
        spaced[::2] = data
        return [memoryview(spaced)[::2] for _ in ranges]

    with pytest.raises(fastst.SafetensorTypeError,
                       match=r"fetch returned a memoryview for bytes \[0, \d+\) that is not "
                             r"contiguous"):
        Reader().open_ranges("x", len(data), strided)
    with pytest.raises(SafetensorError, match=r"one bytes-like per range \(1\), got 2 of them"):
        Reader().open_ranges("x", len(data), lambda ranges: [data, data])


def test_a_file_object_that_gives_more_than_asked_is_refused():
    data = fastst.save({"a": np.arange(10.0)})

    class Flooding(io.BytesIO):     # read(n) gives a megabyte more than n
        readinto = None

        def read(self, size=-1):
            return super().read(size) + bytes(MiB)

    class Boasting(io.BytesIO):     # readinto fills the buffer and says it gave more
        def readinto(self, buffer):
            return super().readinto(buffer) + 100

    class Texting(io.BytesIO):      # read gives text
        readinto = None

        def read(self, size=-1):
            return super().read(size).decode("latin-1")

    with pytest.raises(SafetensorError, match=rf"read gave {len(data) + MiB} bytes when asked "
                                              rf"for {len(data)} \(too long\)"):
        fastst.safe_open(Flooding(data))
    with pytest.raises(SafetensorError, match=rf"readinto gave {len(data) + 100} bytes when "
                                              rf"asked for {len(data)} \(too long\)"):
        fastst.safe_open(Boasting(data))
    with pytest.raises(SafetensorError, match="read returned a str, not bytes"):
        fastst.safe_open(Texting(data))


class HostileStore(fsspec.AbstractFileSystem):
    """A file system of fsspec's kind that holds one object and answers as the test
    says: ``"stalled"`` (its reads wait until the test ends), ``"stalled-info"`` (so
    does looking the object up), ``"too-long"`` (a read gives more than asked),
    ``"generator"`` (a read gives a generator of bytes)."""
    protocol = "hostile"
    data = fastst.save({"big": np.arange(64 * 1024, dtype=np.float64)})
    behaviour = None
    released = None     # a threading.Event, set when the test ends

    def info(self, path, **kwargs):
        if self.behaviour == "stalled-info":
            self.released.wait(20)
        return {"name": path, "size": len(self.data), "type": "file"}

    def cat_file(self, path, start=None, end=None, **kwargs):
        if self.behaviour == "stalled":
            self.released.wait(20)
        return hostile_answer(self, start, end)


def hostile_answer(store, start, end):
    """What a read of a hostile store gives: a generator of the bytes, a megabyte more
    than asked, or the bytes."""
    if store.behaviour == "generator":
        return (bytes([byte]) for byte in store.data[start:end])
    return store.data[start:end] + (b"!" * MiB if store.behaviour == "too-long" else b"")


class HostileAsyncStore(fsspec.asyn.AsyncFileSystem):
    """As `HostileStore`, on fsspec's event loop: ``"stalled"`` waits as a coroutine
    does; ``"blocking"`` holds the event loop's thread itself, which no
    cancellation reaches."""
    protocol = "hostile-async"
    data, behaviour, released = HostileStore.data, None, None

    async def _info(self, path, **kwargs):
        return {"name": path, "size": len(self.data), "type": "file"}

    async def _cat_file(self, path, start=None, end=None, **kwargs):
        if self.behaviour == "stalled":
            await asyncio.sleep(20)
        if self.behaviour == "blocking":
            self.released.wait(20)
        return hostile_answer(self, start, end)


# (the store, how it answers, the error, what it says)
OTHER_STORES = [
    (HostileStore, "stalled", TimeoutError, "no answer in time while reading"),
    (HostileStore, "stalled-info", TimeoutError, "no answer in time while opening it"),
    (HostileStore, "too-long", SafetensorError, r"came back 1114112 bytes long, not 65536 "
                                                r"\(too long\)"),
    (HostileStore, "generator", SafetensorError, r"fetch returned a generator for bytes "
                                                 r"\[0, 65536\), not a bytes-like object"),
    (HostileAsyncStore, "stalled", TimeoutError, "no answer in time while reading"),
    (HostileAsyncStore, "blocking", TimeoutError, "no answer in time while reading"),
    (HostileAsyncStore, "too-long", SafetensorError, r"bytes \[0, 65536\) came back 1114112 "
                                                     r"bytes long, not 65536 \(too long\)"),
    (HostileAsyncStore, "generator", SafetensorError, r"bytes \[0, 65536\) came back as a "
                                                      r"generator, not bytes"),
]


@pytest.mark.parametrize("store, behaviour, kind, message", OTHER_STORES,
                         ids=[f"{store.protocol}-{how}" for store, how, _, _ in OTHER_STORES])
def test_a_store_of_another_kind_is_held_to_the_deadline_and_the_bytes_asked(
        monkeypatch, store, behaviour, kind, message):
    """A file system fsspec knows by its protocol, that stalls (blocking its thread,
    or fsspec's event loop), or answers with more than asked, or not with bytes:
    an error naming the URL within the call's deadline (1 s and 64 KiB at 256 KiB
    a second here), never a hang."""
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)
    fsspec.register_implementation(store.protocol, store, clobber=True)
    monkeypatch.setattr(store, "behaviour", behaviour)
    monkeypatch.setattr(store, "released", threading.Event())
    url = f"{store.protocol}://bucket/model.safetensors"
    started = time.monotonic()
    try:
        with pytest.raises(kind, match=message) as error:
            fastst.safe_open(url, storage_options={"skip_instance_cache": True})
    finally:
        store.released.set()     # the store's thread, or fsspec's loop, goes on
    assert time.monotonic() - started < 10
    assert str(error.value).startswith(f"{url}: ")


def test_a_store_that_holds_the_event_loop_writes_nothing_once_the_call_gave_up(monkeypatch):
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)
    fsspec.register_implementation(HostileAsyncStore.protocol, HostileAsyncStore, clobber=True)
    monkeypatch.setattr(HostileAsyncStore, "released", threading.Event())
    ranges = fastst.remote.open_object("hostile-async://bucket/model.safetensors",
                                       {"skip_instance_cache": True})
    monkeypatch.setattr(HostileAsyncStore, "behaviour", "blocking")
    buffer = bytearray(1000)
    try:
        with pytest.raises(TimeoutError, match="no answer in time"):
            ranges.fetch_into([(0, 1000)], [memoryview(buffer)])
    finally:
        HostileAsyncStore.released.set()
    fsspec.asyn.sync(fsspec.asyn.get_loop(), asyncio.sleep, 0.1)   # the loop runs again
    assert buffer == bytearray(1000)


def s3_through(server):
    """storage_options that reach `server` as an S3 endpoint (objects at /bucket/key)."""
    return {"key": "k", "secret": "s", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": server.url, "region_name": "eu-west-1"}}


def on_store(server, put, store, name, data):
    """The URL and storage_options of `data` put on `server`: over HTTP by fastst's own
    client (``"http"``) or by fsspec's (``"fsspec-http"``), or as S3."""
    put(f"bucket/{name}", data)
    if store == "http":
        return f"{server.url}/bucket/{name}", None
    if store == "fsspec-http":
        return f"{server.url}/bucket/{name}", {"transport": "fsspec"}
    pytest.importorskip("s3fs")
    return f"s3://bucket/{name}", s3_through(server)


LYING_ANSWERS = {
    "new-version": r"changed since it was opened \(its ETag is now \"\w+\", was \"\w+\"\)",
    "range-start": r"answered bytes \[65537, 524433\) \(Content-Range "
                   r"'bytes 65537-524432/524560'\) to the request for bytes \[65536, 524432\)",
    "range-total": r"changed since it was opened \(its size is now 524561 bytes, was 524560\)",
    "ignore-range": r"ignored the range request for bytes \[65536, 524432\) \(status 200",
}


@pytest.mark.parametrize("store", ["http", "fsspec-http", "s3"])
@pytest.mark.parametrize("mode", sorted(LYING_ANSWERS))
def test_an_answer_that_is_not_the_bytes_asked_of_the_version_opened_is_refused(
        served, store, mode):
    """A server that ignores If-Match and answers from a new version, or answers other
    bytes than asked, or gives another size: refused, never read as the tensor."""
    server, put = served
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64), "tail": np.ones(16)}
    url, options = on_store(server, put, store, f"{mode}.safetensors", fastst.save(tensors))
    with fastst.safe_open(url, storage_options=options) as f:
        # 'big' is bytes [144, 524432) of 524560, those before 65536 came with the header
        assert f.data_start == 144
        server.mode = mode
        with pytest.raises(SafetensorError, match=LYING_ANSWERS[mode]) as error:
            f.get_tensor("big")
    assert str(error.value).startswith(f"{url}: ")


def test_an_answer_from_a_later_date_is_refused_where_there_is_no_etag(served):
    server, put = served
    server.etags = False
    url = put("undated.safetensors", fastst.save({"big": np.arange(64 * 1024.0)}))
    with fastst.safe_open(url) as f:
        server.mode = "new-version"     # ignores If-Unmodified-Since
        with pytest.raises(SafetensorError, match=f"^{url}: the object changed since it was "
                                                  r"opened \(its Last-Modified is now"):
            f.get_tensor("big")


UNVERSIONED_ANSWERS = {
    "ETag": r"changed since it was opened \(its Last-Modified is now .+, was .+\) while "
            r"reading bytes \[65536, 524432\)",
    "ETag and Last-Modified": r"the answer while reading bytes \[65536, 524432\) cannot be "
                              r"shown to be from the object opened: it gives no ETag \(the "
                              r"object's was \"\w+\" when opened\) and no Last-Modified date",
}


@pytest.mark.parametrize("store", ["http", "fsspec-http", "s3"])
@pytest.mark.parametrize("left_out", sorted(UNVERSIONED_ANSWERS))
def test_an_answer_from_a_new_version_that_drops_its_etag_is_refused(served, store, left_out):
    """The object replaced after opening, and a server that ignores If-Match answers
    from the new version with no ETag (and no Last-Modified): the header of one
    version and the tensors of the other, unless refused."""
    server, put = served
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64), "tail": np.ones(16)}
    url, options = on_store(server, put, store, "untagged.safetensors", fastst.save(tensors))
    with fastst.safe_open(url, storage_options=options) as f:
        server.mode = "new-version"
        server.gets_leave_out = left_out.split(" and ")
        with pytest.raises(SafetensorError, match=UNVERSIONED_ANSWERS[left_out]) as error:
            f.get_tensor("big")
    assert str(error.value).startswith(f"{url}: ")


@pytest.mark.parametrize("store", ["http", "fsspec-http", "s3"])
def test_a_server_that_tells_no_version_has_nothing_to_compare(served, store):
    """No ETag and no Last-Modified, at opening or after: read as it is."""
    server, put = served
    server.etags = server.dates = False
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64), "tail": np.ones(16)}
    url, options = on_store(server, put, store, "versionless.safetensors", fastst.save(tensors))
    assert_same(fastst.load_file(url, storage_options=options), tensors)
    with fastst.safe_open(url, storage_options=options) as f:
        assert (f.get_tensor("big") == tensors["big"]).all()


def test_a_server_that_ignores_ranges_still_serves_a_whole_small_object(served, tmp_path):
    """Where the range asked is the whole object, the whole object is the answer."""
    server, put = served
    tensors = {"a": np.arange(100.0), "b": np.zeros((4, 4), np.int8)}
    url = put("whole.safetensors", fastst.save(tensors))
    server.mode = "ignore-range"
    assert_same(fastst.load_file(url), tensors)
    _, files = sharded(tmp_path)
    urls = {name: put(f"whole/{name}", data) for name, data in files.items()}
    with fastst.safe_open(urls[INDEX]) as f:
        assert f.keys() == [f"layer.{k}" for k in range(6)]


# ---------------------------------------------------------------------------
# Servers that ignore range requests (python -m http.server)
# ---------------------------------------------------------------------------

# Past the first request: 1.2 MB, and the small tensor last in the file.
PAST_THE_FIRST_READ = {"big": np.arange(300_000, dtype=np.float32),
                       "small": np.arange(7, dtype=np.int16)}


def answer_to_a_range_request(url):
    """(status, Accept-Ranges) of the answer to a request for the first byte."""
    request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return answer.status, answer.headers.get("Accept-Ranges")


def test_a_server_that_ignores_ranges_gives_every_tensor_when_all_are_read(
        simple_http_server):
    """load_file, get_tensors, copy_tensors, a framework's get_tensors, a header longer
    than the first request and a checkpoint by its index: each file read whole."""
    url, folder = simple_http_server
    fastst.save_file(PAST_THE_FIRST_READ, folder / "model.safetensors")
    model = f"{url}/model.safetensors"
    assert answer_to_a_range_request(model) == (200, None)   # the whole file, no ranges
    assert_same(fastst.load_file(model), PAST_THE_FIRST_READ)
    with fastst.safe_open(model) as f:
        assert_same(f.get_tensors(), PAST_THE_FIRST_READ)
        assert_same(f.copy_tensors(), PAST_THE_FIRST_READ)
    many = {f"t{k:04d}": np.full(2, k % 100, np.int8) for k in range(3000)}
    fastst.save_file(many, folder / "long-header.safetensors")
    with fastst.safe_open(f"{url}/long-header.safetensors") as f:
        assert f.data_start > HEAD_BYTES
        assert_same(f.get_tensors(), many)
    layers = {f"layer.{k}": np.full(100_000, k, np.float32) for k in range(4)}
    fastst.save_file(layers, folder / "checkpoint", max_shard_size=500_000)
    assert_same(fastst.load_file(f"{url}/checkpoint/{INDEX}"), layers)
    torch = pytest.importorskip("torch")
    with fastst.safe_open(model, framework="pt") as f:
        assert torch.equal(f.get_tensors()["big"], torch.from_numpy(PAST_THE_FIRST_READ["big"]))


@pytest.mark.parametrize("options", [None, {"transport": "fsspec"}])
def test_every_read_of_a_handle_on_a_server_that_ignores_ranges_comes_from_one_whole_read(
        tmp_path, options):
    """The standard library's own server: the header from the start of its answer to
    the first request, then, at the first read past it, the object whole, once; every
    read after that is served from it."""
    fastst.save_file(PAST_THE_FIRST_READ, tmp_path / "model.safetensors",
                     metadata={"made": "here"})
    big, small = PAST_THE_FIRST_READ["big"], PAST_THE_FIRST_READ["small"]
    with counted_http_server(tmp_path) as (url, requests):
        model = f"{url}/model.safetensors"
        with fastst.safe_open(model, storage_options=options) as f:
            assert f.keys() == ["big", "small"] and f.metadata() == {"made": "here"}
            assert [method for method, _, _ in requests] == ["HEAD", "GET"]
            assert (f.get_tensor("big") == big).all()
            assert f.get_slice("big")[-10:].tolist() == big[-10:].tolist()
            assert f.gather("big", [299_999, 1]).tolist() == [299_999, 1]
            into = np.empty(7, np.int16)
            f.read_into({"small": into})
            assert (into == small).all() and (f.get_tensor("small") == small).all()
            assert_same(f.get_tensors(), PAST_THE_FIRST_READ)
        size = os.path.getsize(tmp_path / "model.safetensors")
        assert requests[1:] == [("GET", "/model.safetensors", f"bytes=0-{HEAD_BYTES - 1}"),
                                ("GET", "/model.safetensors", f"bytes=0-{size - 1}")]


def test_a_part_of_an_object_over_the_whole_read_limit_is_refused_before_it_is_asked_for(
        tmp_path, monkeypatch):
    fastst.save_file(PAST_THE_FIRST_READ, tmp_path / "large.safetensors")
    size = os.path.getsize(tmp_path / "large.safetensors")
    monkeypatch.setattr(fastst.remote, "MAX_WHOLE_READ", MiB)
    with counted_http_server(tmp_path) as (url, requests):
        model = f"{url}/large.safetensors"
        with fastst.safe_open(model) as f:
            assert f.keys() == ["big", "small"]
            # bytes within the first request's are read from it: rows at the start of "big"
            assert f.get_slice("big")[:10].tolist() == list(range(10))
            for read in (lambda: f.get_tensor("big"), lambda: f.get_slice("big")[-10:],
                         lambda: f.gather("big", [299_999, 1]),
                         lambda: f.read_into({"small": np.empty(7, np.int16)})):
                with pytest.raises(SafetensorError) as error:
                    read()
                assert str(error.value) == (
                    f"{model}: the server ignores range requests (it answers them with the "
                    f"whole object), and the object's {size} bytes are more than the {MiB} "
                    f"read whole from such a server (fastst.remote.MAX_WHOLE_READ): download "
                    f"it first, or serve it from a server that supports range requests")
    assert [method for method, _, _ in requests] == ["HEAD", "GET"]


def test_a_folder_listing_is_not_a_safetensors_file(simple_http_server, capsys):
    url, folder = simple_http_server
    (folder / "listed").mkdir()
    listing = f"{url}/listed/"
    what = "it is an HTML page (a web page or a folder listing, not the file itself)"
    with pytest.raises(SafetensorError, match=re.escape(f"{listing}: not a safetensors file: "
                                                        f"{what}")):
        fastst.load_file(listing)
    status, reports, _ = cli_json(capsys, "verify", "--json", listing)
    assert status == 1
    assert reports[0]["files"][0]["errors"] == [
        {"tensor": None, "error": f"not a safetensors file: {what}"}]


def test_verify_checks_a_checkpoint_by_its_index_on_a_server_that_ignores_ranges(
        simple_http_server, capsys):
    url, folder = simple_http_server
    layers = {f"layer.{k}": np.full(100_000, k, np.float32) for k in range(4)}
    fastst.save_file(layers, folder / "verified", max_shard_size=500_000)
    status, reports, _ = cli_json(capsys, "verify", "--json", f"{url}/verified/{INDEX}")
    assert status == 0 and reports[0]["errors"] == []
    assert [(file["file"], file["tensors"], file["checksum"]) for file in reports[0]["files"]] \
        == [(f"{url}/verified/model-0000{k}-of-00004.safetensors", 1, None)
            for k in range(1, 5)]


def test_a_server_that_ignores_ranges_serves_a_whole_read_in_one_more_request(served):
    server, put = served
    data = fastst.save(PAST_THE_FIRST_READ)
    url = put("whole-read.safetensors", data)
    server.mode = "ignore-range"
    server.reset_counts()
    assert_same(fastst.load_file(url), PAST_THE_FIRST_READ)
    assert [asked for _, _, asked in server.gets()] == [f"bytes=0-{HEAD_BYTES - 1}",
                                                        f"bytes=0-{len(data) - 1}"]


def test_an_object_over_the_whole_read_limit_is_refused_before_it_is_asked_for(
        served, monkeypatch):
    server, put = served
    data = fastst.save(PAST_THE_FIRST_READ)
    url = put("over-the-limit.safetensors", data)
    server.mode = "ignore-range"
    monkeypatch.setattr(fastst.remote, "MAX_WHOLE_READ", MiB)
    server.reset_counts()
    with pytest.raises(SafetensorError) as error:
        fastst.load_file(url)
    assert str(error.value) == (
        f"{url}: the server ignores range requests (it answers them with the whole object), "
        f"and the object's {len(data)} bytes are more than the {MiB} read whole from such a "
        f"server (fastst.remote.MAX_WHOLE_READ): download it first, or serve it from a "
        f"server that supports range requests")
    assert [asked for _, _, asked in server.gets()] == [f"bytes=0-{HEAD_BYTES - 1}"]


def test_opening_a_large_object_on_a_server_that_ignores_ranges_reads_its_start_only(
        served, big_object):
    """The whole 256 MiB object comes back to the first request: its first bytes are
    taken and the connection dropped; the server gets to send no more than the
    sockets take in."""
    server, put = served
    url = put("large.safetensors", big_object)
    server.mode = "ignore-range"
    server.reset_counts()
    with fastst.safe_open(url) as f:
        assert len(f.keys()) == 256
    assert server.bytes_sent < 64 * MiB


def test_a_server_that_says_it_takes_no_range_requests_is_asked_for_none(served):
    server, put = served
    server.accept_ranges = "none"
    data = fastst.save(PAST_THE_FIRST_READ)
    url = put("no-ranges.safetensors", data)
    with fastst.safe_open(url) as f:
        server.reset_counts()
        assert (f.get_tensor("big") == PAST_THE_FIRST_READ["big"]).all()
        assert_same(f.get_tensors(), PAST_THE_FIRST_READ)
        assert [asked for _, _, asked in server.gets()] == [f"bytes=0-{len(data) - 1}"]


def test_an_answer_longer_than_the_object_is_too_long_not_short(served, monkeypatch):
    server, put = served
    url = put("index.json", b'{"weight_map": {}}')
    monkeypatch.setattr(fastst._io.ranged.RangedObject, "__call__",
                        lambda self, ranges: [b" " * (self.size + 5)])
    with pytest.raises(SafetensorError, match=r"answered 23 bytes for 18 \(too long\)$"):
        fastst.remote.read_object(url, None, 1000, "index")


def test_an_object_of_no_known_size_is_refused(served):
    server, put = served
    url = put("sizeless.safetensors", fastst.save({"a": np.zeros(3)}))
    server.sizes = False        # no Content-Length to a HEAD; the GET asked then goes on
    server.mode = "endless"
    with pytest.raises(SafetensorError, match=f"^{url}: the store gives no size"):
        fastst.safe_open(url)


ENDLESS_READER = """
import json, os, resource, sys
import fsspec, fastst, fastst.cli, fastst.remote, fastst._io.http   # all a read loads, loaded
if sys.argv[2] != "null":
    import s3fs
base = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (base + (768 << 20), resource.RLIM_INFINITY))
url, options, action = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
try:
    if action == "inspect":
        sys.exit(fastst.cli.main(["inspect", "--json", url]))
    with fastst.safe_open(url, storage_options=options) as f:
        if action == "tensor":
            f.get_tensor("big")
    print("read")
except fastst.SafetensorError as error:
    print("refused:", error)
except MemoryError:
    print("out of memory")
"""

# (mode, store, what is read, GETs answered honestly first, what the refusal says)
ENDLESS = [
    ("endless", "http", "open", 0, "ignored the range request for bytes [0, 65536)"),
    ("endless", "http", "tensor", 1, "ignored the range request for bytes [65536, 524432)"),
    ("overlong", "http", "tensor", 1, "the answer for bytes [65536, 524432) goes on past the "
                                      "458896 bytes it should hold (too long)"),
    ("endless", "http", "index", 0, "goes on past the 396 bytes it should hold (too long)"),
    ("endless", "http", "inspect", 0, "ignored the range request for bytes [0, 65536)"),
    ("endless", "fsspec-http", "open", 0, "ignored the range request for bytes [0, 65536)"),
    ("overlong", "fsspec-http", "tensor", 1, "the answer for bytes [65536, 524432) goes on past "
                                             "the 458896 bytes it should hold (too long)"),
    ("endless", "fsspec-http", "index", 0, "goes on past the 396 bytes it should hold "
                                           "(too long)"),
    ("endless", "s3", "open", 0, "ignored the range request for bytes [0, 65536)"),
    ("endless", "s3", "tensor", 1, "ignored the range request for bytes [65536, 524432)"),
    ("overlong", "s3", "tensor", 1, "goes on past the 458896 bytes it should hold (too long)"),
    ("endless", "s3", "index", 0, "goes on past the 396 bytes it should hold (too long)"),
]


@pytest.mark.parametrize("mode, store, action, honest, refusal", ENDLESS,
                         ids=[f"{m}-{s}-{a}" for m, s, a, _, _ in ENDLESS])
def test_an_answer_without_end_is_read_no_further_than_asked(served, tmp_path, mode, store,
                                                             action, honest, refusal):
    """A server that ignores Range and streams a chunked body without end, or sends
    a range and goes on past it: the header at opening, a tensor, a checkpoint's
    index, inspect, read in a child process with a bounded address space; the
    server counts what it sent. Nothing past the bytes asked is read."""
    server, put = served
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64), "tail": np.ones(16)}
    name = "model.safetensors"
    if action == "index":
        name = INDEX
        _, files = sharded(tmp_path)
        for shard, data in files.items():
            put(f"bucket/{shard}", data)
        assert len(files[INDEX]) == 396
    url, options = on_store(server, put, store, name,
                            files[INDEX] if action == "index" else fastst.save(tensors))
    server.endless_limit = 1 << 30
    server.mode, server.honest_gets = mode, honest
    server.reset_counts()
    done = subprocess.run([sys.executable, "-c", ENDLESS_READER, url, json.dumps(options),
                           action], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MALLOC_ARENA_MAX": "2"})
    output = done.stdout.strip()
    if action == "inspect":
        report = json.loads(output)
        assert report["file"] == url and done.returncode == 1, output
        output = report["error"]
    else:
        assert output.startswith(f"refused: {url}: "), (output, done.stderr[-3000:])
    assert refusal in output, output
    assert server.bytes_sent < 64 * MiB     # what the sockets' buffers took in, at most


# ---------------------------------------------------------------------------
# Credentials in URLs
# ---------------------------------------------------------------------------

SECRET_QUERY = "?token=s3cr3t-tok&X-Amz-Signature=s3cr3t-sig&v=2"
SHOWN_QUERY = "?token=***&X-Amz-Signature=***&v=2"
GUARDED = {"big": np.arange(64 * 1024, dtype=np.float64), "tail": np.ones(16)}


def with_secrets(server, name):
    """The URL of `name` on `server` with a user and password, and a token and a
    signature in its query; and that URL as messages must show it."""
    where = f"127.0.0.1:{server.server.server_address[1]}/{name}"
    return (f"http://alice:s3cr3t-pw@{where}{SECRET_QUERY}",
            f"http://***:***@{where}{SHOWN_QUERY}")


def read_guarded(server, put, url, options, mode=None):
    """Open `url` (GUARDED put there), set `mode` on the server, read a tensor."""
    put(f"guarded.safetensors{SECRET_QUERY}", fastst.save(GUARDED))
    with fastst.safe_open(url, storage_options=options) as f:
        if mode == "replaced":     # a new ETag: If-Match fails (412)
            put(f"guarded.safetensors{SECRET_QUERY}", fastst.save({"other": np.zeros(3)}))
        else:
            server.mode = mode
        f.get_tensor("big")


def failing(status):
    def read(server, put, url, options):
        server.failures[f"/guarded.safetensors{SECRET_QUERY}"] = status
        fastst.safe_open(url, storage_options=options)
    return read


def redirected_in_a_loop(server, put, url, options):
    server.redirects[f"/guarded.safetensors{SECRET_QUERY}"] = f"/loop{SECRET_QUERY}"
    server.redirects[f"/loop{SECRET_QUERY}"] = f"/guarded.safetensors{SECRET_QUERY}"
    fastst.safe_open(url, storage_options=options)


def redirected_to_a_failing_signed_location(server, put, url, options):
    server.redirects[f"/guarded.safetensors{SECRET_QUERY}"] = "/blob?Signature=s3cr3t-location"
    server.failures["/blob?Signature=s3cr3t-location"] = 500
    fastst.safe_open(url, storage_options=options)


def stalled(server, put, url, options):
    put(f"guarded.safetensors{SECRET_QUERY}", fastst.save(GUARDED))
    server.mode = "stall"
    fastst.safe_open(url, storage_options=options)


FAILED_READS = {
    "404": lambda server, put, url, options: fastst.safe_open(url, storage_options=options),
    "401": failing(401),
    "403": failing(403),
    "500": failing(500),
    "412": lambda server, put, url, options: read_guarded(server, put, url, options,
                                                          "replaced"),
    "changed ETag": lambda server, put, url, options: read_guarded(server, put, url, options,
                                                                   "new-version"),
    "too long": lambda server, put, url, options: read_guarded(server, put, url, options,
                                                               "overlong"),
    "ignored range": lambda server, put, url, options: read_guarded(server, put, url, options,
                                                                    "ignore-range"),
    "timeout": stalled,
    "redirect loop": redirected_in_a_loop,
    "signed location": redirected_to_a_failing_signed_location,
}


def assert_nothing_secret(*texts):
    for text in texts:
        assert "s3cr3t" not in text, text


@pytest.mark.parametrize("options", [None, {"transport": "fsspec"}], ids=["http", "fsspec"])
@pytest.mark.parametrize("failure", sorted(FAILED_READS))
def test_no_error_shows_the_credentials_of_a_url(served_alone, monkeypatch, capsys, caplog,
                                                 failure, options):
    """Its message, its repr, its traceback with every cause, and whatever was
    printed or logged meanwhile: the URL is named with its user, password, token and
    signature hidden."""
    server, put = served_alone
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)
    url, shown = with_secrets(server, "guarded.safetensors")
    with pytest.raises(Exception) as raised:
        FAILED_READS[failure](server, put, url, options)
    error = raised.value
    captured = capsys.readouterr()
    assert_nothing_secret(str(error), repr(error), "".join(traceback.format_exception(error)),
                          captured.out, captured.err, caplog.text)
    assert shown in str(error)


def test_no_repr_report_or_progress_bar_shows_the_credentials_of_a_url(
        served, tmp_path, monkeypatch, capsys):
    """Reprs of a handle and a checkpoint, their sources, a download bar, inspect's
    and verify's reports, a Loader's state: the URL shown, its credentials hidden, and
    sent with every request (the shards of a checkpoint found beside its index)."""
    from fastst.cli import main
    from fastst.data import Loader

    server, put = served
    for module in (fastst._io.ranged, fastst._io.progress):    # a bar for every read
        monkeypatch.setattr(module, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr(fastst._io.progress, "is_terminal", lambda stream: True)
    url, shown = with_secrets(server, "model.safetensors")
    put(f"model.safetensors{SECRET_QUERY}", fastst.save(GUARDED))
    _, files = sharded(tmp_path)
    for name, data in files.items():
        put(f"checkpoint/{name}", data)
    # its shards are found beside it: with its user and password, without its query
    index, shown_index = (part.split("?")[0] for part in with_secrets(server,
                                                                     f"checkpoint/{INDEX}"))
    server.reset_counts()
    with fastst.safe_open(url) as f, fastst.safe_open(index) as checkpoint:
        f.get_tensor("big")
        checkpoint.get_tensor("layer.0")
        handle, shown_checkpoint = repr(f), repr(checkpoint)
        texts = [handle, f.source, str(f.file_identity), shown_checkpoint, checkpoint.source,
                 repr(fastst._io.source.as_source(url)), checkpoint.shard_file("layer.0")]
    texts.append(capsys.readouterr().err)
    assert "download" in texts[-1]
    assert main(["inspect", "--json", url]) == 0 and main(["verify", "--json", index]) == 0
    loader = Loader(index, ["layer.0"], 10)
    next(iter(loader))
    texts.append(str(loader.state_dict()))
    captured = capsys.readouterr()
    assert shown in handle and shown_index in shown_checkpoint and shown in captured.out
    assert "model-00001-of-00003.safetensors" in captured.out
    assert_nothing_secret(*texts, captured.out, captured.err)
    assert set(server.authorizations) == {"Basic YWxpY2U6czNjcjN0LXB3"}   # alice:s3cr3t-pw


# ---------------------------------------------------------------------------
# Pickling
# ---------------------------------------------------------------------------


def test_a_url_handle_pickles_by_reopening_and_refuses_a_changed_object(served):
    server, put = served
    url = put("pickled.safetensors", fastst.save({"a": np.arange(5)}))
    handle = fastst.safe_open(url, storage_options={"headers": {"X-Test": "1"}})
    again = pickle.loads(pickle.dumps(handle))
    assert (again.get_tensor("a") == np.arange(5)).all()
    assert again.file_identity == handle.file_identity
    server.objects["/pickled.safetensors"] = fastst.save({"a": np.arange(6)})
    with pytest.raises(SafetensorError, match="changed since the handle was pickled"):
        pickle.loads(pickle.dumps(handle))


def test_a_file_object_handle_does_not_pickle():
    handle = fastst.safe_open(io.BytesIO(fastst.save({"a": np.zeros(1)})))
    with pytest.raises(SafetensorError, match="file object cannot be pickled"):
        pickle.dumps(handle)


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def test_saving_to_a_file_object_writes_the_bytes_of_a_file(tmp_path):
    tensors = every_dtype(3)
    tensors["fortran"] = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    tensors["big_endian"] = np.arange(5, dtype=">i4")
    fastst.save_file(tensors, tmp_path / "disk.safetensors", {"m": "1"})
    out = io.BytesIO()
    fastst.save_file(tensors, out, {"m": "1"})
    assert out.getvalue() == (tmp_path / "disk.safetensors").read_bytes()


def test_options_that_need_a_local_path_are_refused_for_urls(memory_url, tmp_path):
    with pytest.raises(SafetensorError, match="apply to local paths"):
        fastst.save_file({"a": np.zeros(1)}, memory_url, fsync=True)
    with pytest.raises(SafetensorError, match="apply to URLs only"):
        fastst.save_file({"a": np.zeros(1)}, tmp_path / "a.safetensors",
                         storage_options={"anon": True})
    with pytest.raises(SafetensorError, match="apply to URLs only"):
        fastst.safe_open(tmp_path / "a.safetensors", storage_options={"anon": True})


# ---------------------------------------------------------------------------
# S3 (moto in server mode on 127.0.0.1)
# ---------------------------------------------------------------------------


def test_s3_round_trip_with_golden_bytes(s3_store, tmp_path):
    tensors = every_dtype(4)
    url = "s3://fastst/every.safetensors"
    fastst.save_file(tensors, url, {"k": "v"}, storage_options=s3_store)
    fastst.save_file(tensors, tmp_path / "disk.safetensors", {"k": "v"})
    fs = fsspec.filesystem("s3", **s3_store)
    assert fs.cat(url) == (tmp_path / "disk.safetensors").read_bytes()
    assert_same(fastst.load_file(url, storage_options=s3_store), tensors)
    with fastst.safe_open(url, storage_options=s3_store) as f:
        assert f.metadata() == {"k": "v"}
        assert f.get_slice("t_F64")[1:2].tobytes() == tensors["t_F64"][1:2].tobytes()


def s3_calls(monkeypatch, fail_part=None):
    """Watch s3fs's calls to S3: returns the methods called, in order, and the most
    parts in flight at once, as they go; with `fail_part`, that part's upload fails."""
    import asyncio

    import s3fs
    call = s3fs.S3FileSystem._call_s3
    seen = {"methods": [], "in_flight": 0, "most_in_flight": 0}

    async def watched(self, method, *args, **kwargs):
        seen["methods"].append(method)
        if method != "upload_part":
            return await call(self, method, *args, **kwargs)
        seen["in_flight"] += 1
        seen["most_in_flight"] = max(seen["most_in_flight"], seen["in_flight"])
        try:
            await asyncio.sleep(0.05)     # long enough for the next parts to start
            if kwargs.get("PartNumber") == fail_part:
                raise OSError("connection lost")
            return await call(self, method, *args, **kwargs)
        finally:
            seen["in_flight"] -= 1

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", watched)
    return seen


def test_s3_a_big_save_goes_in_parts_at_once(s3_store, tmp_path, monkeypatch):
    tensors = {"a": np.arange(6 * MiB, dtype=np.float32), "b": np.ones(7, np.int8)}  # 24 MiB
    url = "s3://fastst/parts.safetensors"
    seen = s3_calls(monkeypatch)
    fastst.save_file(tensors, url, storage_options={**s3_store, "part_size": 5 * MiB,
                                                    "max_concurrency": 3})
    monkeypatch.undo()
    assert seen["methods"].count("upload_part") == 5 and seen["most_in_flight"] == 3
    fastst.save_file(tensors, tmp_path / "disk.safetensors")
    fs = fsspec.filesystem("s3", **s3_store)
    assert fs.cat(url) == (tmp_path / "disk.safetensors").read_bytes()
    assert fs.info(url)["ETag"].strip('"').endswith("-5")


def test_s3_a_file_that_would_take_more_parts_than_s3_takes_goes_in_larger_ones(
        s3_store, tmp_path, monkeypatch):
    monkeypatch.setattr(upload, "MAX_S3_PARTS", 4)    # S3's 10,000, for 24 MiB
    tensors = {"a": np.arange(6 * MiB, dtype=np.float32)}
    fastst.save_file(tensors, tmp_path / "disk.safetensors")
    expected = (tmp_path / "disk.safetensors").read_bytes()
    options = {**s3_store, "part_size": 5 * MiB, "max_concurrency": 3}
    fs = fsspec.filesystem("s3", **s3_store)
    for url, save in [("s3://fastst/capped.safetensors", fastst.save_file),
                      ("s3://fastst/capped-stream.safetensors", fastst.save_file_from)]:
        seen = s3_calls(monkeypatch)
        if save is fastst.save_file:
            save(tensors, url, storage_options=options)
        else:
            save({"a": ("F32", (6 * MiB,))}, tensors, url, storage_options=options)
        assert seen["methods"].count("upload_part") == 4
        assert seen["most_in_flight"] == 2    # parts of 6 MiB: 15 MiB in flight at most
        assert fs.cat(url) == expected
        assert fs.info(url)["ETag"].strip('"').endswith("-4")


def test_s3_an_upload_keeps_nothing_of_a_part_sent_but_its_etag(s3_store, monkeypatch):
    # parts of 1 KiB, which moto takes when told to, so that an upload has many
    import moto.s3.models
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 1)
    monkeypatch.setattr(upload, "SMALLEST_S3_PART", 1024)
    futures, held = [], []
    submit, call = asyncio.run_coroutine_threadsafe, upload._MultipartUpload._call

    def submitting(coroutine, loop):
        future = submit(coroutine, loop)
        futures.append(weakref.ref(future))
        return future

    def completing(self, method, **kwargs):
        if method == "complete_multipart_upload":
            gc.collect()
            held.append(sum(future() is not None for future in futures))
        return call(self, method, **kwargs)

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", submitting)
    monkeypatch.setattr(upload._MultipartUpload, "_call", completing)
    url = "s3://fastst/many-parts.safetensors"
    tensors = {"a": np.arange(25_000, dtype=np.float32)}    # 98 parts
    fastst.save_file(tensors, url, storage_options={**s3_store, "part_size": 1024,
                                                    "max_concurrency": 4})
    assert held and held[0] <= 4
    fs = fsspec.filesystem("s3", **s3_store)
    assert fs.info(url)["ETag"].strip('"').endswith("-98")
    assert_same(fastst.load_file(url, storage_options=s3_store), tensors)


def test_s3_a_failed_save_leaves_the_previous_object(s3_store, monkeypatch):
    url = "s3://fastst/kept.safetensors"
    old = {"a": np.arange(10.0)}
    fastst.save_file(old, url, storage_options=s3_store)
    seen = s3_calls(monkeypatch, fail_part=3)
    new = {"a": np.arange(4 * MiB, dtype=np.float32), "b": np.zeros(2 * MiB, np.float32)}
    with pytest.raises(OSError, match="connection lost"):
        fastst.save_file(new, url, storage_options={**s3_store, "part_size": 5 * MiB})
    monkeypatch.undo()
    assert seen["methods"][-1] == "abort_multipart_upload"
    assert "complete_multipart_upload" not in seen["methods"]
    assert_same(fastst.load_file(url, storage_options=s3_store), old)
    uploads = fsspec.filesystem("s3", **s3_store).call_s3("list_multipart_uploads",
                                                          Bucket="fastst")
    assert uploads.get("Uploads", []) == []


def test_s3_an_object_replaced_after_opening_is_an_error(s3_store):
    url = "s3://fastst/replaced.safetensors"
    tensors = {"big": np.arange(64 * 1024, dtype=np.float64)}
    fastst.save_file(tensors, url, storage_options=s3_store)
    with fastst.safe_open(url, storage_options=s3_store) as f:
        fastst.save_file({"big": -tensors["big"]}, url, storage_options=s3_store)
        with pytest.raises(SafetensorError, match="changed since it was opened"):
            f.get_tensor("big")


def test_s3_missing_object_and_pickling(s3_store):
    with pytest.raises(FileNotFoundError):
        fastst.safe_open("s3://fastst/none.safetensors", storage_options=s3_store)
    url = "s3://fastst/pickle.safetensors"
    fastst.save_file({"a": np.arange(4)}, url, storage_options=s3_store)
    with fastst.safe_open(url, storage_options=s3_store) as f:
        again = pickle.loads(pickle.dumps(f))
        assert (again.get_tensor("a") == np.arange(4)).all()


@pytest.fixture
def spools(tmp_path, monkeypatch):
    """The spool folders of uploads, in a temporary folder of this test's own (so that
    other processes' uploads do not show): a function listing them."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return lambda: sorted(name for name in os.listdir(folder)
                          if name.startswith("fastst-upload-"))


def test_a_stream_writer_fills_a_spool_and_uploads_it_at_close(s3_store, tmp_path, spools):
    url = "s3://fastst/streamed.safetensors"
    tensors = {"a": np.arange(3 * MiB, dtype=np.float32).reshape(3, MiB),
               "b": np.arange(10, dtype=np.int16)}
    before = spools()
    options = {**s3_store, "default_block_size": 5 * MiB}
    with fastst.StreamWriter(url, {"a": ("F32", (3, MiB)), "b": ("I16", (10,))},
                             {"k": "v"}, checksum="xxh3_64", storage_options=options) as writer:
        assert writer.name == url
        writer.write("b", tensors["b"])
        writer.write("a", tensors["a"][2:], start_row=2)     # out of order
        writer.view("a")[:2] = tensors["a"][:2]
        fs = fsspec.filesystem("s3", **s3_store)
        assert not fs.exists(url)                             # nothing uploaded yet
    assert spools() == before
    fastst.save_file(tensors, tmp_path / "disk.safetensors", {"k": "v"}, checksum="xxh3_64")
    assert fs.cat(url) == (tmp_path / "disk.safetensors").read_bytes()


def test_an_aborted_or_unfilled_stream_writer_uploads_nothing(s3_store, spools):
    url = "s3://fastst/streamed-kept.safetensors"
    old = {"a": np.arange(4.0)}
    fastst.save_file(old, url, storage_options=s3_store)
    before = spools()
    with pytest.raises(RuntimeError, match="stop"):
        with fastst.StreamWriter(url, {"a": ("F64", (4,))}, storage_options=s3_store) as writer:
            writer.write("a", np.zeros(4))
            raise RuntimeError("stop")
    with pytest.raises(SafetensorError, match="not written, so not saved"):
        with fastst.StreamWriter(url, {"a": ("F64", (4,))}, storage_options=s3_store) as writer:
            writer.write("a", np.zeros(2))
    with pytest.raises(SafetensorError, match=f"^{url}: tensor .a. is given twice"):
        fastst.StreamWriter(url, [("a", "F64", (4,)), ("a", "F64", (4,))],
                            storage_options=s3_store)
    assert spools() == before
    assert_same(fastst.load_file(url, storage_options=s3_store), old)


KILLED_WRITER = """
import json, sys, time
import numpy as np
import fastst
writer = fastst.StreamWriter("s3://fastst/killed.safetensors", {"a": ("F32", (8, 1 << 20))},
                             storage_options=json.loads(sys.argv[1]))
writer.write("a", np.ones((4, 1 << 20), np.float32))
print("half written", flush=True)
time.sleep(60)
"""


def test_the_spool_of_a_killed_stream_writer_is_removed_by_the_next_one(s3_store, tmp_path,
                                                                        spools):
    folder = tempfile.gettempdir()    # this test's own (see spools)
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, json.dumps(s3_store)],
                             env={**os.environ, "TMPDIR": folder}, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"half written"
        (spool,) = spools()
        assert folder_bytes(os.path.join(folder, spool)) >= 32 * MiB
        with fastst.StreamWriter("s3://fastst/other.safetensors", {"a": ("F32", (1,))},
                                 storage_options=s3_store) as writer:
            writer.write("a", np.ones(1, np.float32))
        assert spools() == [spool]           # its writer is alive: it stays
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    assert spools() == [spool]
    writer = fastst.StreamWriter("s3://fastst/next.safetensors", {"a": ("F32", (1,))},
                                 storage_options=s3_store)
    assert spool not in spools()             # its writer is gone: removed
    writer.abort()
    assert spools() == [] and folder_bytes(folder) == 0


def folder_bytes(folder):
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(folder) for name in names)


def test_a_stream_writer_dropped_without_close_leaves_no_spool(s3_store, spools):
    url = "s3://fastst/dropped.safetensors"
    writer = fastst.StreamWriter(url, {"a": ("F64", (4,))}, storage_options=s3_store)
    writer.write("a", np.zeros(4))
    assert len(spools()) == 1
    del writer
    gc.collect()
    assert spools() == []
    assert not fsspec.filesystem("s3", **s3_store).exists(url)


def test_save_file_from_streams_tensors_to_a_url(memory_url, tmp_path):
    source = tmp_path / "source.safetensors"
    tensors = every_dtype(3)
    fastst.save_file(tensors, source)
    with fastst.safe_open(source) as f:
        fastst.save_file_from(fastst.writer.specs_of(f), f, memory_url)
    assert_same(fastst.load_file(memory_url), tensors)
    with pytest.raises(SafetensorError, match="storage_options apply to URLs only"):
        fastst.StreamWriter(tmp_path / "x.safetensors", {"a": ("F32", (1,))},
                            storage_options={"anon": True})
    with pytest.raises(fastst.SafetensorNotImplementedError, match="not detached"):
        fastst.StreamWriter(memory_url, {"a": ("F32", (1,))}).detach()


def test_verify_checks_checksums_read_from_a_url(memory_url):
    pytest.importorskip("xxhash")
    fastst.save_file({"a": np.arange(5.0)}, memory_url, checksum="xxh3_64")
    with fastst.safe_open(memory_url, verify=True) as f:
        assert (f.get_tensor("a") == np.arange(5.0)).all()
    data = bytearray(fsspec.filesystem("memory").cat(memory_url))
    data[-1] ^= 1
    fsspec.filesystem("memory").pipe(memory_url, bytes(data))
    with fastst.safe_open(memory_url, verify=True) as f:
        with pytest.raises(SafetensorError, match="checksum mismatch"):
            f.get_tensor("a")


def test_a_file_object_that_cannot_seek_is_refused(tmp_path):
    closed = io.BytesIO(fastst.save({"a": np.zeros(1)}))
    closed.close()
    with pytest.raises(SafetensorError, match="must be open and seekable"):
        fastst.safe_open(closed)
    read_end, write_end = os.pipe()
    with open(read_end, "rb") as pipe, open(write_end, "wb"):
        with pytest.raises(SafetensorError, match="must be open and seekable"):
            fastst.load_file(pipe)


def test_ranged_reads_match_the_bytes_whatever_the_plan():
    """Gathers in any order (repeats, neighbours, far apart), rows and whole tensors over
    a plan that spans several 8 MiB parts: the same arrays as reading from memory, and
    every range asked for lies in the file."""
    rng = np.random.default_rng(7)
    tensors = {"wide": rng.standard_normal((2500, 1024), dtype=np.float32),   # ~10 MiB
               "narrow": np.arange(3000, dtype=np.int16).reshape(1000, 3),
               "empty": np.zeros((0, 4), np.uint8)}
    data = fastst.save(tensors)
    asked = []

    def fetch(ranges):
        asked.extend(ranges)
        return [data[offset:offset + length] for offset, length in ranges]

    reader = Reader()
    reader.open_ranges("mem", len(data), fetch)
    assert_same(reader.copy_tensors(), tensors)
    for _ in range(20):
        name = ("wide", "narrow")[int(rng.integers(2))]
        rows = rng.integers(-len(tensors[name]), len(tensors[name]), size=int(rng.integers(1, 50)))
        if rng.integers(2):
            rows = np.concatenate([rows, rows[:3], np.arange(10, 20)])
        assert (reader.gather(name, rows) == tensors[name][rows]).all()
        first = int(rng.integers(0, len(tensors[name])))
        last = int(rng.integers(first, len(tensors[name]) + 1))
        assert (reader.read_rows(name, first, last) == tensors[name][first:last]).all()
    assert reader.get_tensor("empty").shape == (0, 4)
    assert all(0 <= offset and offset + length <= len(data) and length <= 8 * MiB
               for offset, length in asked)


class RangesInto:
    """A fetch with fetch_into, over bytes in memory: what it was asked, and where."""

    def __init__(self, data, lie=None):
        self.data, self.lie, self.calls = data, lie, []

    def __call__(self, ranges):
        return [self.data[offset:offset + length] for offset, length in ranges]

    def fetch_into(self, ranges, buffers):
        self.calls.append([(offset, length, np.frombuffer(buffer, np.uint8).ctypes.data)
                           for (offset, length), buffer in zip(ranges, buffers)])
        for (offset, length), buffer in zip(ranges, buffers):
            buffer[:] = self.data[offset:offset + length]
        counts = [length for _, length in ranges]
        return counts if self.lie is None else self.lie(counts)


def test_tensors_of_64_kib_or_more_are_fetched_straight_into_their_arrays():
    """Tensors of 64 KiB or more: their bytes fetched into the arrays returned, all in
    the first call with the small ones (staged, coalesced) beside them, every byte
    past the first request's asked once (those it brought are copied from it)."""
    rng = np.random.default_rng(3)
    tensors = {"big": rng.standard_normal((512, 1024), np.float32),         # 2 MiB
               "small": np.arange(100, dtype=np.int16),
               "bigger": rng.integers(0, 9, (3 * MiB,), np.uint8),
               "tail": np.ones(7, np.float64),
               **{f"mid{k}": rng.standard_normal(16384 + k, np.float32) for k in range(8)}}
    data = fastst.save(tensors)
    fetch = RangesInto(data)
    reader = Reader()
    reader.open_ranges("mem", len(data), fetch)
    loaded = reader.copy_tensors()
    assert_same(loaded, tensors)
    (call,) = fetch.calls
    buffers = [(address, address + length) for _, length, address in call]
    direct = [name for name, array in loaded.items() if array.nbytes >= 64 << 10]
    assert len(direct) == 10
    for name in direct:      # its last byte was fetched into the array
        end = loaded[name].ctypes.data + loaded[name].nbytes
        assert any(start < end <= stop for start, stop in buffers), name
    assert sum(length for _, length, _ in call) == len(data) - 65536


@pytest.mark.parametrize("lie, message", [
    (lambda counts: counts[:-1], r"fetch_into must return a list of one byte count per range"),
    (lambda counts: "all", r"got a str"),
    # 'big' is bytes [80, 2097232), those before 65536 brought by the first request
    (lambda counts: [c - 1 for c in counts], r"tensor 'big'.*not 2031696 \(a short read\)"),
    (lambda counts: [c + 1 for c in counts], r"not 2031696 \(too long\)"),
    (lambda counts: [float(c) for c in counts], r"came back 2031696.0 bytes long"),
])
def test_a_fetch_into_that_miscounts_is_an_error(lie, message):
    data = fastst.save({"big": np.zeros(MiB // 2, np.float32)})
    reader = Reader()
    reader.open_ranges("mem", len(data), RangesInto(data, lie))
    with pytest.raises(SafetensorError, match=message):
        reader.get_tensor("big")


def test_a_stalled_s3_store_gives_a_timeout_within_the_deadline(served_alone, monkeypatch):
    """An S3 endpoint that answers HEAD and never a GET: s3fs and botocore retry
    timed-out attempts many times over, and the deadline on the whole call bounds
    them, and ends them: no attempt of the call is made after it gave up."""
    pytest.importorskip("s3fs")
    server, put = served_alone
    put("bucket/stalled.safetensors", fastst.save({"a": np.zeros(3)}))
    server.mode = "stall"
    monkeypatch.setattr(fastst.remote, "CONNECT_TIMEOUT", 0.5)
    monkeypatch.setattr(fastst.remote, "READ_TIMEOUT", 0.5)
    options = {"key": "k", "secret": "s", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": server.url, "region_name": "eu-west-1"}}
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer in time"):
        fastst.safe_open("s3://bucket/stalled.safetensors", storage_options=options)
    assert time.monotonic() - started < 20
    time.sleep(1)     # a GET sent just before the error may reach the server's count after it
    attempts = len(server.gets())
    time.sleep(3)     # a retry came within a second while the call's requests ran on
    assert len(server.gets()) == attempts


def test_a_header_longer_than_the_first_read_takes_a_second_request(served):
    server, put = served
    tensors = {f"name_{k:05d}_" + "x" * 40: np.array([k], np.int32) for k in range(2000)}
    url = put("long-header.safetensors", fastst.save(tensors))
    server.reset_counts()
    with fastst.safe_open(url) as f:
        assert f.data_start > HEAD_BYTES
        assert len(server.gets()) == 2
        assert f.get_tensor("name_01234_" + "x" * 40).tolist() == [1234]
    assert_same(fastst.load_file(url), tensors)


def test_file_urls_save_atomically_and_read_by_ranges(tmp_path):
    tensors = every_dtype(5)
    url = (tmp_path / "local.safetensors").as_uri()
    fastst.save_file(tensors, url)
    assert (tmp_path / "local.safetensors").read_bytes() == fastst.save(tensors)
    assert sorted(os.listdir(tmp_path)) == ["local.safetensors"]   # no temporary left
    with fastst.safe_open(url) as f:
        assert f.backend == "ranges"
        assert_same(f.get_tensors(), tensors)


# ---------------------------------------------------------------------------
# Sharded checkpoints from their index's URL
# ---------------------------------------------------------------------------

INDEX = "model.safetensors.index.json"


def sharded(tmp_path):
    """Six 400-byte tensors in three shards, with metadata in the index."""
    tensors = {f"layer.{k}": np.full(100, k, dtype=np.float32) for k in range(6)}
    fastst.save_file(tensors, tmp_path, {"origin": "test"}, max_shard_size=800)
    return tensors, {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}


def test_a_sharded_checkpoint_opens_from_its_index_url(tmp_path):
    tensors, files = sharded(tmp_path)
    fs = fsspec.filesystem("memory")
    for name, data in files.items():
        fs.pipe(f"memory://sharded/{name}", data)
    url = f"memory://sharded/{INDEX}"
    with fastst.safe_open(url) as f:
        assert f.keys() == sorted(tensors) and f.backend == "ranges"
        assert f.metadata() == {"total_size": 2400, "origin": "test"}
        assert f.get_slice("layer.4")[2:4].tolist() == [4.0, 4.0]
        np.testing.assert_array_equal(f.gather("layer.5", [0, -1]), [5.0, 5.0])
        again = pickle.loads(pickle.dumps(f))
    with again:
        np.testing.assert_array_equal(again["layer.3"], tensors["layer.3"])
    assert_same(fastst.load_file(url), tensors)
    assert_same(fastst.load_file(url, copy=True), tensors)
    torch = pytest.importorskip("torch")
    got = fastst.safe_open(url, framework="pt").get_tensors()
    assert isinstance(got["layer.0"], torch.Tensor) and got["layer.2"].tolist() == [2.0] * 100
    fs.rm("memory://sharded", recursive=True)


def test_opening_a_checkpoint_url_reads_the_index_and_one_tensor_its_shard(served, tmp_path):
    server, put = served
    tensors, files = sharded(tmp_path)
    urls = {name: put(f"ckpt/{name}", data) for name, data in files.items()}
    server.reset_counts()
    with fastst.safe_open(urls[INDEX]) as f:
        assert [path for _, path, _ in server.gets()] == [f"/ckpt/{INDEX}"]
        np.testing.assert_array_equal(f.get_tensor("layer.3"), tensors["layer.3"])
        shards = {path for _, path, _ in server.gets()} - {f"/ckpt/{INDEX}"}
        assert shards == {"/ckpt/model-00002-of-00003.safetensors"}


def test_a_shard_url_changed_after_pickling_is_refused(served, tmp_path):
    server, put = served
    tensors, files = sharded(tmp_path)
    urls = {name: put(f"ckpt/{name}", data) for name, data in files.items()}
    with fastst.safe_open(urls[INDEX]) as f:
        pickled = pickle.dumps(f)
    shard = "model-00003-of-00003.safetensors"
    put(f"ckpt/{shard}", fastst.save({"layer.4": tensors["layer.4"] + 1,
                                      "layer.5": tensors["layer.5"]}))
    with pickle.loads(pickled) as copy:
        np.testing.assert_array_equal(copy["layer.0"], tensors["layer.0"])
        with pytest.raises(SafetensorError, match=f"shard '{shard}' changed since"):
            copy.get_tensor("layer.5")
    put(f"ckpt/{INDEX}", files[INDEX] + b" ")
    with pytest.raises(SafetensorError, match="index changed since the handle was pickled"):
        pickle.loads(pickled)


def test_a_checkpoint_url_with_a_bad_index_is_refused(served):
    server, put = served
    url = put(f"bad/{INDEX}", b'{"weight_map": {"a": "../outside.safetensors"}}')
    with pytest.raises(SafetensorError, match=f"{url}: .*not a .safetensors file name in"):
        fastst.safe_open(url)
    url = put(f"big/{INDEX}", b'{"weight_map": {}}' + b" " * 100)
    with pytest.raises(SafetensorError, match="index of 118 bytes exceeds the limit of 50"):
        fastst.safe_open(url, max_header_size=50)
    url = put(f"missing/{INDEX}", b'{"weight_map": {"a": "gone.safetensors"}}')
    with fastst.safe_open(url) as f, pytest.raises(SafetensorError, match="missing"):
        f.get_tensor("a")


# shard names that a server, decoding the path it is asked for, takes out of the index's
# folder (or to another file than the one named)
ESCAPING_SHARDS = [
    "%2e%2e%2f%2e%2e%2fprivate%2fsecret.safetensors",
    "..%2F..%2Fprivate%2Fsecret.safetensors",
    "%2E%2E%5C%2E%2E%5Cprivate%5Csecret.safetensors",
    "..\\..\\private\\secret.safetensors",
    "%2fprivate%2fsecret.safetensors",
    "secret.safetensors?.safetensors",
    "secret.safetensors#.safetensors",
    "secret%00.safetensors",
    "line\nbreak.safetensors",
]


@pytest.mark.parametrize("shard", ESCAPING_SHARDS)
def test_no_request_for_a_shard_leaves_the_index_folder(served, shard):
    import posixpath
    import urllib.parse

    server, put = served
    put("private/secret.safetensors", fastst.save({"w": np.ones(2, np.float32)}))
    url = put(f"models/m1/{INDEX}", json.dumps({"weight_map": {"w": shard}}).encode())
    server.reset_counts()
    with pytest.raises(SafetensorError, match=f"{url}: tensor 'w': shard .* is not a "
                                              f".safetensors file name in the index's folder"):
        with fastst.safe_open(url) as f:
            f.get_tensor("w")
    for _, path, _ in server.requests:     # as a static server finds the file it serves
        served_path = posixpath.normpath(urllib.parse.unquote(urllib.parse.urlsplit(path).path))
        assert served_path == f"/models/m1/{INDEX}", path


# ---------------------------------------------------------------------------
# The command line on URLs
# ---------------------------------------------------------------------------


def cli_json(capsys, *argv):
    from fastst.cli import main

    status = main(list(argv))
    captured = capsys.readouterr()
    return status, (json.loads(captured.out) if captured.out else None), captured.err


def test_inspect_of_a_url_reads_its_header_only(served, big_object, tmp_path, capsys):
    server, put = served
    url = put("big.safetensors", big_object)
    (tmp_path / "big.safetensors").write_bytes(big_object)
    server.reset_counts()
    status, remote, _ = cli_json(capsys, "inspect", "--json", url)
    assert status == 0
    # the size (HEAD), then the prefix and header, read ahead to HEAD_BYTES: nothing past
    assert {asked for _, _, asked in server.gets()} == {f"bytes=0-{HEAD_BYTES - 1}"}, \
        server.requests
    assert server.bytes_sent <= HEAD_BYTES, server.requests
    _, local, _ = cli_json(capsys, "inspect", "--json", str(tmp_path / "big.safetensors"))
    assert remote == {**local, "file": url}
    assert remote["file_size"] == len(big_object)


def test_inspect_of_a_checkpoint_url_reports_its_shards(served, tmp_path, capsys):
    server, put = served
    _, files = sharded(tmp_path)
    urls = {name: put(f"ckpt/{name}", data) for name, data in files.items()}
    status, remote, _ = cli_json(capsys, "inspect", "--json", urls[INDEX])
    assert status == 0
    _, local, _ = cli_json(capsys, "inspect", "--json", str(tmp_path / INDEX))
    assert remote == {**local, "file": urls[INDEX], "index": urls[INDEX]}
    assert [shard["file_size"] for shard in remote["shards"]] == [
        len(files[shard["file"]]) for shard in remote["shards"]]


def test_inspect_of_a_bad_url_reports_why(served, capsys):
    server, put = served
    missing = f"{server.url}/missing.safetensors"
    text = put("text.safetensors", b"hello, this is not a safetensors file")
    status, reports, _ = cli_json(capsys, "inspect", "--json", missing, text)
    assert status == 1
    assert [report["file"] for report in reports] == [missing, text]
    assert all("error" in report for report in reports)
    assert reports[1]["error"] == "not a safetensors file: it is text"


def test_verify_checks_a_url_tensor_by_tensor(served, capsys):
    server, put = served
    tensors = {"a": np.arange(1000, dtype=np.float32), "b": np.ones(10, dtype=np.int64)}
    good = fastst.save(tensors, checksum="xxh3_64")
    url = put("checked.safetensors", good)
    status, reports, _ = cli_json(capsys, "verify", "--json", url)
    assert status == 0 and reports[0]["ok"] and reports[0]["files"][0]["checked"] == 2
    corrupt = bytearray(good)
    corrupt[-1] ^= 0xFF                               # the last byte: of the last tensor
    url = put("corrupt.safetensors", corrupt)
    status, reports, _ = cli_json(capsys, "verify", "--json", url)
    assert status == 1
    with fastst.safe_open(io.BytesIO(good)) as f:
        last = f.offset_keys()[-1]
    assert [error["tensor"] for error in reports[0]["files"][0]["errors"]] == [last]


def test_verify_checks_a_checkpoint_by_its_index_url(served, tmp_path, capsys):
    server, put = served
    tensors = {f"layer.{k}": np.full(100, k, dtype=np.float32) for k in range(6)}
    fastst.save_file(tensors, tmp_path, max_shard_size=800, checksum="xxh3_64")
    urls = {name: put(f"ckpt/{name}", (tmp_path / name).read_bytes())
            for name in os.listdir(tmp_path)}
    status, reports, _ = cli_json(capsys, "verify", "--json", urls[INDEX])
    assert status == 0 and reports[0]["errors"] == []
    assert [file["file"] for file in reports[0]["files"]] == sorted(
        url for name, url in urls.items() if name != INDEX)
    assert [file["checked"] for file in reports[0]["files"]] == [2, 2, 2]
