"""The reader of a URL: a queue of parts whose size and number in flight adapt to what
the store gives (fastst.remote.Pace), counted from the server's side."""
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastst
from fastst import SafetensorError
from fastst._io.ranged import Pace, PartQueue, spans_of

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
import fastst.remote  # noqa: E402
from servers import (RangeServer, http_store, range_server_process,  # noqa: E402,F401
                     s3_store)

MiB = 1 << 20
# The server counts a GET in flight until its last piece is about to be sent, so a
# client with the last byte in hand is never counted twice; an answer without a body
# ends when its thread does, which on a busy machine can be after the client went on.
IN_FLIGHT_SLACK = 1


@pytest.fixture
def store(http_store):
    http_store.be_honest()
    http_store.objects.clear()
    yield http_store
    http_store.be_honest()


def put(server, name, data):
    server.objects["/" + name] = bytes(data)
    return f"{server.url}/{name}"


def range_of(asked):
    """The (start, end) of a Range header's bytes."""
    first, last = asked.split("=")[1].split("-")
    return int(first), int(last) + 1


def parts_asked(server):
    """The (start, end) of each range the server's GETs asked for."""
    return [range_of(asked) for _, _, asked in server.gets()]


def test_requests_in_flight_grow_on_a_store_whose_connections_are_capped():
    tensors = {f"t{k}": np.full(MiB // 4, k, np.float32) for k in range(48)}   # 48 MiB
    # 8 MB/s a connection, 30 ms to the first byte
    with range_server_process({"/capped.safetensors": fastst.save(tensors)},
                              rate=8e6, delay=0.03) as (url, counts):
        # parts of 1 MiB: enough of them to keep 16 requests and more busy
        loaded = fastst.load_file(url + "/capped.safetensors",
                                  storage_options={"part_size": MiB})
        assert all((loaded[name] == array).all() for name, array in tensors.items())
        assert counts()["most_in_flight"] >= 4 * fastst.remote.START_REQUESTS


def test_requests_in_flight_stay_few_on_a_fast_store():
    tensors = {f"t{k}": np.full(MiB // 4, k, np.float32) for k in range(128)}   # 128 MiB
    with range_server_process({"/fast.safetensors": fastst.save(tensors)}) as (url, counts):
        loaded = fastst.load_file(url + "/fast.safetensors")
        assert all((loaded[name] == array).all() for name, array in tensors.items())
        seen = counts()
    # one more level than needed may look faster by chance; no more than that
    assert seen["most_in_flight"] <= 2 * fastst.remote.START_REQUESTS + IN_FLIGHT_SLACK
    assert all(end - start <= fastst.remote.PART_SIZE
               for start, end in map(range_of, seen["gets"]))


def test_the_bounds_given_in_storage_options_hold(store):
    tensors = {"big": np.arange(6 * MiB, dtype=np.float32)}   # 24 MiB
    data = fastst.save(tensors)
    url = put(store, "bounded.safetensors", data)
    store.rate, store.delay = 8e6, 0.03
    store.reset_counts()
    loaded = fastst.load_file(url, storage_options={"max_concurrency": 3,
                                                    "part_size": 512 << 10})
    assert (loaded["big"] == tensors["big"]).all()
    assert store.most_in_flight <= 3 + IN_FLIGHT_SLACK
    parts = sorted(parts_asked(store))
    assert all(end - start <= 512 << 10 for start, end in parts)
    assert parts[0][0] == 0 and parts[-1][1] == len(data)


def test_a_file_of_many_tensors_is_asked_once_for_each_byte_and_staged_nowhere(store):
    """512 tensors of 64 KiB: read straight into their arrays, in requests that join
    neighbours (4 MiB at least, but for the last), each byte asked for once (those the
    first request brought are not asked again), no staging buffer beside the arrays."""
    tensors = {f"t{k:03d}": np.full(16384, k, np.float32) for k in range(512)}   # 32 MiB
    data = fastst.save(tensors)
    url = put(store, "many.safetensors", data)
    store.reset_counts()
    tracemalloc.start()
    try:
        loaded = fastst.load_file(url)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert all((loaded[name] == array).all() for name, array in tensors.items())
    parts = sorted(parts_asked(store))
    assert parts[0][0] == 0 and parts[-1][1] == len(data)
    assert all(end == start for (_, end), (start, _) in zip(parts, parts[1:]))
    assert store.bytes_sent == len(data)
    assert len(parts) <= 2 + len(data) // (4 * MiB)
    assert peak < 32 * MiB + 4 * MiB     # the arrays, and little else


def test_the_next_file_on_a_store_starts_at_the_pace_the_last_one_reached(store):
    """The requests in flight that the read of one file grew to on a store (capped
    connections) are where the next file's read on it starts (a checkpoint's next
    shard), not START_REQUESTS again: its 16 parts are asked for at once."""
    options = {"part_size": MiB}
    first = put(store, "first.safetensors", fastst.save({"a": np.zeros(8 * MiB, np.float32)}))
    second = put(store, "second.safetensors", fastst.save({"b": np.ones(4 * MiB, np.float32)}))
    store.rate, store.delay = 8e6, 0.03
    fastst.load_file(first, storage_options=options)
    assert store.most_in_flight > fastst.remote.START_REQUESTS     # the pace grew
    store.rate, store.delay = None, 0.5     # each answer waits: what is asked at once shows
    store.reset_counts()
    loaded = fastst.load_file(second, storage_options=options)
    assert (loaded["b"] == 1).all()
    assert store.most_in_flight >= 16 - IN_FLIGHT_SLACK


@pytest.mark.parametrize("options, message", [
    ({"max_concurrency": 0}, r"storage_options\['max_concurrency'\] must be an integer >= 1"),
    ({"part_size": "8M"}, r"storage_options\['part_size'\] must be an integer >= 1, got '8M'"),
])
def test_bounds_that_are_not_counts_are_refused(store, options, message):
    url = put(store, "x.safetensors", fastst.save({"x": np.zeros(3)}))
    with pytest.raises(SafetensorError, match=message):
        fastst.load_file(url, storage_options=options)


# small tensors are coalesced and staged; those of 64 KiB or more are fetched into place
LAYOUTS = st.lists(st.tuples(st.sampled_from(["u1", "<f4", "<i8"]),
                             st.one_of(st.integers(0, 96 << 10),
                                       st.integers(MiB, 3 * MiB // 2))),
                   min_size=1, max_size=10)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(layout=LAYOUTS, part_size=st.sampled_from([1, 4096, 65536, 100_000, MiB]),
       most=st.integers(1, 8), wanted=st.data())
def test_every_plan_on_a_paced_store_brings_exactly_the_bytes(store, layout, part_size,
                                                               most, wanted):
    rng = np.random.default_rng(len(layout))
    tensors = {f"t{k}": rng.integers(0, 256, size=nbytes, dtype=np.uint8).view(dtype)
               for k, (dtype, nbytes) in enumerate(
                   (dtype, nbytes - nbytes % np.dtype(dtype).itemsize)
                   for dtype, nbytes in layout)}
    data = fastst.save(tensors)
    url = put(store, "plan.safetensors", data)
    store.rate, store.delay = 50e6, 0.002
    options = {"max_concurrency": most, "part_size": max(part_size, 1024)}
    store.reset_counts()
    loaded = fastst.load_file(url, storage_options=options)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype and loaded[name].tobytes() == array.tobytes()
    assert store.most_in_flight <= most + IN_FLIGHT_SLACK
    assert all(end - start <= options["part_size"] for start, end in parts_asked(store))
    names = wanted.draw(st.lists(st.sampled_from(sorted(tensors)), unique=True))
    with fastst.safe_open(url, storage_options=options) as f:
        for name in names:
            array = tensors[name]
            stop = wanted.draw(st.integers(0, len(array)))
            assert f.get_slice(name)[stop // 2:stop].tobytes() == array[stop // 2:stop].tobytes()


def test_the_parts_of_100_000_spans_are_handed_out_in_memory_that_does_not_grow_with_them():
    spans = spans_of([(10 * k, 1 + k % 3) for k in range(100_000)])
    tracemalloc.start()
    try:
        parts = PartQueue(spans, Pace(4, 32, MiB))
        handed = 0
        while (part := parts.next()) is not None:
            assert part == (handed, 10 * handed, 1 + handed % 3)
            handed += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert handed == 100_000 and not parts
    assert peak < 64 << 10


def test_a_part_cut_short_in_the_middle_of_a_read_names_the_tensor(store):
    tensors = {f"t{k}": np.full(MiB // 4, k, np.float32) for k in range(8)}
    url = put(store, "cut.safetensors", fastst.save(tensors))
    with fastst.safe_open(url, storage_options={"part_size": 1 << 20}) as f:
        store.honest_gets, store.mode = 3, "short"    # the fourth part, and those after
        with pytest.raises(SafetensorError, match=r"tensor 't\d'.*short read|cut short"):
            f.get_tensors()


def test_a_spooled_upload_to_s3_goes_in_parallel_parts_and_is_byte_identical(s3_store, tmp_path):
    url = "s3://fastst/spooled-parts.safetensors"
    tensors = {"a": np.arange(6 * MiB, dtype=np.float32), "b": np.arange(10, dtype=np.int16)}
    options = {**s3_store, "part_size": 5 * MiB, "max_concurrency": 4}
    with fastst.StreamWriter(url, {"a": ("F32", (6 * MiB,)), "b": ("I16", (10,))},
                             storage_options=options) as writer:
        writer.write("b", tensors["b"])
        writer.write("a", tensors["a"])
    fastst.save_file(tensors, tmp_path / "disk.safetensors")
    fs = fsspec.filesystem("s3", **s3_store)
    assert fs.cat(url) == (tmp_path / "disk.safetensors").read_bytes()
    assert fs.info(url)["ETag"].strip('"').endswith("-5")     # 24 MiB in 5 MiB parts


def test_a_spooled_upload_whose_part_fails_leaves_the_previous_object(s3_store, monkeypatch):
    url = "s3://fastst/spooled-kept.safetensors"
    old = {"a": np.arange(4.0)}
    fastst.save_file(old, url, storage_options=s3_store)
    import s3fs
    call = s3fs.S3FileSystem._call_s3
    parts = []

    async def failing_call(self, method, *args, **kwargs):
        if method == "upload_part":
            parts.append(kwargs.get("PartNumber"))
            if len(parts) == 3:
                raise OSError("connection lost")
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", failing_call)
    options = {**s3_store, "part_size": 5 * MiB}
    with pytest.raises(OSError, match="connection lost"):
        with fastst.StreamWriter(url, {"a": ("F32", (6 * MiB,))},
                                 storage_options=options) as writer:
            writer.write("a", np.ones(6 * MiB, np.float32))
    monkeypatch.undo()
    assert len(parts) >= 3
    loaded = fastst.load_file(url, storage_options=s3_store)
    assert (loaded["a"] == old["a"]).all()
