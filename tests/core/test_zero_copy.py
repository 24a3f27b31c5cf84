"""Arrays are views of the file's private mapping or of the caller's buffer."""
import gc
import os

import numpy as np
import pytest

import fastst
from pages import resident_bytes


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "zc.safetensors"
    fastst.save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                      "b": np.arange(4, dtype=np.int64)}, path)
    return path


def mapped(path) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(os.fspath(path)) for line in maps)


def test_get_tensor_is_a_view_of_one_mapping(checkpoint):
    with fastst.safe_open(checkpoint) as f:
        first, second, bias = f.get_tensor("w"), f.get_tensor("w"), f.get_tensor("b")
    assert np.shares_memory(first, second)
    assert not first.flags.owndata and not bias.flags.owndata
    assert first.base is second.base is bias.base


def test_views_are_writable_but_writes_never_reach_the_file(checkpoint):
    before = checkpoint.read_bytes()
    with fastst.safe_open(checkpoint) as f:
        w = f.get_tensor("w")
        w[:] = -1.0
        assert (f.get_tensor("w") == -1.0).all()
    assert checkpoint.read_bytes() == before
    assert fastst.load_file(checkpoint)["w"][2, 3] == 11.0


def test_arrays_outlive_the_handle(checkpoint):
    f = fastst.safe_open(checkpoint)
    w = f.get_tensor("w")
    f.close()
    del f
    gc.collect()
    assert w.sum() == 66.0
    with pytest.raises(fastst.SafetensorError, match="closed"):
        closed = fastst.safe_open(checkpoint)
        closed.close()
        closed.get_tensor("w")


def test_mapping_lives_exactly_as_long_as_its_arrays(checkpoint):
    tensors = fastst.load_file(checkpoint)
    assert mapped(checkpoint)
    w = tensors["w"][1:]
    del tensors
    gc.collect()
    assert mapped(checkpoint) and w[0, 0] == 4.0
    del w
    gc.collect()
    assert not mapped(checkpoint)


def test_load_views_the_callers_buffer():
    data = fastst.save({"x": np.arange(8, dtype=np.uint16)})
    x = fastst.load(data)["x"]
    assert np.shares_memory(x, np.frombuffer(data, dtype=np.uint8))
    assert not x.flags.writeable, "bytes are immutable, so are views of them"

    buffer = bytearray(data)
    y = fastst.load(buffer)["x"]
    assert y.flags.writeable
    y[0] = 77
    assert fastst.load(bytes(buffer))["x"][0] == 77

    view = fastst.load(memoryview(data))["x"]
    assert np.shares_memory(view, np.frombuffer(data, dtype=np.uint8))


def test_load_keeps_the_buffer_alive():
    x = fastst.load(bytearray(fastst.save({"x": np.arange(5, dtype=np.int8)})))["x"]
    gc.collect()
    assert x.tolist() == [0, 1, 2, 3, 4]


def test_load_rejects_non_buffers():
    with pytest.raises(TypeError, match="bytes-like"):
        fastst.load("not bytes")


def thread_io() -> tuple:
    """This thread's I/O counters (rchar: bytes read by read-like calls, syscr: read
    calls), and the bytes and calls that reading them added to those counters."""
    fd = os.open("/proc/thread-self/io", os.O_RDONLY)
    try:
        text = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    counters = {key: int(value) for key, value in
                (line.split(": ") for line in text.decode().splitlines())}
    return counters, {"rchar": len(text), "syscr": 1}


def open_and_get_work(path) -> tuple:
    """(bytes read, read calls, KiB of the map resident) to open `path` and get its
    tensor "big", and the data start and tensor size."""
    before, own = thread_io()
    with fastst.safe_open(path) as f:
        big = f.get_tensor("big")
        after, _ = thread_io()
        work = tuple(after[key] - before[key] - own[key] for key in ("rchar", "syscr"))
        work += (resident_bytes(path) >> 10,)
        assert big.base is not None and not big.flags.owndata
        return work, f.data_start, big.nbytes


def test_get_tensor_is_constant_time_in_the_tensor_size(tmp_path):
    # The work of open + get_tensor, counted: bytes read, read calls and pages of the
    # map brought in. A 64x larger tensor costs exactly as much: only the header is read.
    small, large = tmp_path / "small.safetensors", tmp_path / "large.safetensors"
    fastst.save_file({"big": np.ones(1 << 20, dtype=np.uint8)}, small)
    fastst.save_file({"big": np.ones(64 << 20, dtype=np.uint8)}, large)
    open_and_get_work(small)     # a first get_tensor imports the dtype tables' modules
    (small_read, small_calls, small_kib), small_start, small_size = open_and_get_work(small)
    (large_read, large_calls, large_kib), large_start, large_size = open_and_get_work(large)
    assert large_size == 64 * small_size
    assert (small_read, large_read) == (small_start, large_start)   # prefix + header
    assert large_calls == small_calls
    assert large_kib == small_kib <= 4


def test_pread_backend_gives_private_arrays(checkpoint):
    with fastst.safe_open(checkpoint, backend="pread") as f:
        w = f.get_tensor("w")
    assert w.flags.owndata and w.flags.writeable
    assert w.tolist() == fastst.load_file(checkpoint)["w"].tolist()


def test_the_mapping_exports_the_whole_file_as_a_buffer(checkpoint):
    w = fastst.load_file(checkpoint)["w"]
    whole = memoryview(w.base)
    assert whole.nbytes == os.path.getsize(checkpoint) and not whole.readonly
    assert bytes(whole) == checkpoint.read_bytes()
    assert np.shares_memory(np.frombuffer(whole, np.uint8), w)
