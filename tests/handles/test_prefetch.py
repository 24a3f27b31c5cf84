"""The reference's next API (safetensors 0.9): get_tensor_meta, the header's word on a
tensor without its bytes, and prefetch(plan), a loader of the tensors (or rows) a plan
names that reads them ahead within a budget of bytes, hands each out once, and stops
its threads when done, closed or dropped; on every kind of handle, for NumPy, torch
and JAX."""
import gc
import io
import json
import os
import re
import struct
import threading
import time
import weakref

import numpy as np
import pytest

import fastst
from fastst._handles import prefetch as _prefetch
from helpers import run_bounded, wait_until
from servers import RangeServer, http_store, served  # noqa: F401  (fixtures)

KIB = 1 << 10


def header_of(data):
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return header


def meta_in(header, name):
    entry = header[name]
    return fastst.TensorMeta(entry["dtype"], entry["shape"], tuple(entry["data_offsets"]))


def plain_tensors():
    """Tensors every framework takes as they are (JAX has no 64-bit integers by default)."""
    return {"fp32_2d": np.arange(12, dtype=np.float32).reshape(3, 4),
            "fp16_3d": np.arange(24, dtype=np.float16).reshape(2, 3, 4),
            "scalar": np.array(7.5, np.float32),
            "empty_2d": np.empty((0, 5), np.float16),
            "i32_1d": np.arange(5, dtype=np.int32)}


class CountingFile(io.BytesIO):
    """A file object that counts the bytes read from it."""

    def __init__(self, data):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        got = super().read(size)
        self.bytes_read += len(got)
        return got

    def readinto(self, buffer):
        got = super().readinto(buffer)
        self.bytes_read += got
        return got


def opened_every_way(tmp_path, data, url):
    """(what, handle) of the file `data` opened every way a handle reads one."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    buffer = fastst.NumpyHandle()
    buffer.open_buffer(data)
    yield "mmap", fastst.safe_open(path)
    yield "pread", fastst.safe_open(path, backend="pread")
    yield "torch", fastst.safe_open(path, framework="pt")
    yield "jax", fastst.safe_open(path, framework="jax")
    yield "url", fastst.safe_open(url)
    yield "file object", fastst.safe_open(io.BytesIO(data))
    yield "buffer", buffer


@pytest.mark.needs("torch", "jax")
def test_get_tensor_meta_matches_the_header_for_every_kind_of_handle(tmp_path, served):
    server, put = served
    data = fastst.save(plain_tensors(), {"foo": "bar"})
    url = put("x.safetensors", data)
    for what, handle in opened_every_way(tmp_path, data, url):
        with handle as f:
            for name in header_of(data):
                meta = f.get_tensor_meta(name)
                assert type(meta) is fastst.TensorMeta, what
                assert meta == meta_in(header_of(data), name), (what, name)
            with pytest.raises(fastst.TensorNotFoundError):
                f.get_tensor_meta("nope")


def test_get_tensor_meta_of_a_checkpoint_is_its_shards(tmp_path):
    tensors = {f"w{k}": np.full((10, 10), k, np.float32) for k in range(3)}
    fastst.save_file(tensors, tmp_path, max_shard_size=800)
    with fastst.safe_open(tmp_path) as f:
        for name in tensors:
            shard = (tmp_path / f.shard_file(name)).read_bytes()
            assert f.get_tensor_meta(name) == meta_in(header_of(shard), name)
        with pytest.raises(fastst.TensorNotFoundError, match="no tensor named 'nope'"):
            f.get_tensor_meta("nope")


def test_get_tensor_meta_is_frozen():
    meta = fastst.TensorMeta("F32", [3, 4], (0, 48))
    for field, value in (("dtype", "F16"), ("shape", [4]), ("data_offsets", (0, 1))):
        with pytest.raises(AttributeError):
            setattr(meta, field, value)


def test_get_tensor_meta_reads_no_tensor_bytes(served):
    server, put = served
    data = fastst.save({"big": np.zeros(1 << 20, np.uint8), "small": np.ones(3)})
    url = put("meta.safetensors", data)
    with fastst.safe_open(url) as f:
        server.reset_counts()
        assert f.get_tensor_meta("big").shape == [1 << 20]
        assert server.requests == [] and server.bytes_sent == 0
    file = CountingFile(data)
    with fastst.safe_open(file) as f:
        opened = file.bytes_read
        assert f.get_tensor_meta("big").data_offsets == (24, 24 + (1 << 20))
        assert file.bytes_read == opened < 1 << 20


def test_get_tensor_meta_of_a_closed_handle_is_a_clear_error(tmp_path):
    fastst.save_file({"x": np.zeros(2)}, tmp_path / "x.safetensors")
    f = fastst.safe_open(tmp_path / "x.safetensors", framework="np")
    f.close()
    with pytest.raises(fastst.SafetensorError, match="file is closed"):
        f.get_tensor_meta("x")


# --- prefetch(plan): what it hands out ------------------------------------------------------

def loader_threads():
    return [thread for thread in threading.enumerate() if thread.name == "fastst-prefetch"]


@pytest.fixture
def no_thread_left():
    yield
    gc.collect()
    assert wait_until(lambda: not loader_threads()), "a prefetch thread is still running"


FRAMEWORKS = ["np", pytest.param("pt", marks=pytest.mark.needs("torch")),
              pytest.param("jax", marks=pytest.mark.needs("jax"))]


def as_numpy(tensor):
    return tensor.numpy() if type(tensor).__module__.startswith("torch") else np.asarray(tensor)


def assert_same(got, expected):
    got = as_numpy(got)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    assert got.tobytes() == expected.tobytes()


PLAN = {"fp32_2d": slice(1, 3), "i32_1d": slice(-3, None), "fp16_3d": None,
        "empty_2d": slice(0, 0)}


def planned(tensors, plan):
    return {name: tensors[name] if rows is None else tensors[name][rows]
            for name, rows in plan.items()}


@pytest.fixture
def saved(tmp_path):
    tensors = plain_tensors()
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path)
    return path, tensors


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_plan_hands_out_the_rows_and_tensors_it_names(saved, framework, backend):
    path, tensors = saved
    with fastst.safe_open(path, framework, backend=backend) as f, f.prefetch(PLAN) as loader:
        assert loader.names() == [name for name in f.offset_keys() if name in PLAN]
        assert len(loader) == 4
        got = {"fp32_2d": loader.take("fp32_2d")}
        got.update(loader)
    assert sorted(got) == sorted(PLAN)
    for name, expected in planned(tensors, PLAN).items():
        assert_same(got[name], expected)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_no_plan_is_every_tensor_whole(saved, framework):
    path, tensors = saved
    with fastst.safe_open(path, framework) as f, f.prefetch() as loader:
        assert loader.names() == f.offset_keys()
        got = dict(loader)
    for name, expected in tensors.items():
        assert_same(got[name], expected)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_tensors_left_out_of_the_plan_are_not_read(tmp_path, backend):
    from fastst._core import read_counters
    tensors = {f"t{k}": np.full((16, 64), k, np.float32) for k in range(8)}    # 4 KiB each
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path)
    plan = {"t1": None, "t4": slice(2, 10), "t6": slice(15, 16)}
    with fastst.safe_open(path, backend=backend) as f:
        before = read_counters()["bytes"]
        with f.prefetch(plan) as loader:
            got = dict(loader)
        assert read_counters()["bytes"] - before == (16 + 8 + 1) * 256
    for name, expected in planned(tensors, plan).items():
        assert_same(got[name], expected)


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_checkpoint_is_prefetched_shard_by_shard_within_one_budget(tmp_path, framework):
    tensors = {f"w{k}": np.full((10, 10), k, np.float32) for k in range(6)}   # 400 bytes
    fastst.save_file(tensors, tmp_path, max_shard_size=800)                  # 3 shards
    plan = {"w5": slice(2, 4), "w0": None, "w3": None, "w2": slice(0, 10)}
    with fastst.safe_open(tmp_path, framework) as f:
        with f.prefetch(plan, max_bytes_in_flight=400) as loader:
            assert loader.names() == ["w0", "w2", "w3", "w5"]
            assert_same(loader.take("w5"), tensors["w5"][2:4])
            got = dict(loader)
            assert loader.peak_bytes == 400
        with pytest.raises(fastst.TensorNotFoundError, match="no tensor named 'nope'"):
            f.prefetch({"w0": None, "nope": None})
    assert sorted(got) == ["w0", "w2", "w3"]
    for name in got:
        assert_same(got[name], tensors[name])


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("framework", ["np", pytest.param("pt", marks=pytest.mark.needs("torch"))])
def test_a_url_is_asked_only_for_the_bytes_the_plan_reaches(served, framework):
    server, put = served
    tensors = {f"t{k}": np.full((64, 256), k, np.uint8) for k in range(8)}    # 16 KiB each
    data = fastst.save(tensors)
    url = put("plan.safetensors", data)
    plan = {"t1": None, "t4": slice(8, 40), "t7": slice(63, 64)}
    start, header = 8 + struct.unpack("<Q", data[:8])[0], header_of(data)
    spans = []      # the bytes of each tensor's rows of the plan, in the file
    for name, rows in plan.items():
        begin, end = (start + offset for offset in header[name]["data_offsets"])
        spans.append((begin, end) if rows is None else
                     (begin + rows.start * 256, begin + rows.stop * 256))
    with fastst.safe_open(url, framework) as f:
        server.reset_counts()
        with f.prefetch(plan, max_bytes_in_flight=16 << 10) as loader:
            got = dict(loader)
    asked = [tuple(int(end) for end in re.match(r"bytes=(\d+)-(\d+)", rng).groups())
             for _, _, rng in server.gets()]
    assert asked and all(any(begin <= first and last < end for begin, end in spans)
                         for first, last in asked)
    assert server.bytes_sent <= sum(end - begin for begin, end in spans)
    for name, expected in planned(tensors, plan).items():
        assert_same(got[name], expected)


@pytest.mark.usefixtures("no_thread_left")
def test_file_objects_and_buffers_are_prefetched_too():
    tensors = plain_tensors()
    data = fastst.save(tensors)
    buffer = fastst.NumpyHandle()
    buffer.open_buffer(data)
    for handle in (fastst.safe_open(io.BytesIO(data)), buffer):
        with handle as f, f.prefetch(PLAN, threads=2) as loader:
            got = dict(loader)
        for name, expected in planned(tensors, PLAN).items():
            assert_same(got[name], expected)


@pytest.mark.usefixtures("no_thread_left")
def test_rows_of_packed_dtypes_are_whole_bytes(tmp_path):
    from helpers import raw_file
    raw = bytes(range(16))
    header = {"f4": {"dtype": "F4", "shape": [4, 8], "data_offsets": [0, 16]},
              "f6": {"dtype": "F6_E2M3", "shape": [4, 4], "data_offsets": [16, 28]},
              "odd": {"dtype": "F4", "shape": [4, 3], "data_offsets": [28, 34]}}
    path = tmp_path / "packed.safetensors"
    path.write_bytes(raw_file(header, raw + raw[:12] + raw[:6]))
    with fastst.safe_open(path) as f:
        with f.prefetch({"f4": slice(1, 3), "f6": slice(1, 3)}) as loader:
            f4, f6 = loader.take("f4"), loader.take("f6")
        with pytest.raises(fastst.SafetensorError, match="a row of F4 \\[4, 3\\] is 12 bits, "
                                                         "not whole bytes"):
            f.prefetch({"odd": slice(0, 2)})
        with f.prefetch({"odd": None}) as loader:
            assert loader.take("odd").tobytes() == raw[:6]
    assert (f4.shape, f4.tobytes()) == ((2, 4), raw[4:12])        # 4 bytes a row
    assert (f6.shape, f6.tobytes()) == ((2, 3), raw[3:9])         # 3 bytes a row
    torch = pytest.importorskip("torch")
    if hasattr(torch, "float4_e2m1fn_x2"):
        with fastst.safe_open(path, "pt") as f, f.prefetch({"f4": slice(1, 3)}) as loader:
            x = loader.take("f4")
        assert x.dtype == torch.float4_e2m1fn_x2 and tuple(x.shape) == (2, 4)
        assert x.view(torch.uint8).flatten().tolist() == list(raw[4:12])


# --- prefetch(plan): the rules of a plan ----------------------------------------------------

E = fastst.SafetensorError
PLAN_ERRORS = [
    ({}, E, "invalid prefetch plan: ", "the plan selects no tensors"),
    ({"fp32_2d": slice(0, 10)}, fastst.SafetensorIndexError, "invalid prefetch plan slice: ",
     "slice(0, 10) is out of range of its 3 rows (a plan is not clamped)"),
    ({"fp32_2d": slice(-4, None)}, fastst.SafetensorIndexError, "invalid prefetch plan slice: ",
     "out of range"),
    ({"fp32_2d": slice(2, 1)}, fastst.SafetensorIndexError, "invalid prefetch plan slice: ",
     "out of range"),
    ({"fp32_2d": slice(0, 3, 2)}, E, "invalid prefetch plan slice: ", "step 1"),
    ({"fp32_2d": slice(0, 3, 0)}, E, "invalid prefetch plan slice: ", "step 0"),
    ({"fp32_2d": slice(None, None, -1)}, E, "invalid prefetch plan slice: ", "step -1"),
    ({"fp32_2d": slice(0, 10 ** 100)}, fastst.SafetensorIndexError,
     "invalid prefetch plan slice: ", "slice(0, 1000000000000000000000000000000000000...)"),
    ({"scalar": slice(0, 1)}, E, "invalid prefetch plan slice: ", "'scalar' is 0-d"),
    ({"fp32_2d": 3}, fastst.SafetensorTypeError, "invalid prefetch plan: ", "None or a slice"),
    ({"fp32_2d": slice(0.5, 2)}, fastst.SafetensorTypeError, "invalid prefetch plan slice: ",
     "integers"),
    ({1: None}, fastst.SafetensorTypeError, "invalid prefetch plan: ", "names are str"),
    (["fp32_2d"], fastst.SafetensorTypeError, "invalid prefetch plan: ", "will_need(names)"),
    ("fp32_2d", fastst.SafetensorTypeError, "invalid prefetch plan: ", "a dict"),
    ({"fp32_2d": None, "nope": None}, fastst.TensorNotFoundError, "", "no tensor named 'nope'"),
]


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("plan, kind, start, words", PLAN_ERRORS,
                         ids=[words for _, _, _, words in PLAN_ERRORS])
def test_a_plan_that_breaks_a_rule_is_refused_before_anything_is_read(saved, plan, kind, start,
                                                                      words):
    from fastst._core import read_counters
    path, _ = saved
    before = read_counters()["bytes"]
    with fastst.safe_open(path, backend="pread") as f:
        with pytest.raises(kind) as error:
            f.prefetch(plan)
    message = str(error.value)
    assert message.startswith(start) and words in message and str(path) in message
    assert read_counters()["bytes"] == before and not loader_threads()


@pytest.mark.parametrize("options, words", [
    (dict(threads=0), "threads must be an integer from 1 to 64, got 0"),
    (dict(threads=65), "threads must be an integer from 1 to 64, got 65"),
    (dict(threads=2.0), "threads must be an integer"),
    (dict(max_bytes_in_flight=0), "max_bytes_in_flight must be a positive integer, got 0"),
    (dict(max_bytes_in_flight=True), "max_bytes_in_flight must be"),
    (dict(device="cuda"), "NumPy arrays live on the CPU"),
])
def test_options_out_of_range_are_refused(saved, options, words, no_thread_left):
    path, _ = saved
    with fastst.safe_open(path) as f, pytest.raises(fastst.SafetensorError) as error:
        f.prefetch(**options)
    assert words in str(error.value)


def test_a_plan_of_a_closed_handle_is_a_clear_error(saved):
    path, _ = saved
    f = fastst.safe_open(path)
    f.close()
    with pytest.raises(fastst.SafetensorError, match="file is closed"):
        f.prefetch()


# --- prefetch(plan): each tensor once ---------------------------------------------------------

@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_each_tensor_goes_out_once_by_take_or_by_iteration(saved, framework):
    path, tensors = saved
    with fastst.safe_open(path, framework) as f, f.prefetch(PLAN) as loader:
        assert_same(loader.take("i32_1d"), tensors["i32_1d"][-3:])
        with pytest.raises(fastst.SafetensorError) as error:
            loader.take("i32_1d")
        assert str(error.value).startswith("tensor already delivered")
        iterated = [name for name, _ in loader]
        assert sorted(iterated) == sorted(set(PLAN) - {"i32_1d"})
        for name in PLAN:
            with pytest.raises(fastst.SafetensorError, match="^tensor already delivered"):
                loader.take(name)
        for name in ("scalar", "nope"):     # in the file but not the plan, and in neither
            with pytest.raises(fastst.SafetensorError) as error:
                loader.take(name)
            assert str(error.value).startswith(f"tensor {name} is not in the prefetch plan")
        with pytest.raises(fastst.SafetensorError) as error:
            loader.take("x" * 10 ** 6)
        assert len(str(error.value)) < 200
        assert list(loader) == []


@pytest.mark.usefixtures("no_thread_left")
def test_takes_in_any_order_get_their_own_tensors(tmp_path):
    tensors = {f"t{k:02d}": np.full(1000, k, np.int32) for k in range(30)}
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path)
    order = list(np.random.default_rng(0).permutation(sorted(tensors)))
    with fastst.safe_open(path) as f, f.prefetch(max_bytes_in_flight=12000) as loader:
        for name in order:
            assert_same(loader.take(name), tensors[name])
        assert list(loader) == []


# --- prefetch(plan): the budget, counted ----------------------------------------------------

class Allocations:
    """The bytes of the arrays the loader made that are still alive."""

    def __init__(self, monkeypatch):
        self.alive = 0
        self.lock = threading.Lock()
        real = _prefetch._Tensor.allocate

        def counted(tensor):
            real(tensor)
            with self.lock:
                self.alive += tensor.array.nbytes
            weakref.finalize(tensor.array, self.freed, tensor.array.nbytes)

        monkeypatch.setattr(_prefetch._Tensor, "allocate", counted)

    def freed(self, nbytes):
        with self.lock:
            self.alive -= nbytes


@pytest.mark.usefixtures("no_thread_left")
@pytest.mark.parametrize("sizes, budget, how", [
    ([10 * KIB] * 60, 64 * KIB, "iterate"),                  # 10 times the budget
    ([1 * KIB] * 300, 16 * KIB, "iterate"),                  # small tensors in plans of several
    ([200 * KIB] * 6 + [5 * KIB] * 20, 512 * KIB, "iterate"),  # in pieces of 64 KiB
    ([5 * KIB, 300 * KIB, 5 * KIB, 150 * KIB] * 4, 100 * KIB, "iterate"),  # some over budget
    ([10 * KIB] * 60, 64 * KIB, "take backwards"),           # the caller reads what it takes
    ([10 * KIB] * 60, 64 * KIB, "take rows"),
])
def test_the_loader_never_holds_more_than_its_budget(tmp_path, monkeypatch, sizes, budget, how,
                                                    restore_read_options):
    rng = np.random.default_rng(len(sizes))
    tensors = {f"t{k:03d}": rng.integers(0, 255, (size // 64, 64), np.uint8)
               for k, size in enumerate(sizes)}
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path)
    plan = ({name: slice(1, array.shape[0] - 1) for name, array in tensors.items()}
            if how == "take rows" else None)
    expected = planned(tensors, plan or dict.fromkeys(tensors))
    fastst.read_options(request_bytes=64 * KIB)
    allocations = Allocations(monkeypatch)
    with fastst.safe_open(path, backend="pread") as f, \
            f.prefetch(plan, max_bytes_in_flight=budget, threads=3) as loader:
        order = loader.names()[::-1] if how != "iterate" else None
        taken = ((name, loader.take(name)) for name in order) if order else loader
        for name, array in taken:
            # what the loader holds, with the tensor the caller holds
            assert allocations.alive <= budget + array.nbytes
            time.sleep(0.001)     # a slow consumer: the threads read ahead meanwhile
            assert_same(array, expected[name])
            del array
        assert loader.peak_bytes <= budget
    assert allocations.alive == 0


def test_the_threads_read_ahead_up_to_the_budget_and_no_further(tmp_path, no_thread_left):
    from fastst._core import read_counters
    tensors = {f"t{k:02d}": np.full(10 * KIB, k, np.uint8) for k in range(12)}
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path)
    with fastst.safe_open(path, backend="pread") as f:
        before = read_counters()["bytes"]
        with f.prefetch(max_bytes_in_flight=40 * KIB) as loader:
            assert wait_until(lambda: len(loader._loading.landed) == 4)
            time.sleep(0.05)
            assert loader._loading.held == 40 * KIB and len(loader._loading.landed) == 4
            assert read_counters()["bytes"] - before == 40 * KIB
            assert sorted(name for name, _ in loader) == sorted(tensors)
            assert loader.peak_bytes == 40 * KIB


def test_a_tensor_whose_memory_cannot_be_had_is_handed_out_as_that_error(
        tmp_path, monkeypatch, no_thread_left):
    path = many_tensors(tmp_path, count=6)
    allocate = _prefetch._Tensor.allocate

    def short_of_memory(tensor):
        if tensor.name == "t002":
            raise MemoryError("no memory for t002")
        allocate(tensor)

    monkeypatch.setattr(_prefetch._Tensor, "allocate", short_of_memory)
    handed, failed = [], []
    with fastst.safe_open(path) as f, f.prefetch(max_bytes_in_flight=20 * KIB) as loader:
        while True:
            try:
                name, array = next(loader)
            except MemoryError as error:
                failed.append(str(error))
                continue
            except StopIteration:
                break
            handed.append(name)
            assert array.tolist() == [int(name[1:]) % 251] * (10 * KIB)
    assert sorted(handed) == ["t000", "t001", "t003", "t004", "t005"]
    assert failed == ["no memory for t002"]


def test_memory_stays_within_the_budget_over_a_plan_far_larger(tmp_path):
    """1 GiB of tensors read through a budget of 64 MiB, by a process whose address
    space may grow by 512 MiB: a loader that read further ahead runs out of memory."""
    run_bounded(f"""
        import json, struct, time
        path = {str(tmp_path / "sparse.safetensors")!r}
        header = {{f"t{{k:03d}}": {{"dtype": "U8", "shape": [8 << 20],
                                   "data_offsets": [k << 23, (k + 1) << 23]}} for k in range(128)}}
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            out.truncate(8 + len(text) + (128 << 23))      # sparse: zeros, no disk
        with fastst.safe_open(path, backend="pread") as f, \\
                f.prefetch(max_bytes_in_flight=64 << 20, threads=2) as loader:
            while loader._loading.held < 64 << 20:
                time.sleep(0.01)                           # the caller waits: the threads fill
            time.sleep(0.3)
            count = 0
            for name, array in loader:                     # a slow consumer
                count += not array.any()
                time.sleep(0.005)
        assert count == 128 and loader.peak_bytes == 64 << 20, (count, loader.peak_bytes)
        print("ok")
    """, memory=512 << 20, file_size=2 << 30, timeout=120)


# --- prefetch(plan): threads, and how they end ----------------------------------------------

def many_tensors(tmp_path, count=50, size=10 * KIB):
    path = tmp_path / "many.safetensors"
    fastst.save_file({f"t{k:03d}": np.full(size, k % 251, np.uint8) for k in range(count)}, path)
    return path


def test_the_threads_are_those_of_read_options_unless_told(tmp_path, no_thread_left,
                                                           restore_read_options):
    path = many_tensors(tmp_path)
    fastst.read_options(threads=3)
    with fastst.safe_open(path, backend="pread") as f:
        for threads, expected in ((None, 3), (1, 1), (5, 5)):
            with f.prefetch(threads=threads, max_bytes_in_flight=10 * KIB) as loader:
                assert loader.threads == expected
                assert wait_until(lambda: loader._loading.held == 10 * KIB)
                assert len(loader_threads()) == expected     # one reads, the others wait
            assert not loader_threads()
        with f.prefetch({"t000": None}, threads=8) as loader:   # no more than there is to read
            assert len(loader._threads) == 1


def test_close_stops_the_threads_and_ends_the_loader(tmp_path, no_thread_left):
    path = many_tensors(tmp_path)
    with fastst.safe_open(path) as f:
        loader = f.prefetch(max_bytes_in_flight=20 * KIB)
        first = loader.take("t000")
        assert wait_until(lambda: loader._loading.held == 20 * KIB)
        assert loader_threads()
        loader.close()
        assert not loader_threads()
        for ask in (lambda: loader.take("t001"), lambda: next(loader)):
            with pytest.raises(fastst.SafetensorError, match="^prefetch loader closed"):
                ask()
        loader.close()       # twice is fine
    assert first.tolist() == [0] * (10 * KIB)       # what was handed out stays valid


def test_a_dropped_loader_stops_its_threads(tmp_path, no_thread_left):
    path = many_tensors(tmp_path)
    with fastst.safe_open(path) as f:
        loader = f.prefetch(max_bytes_in_flight=20 * KIB)
        assert wait_until(lambda: loader._loading.held == 20 * KIB) and loader_threads()
        del loader
        gc.collect()
        assert wait_until(lambda: not loader_threads())


def test_the_threads_end_once_everything_is_read(tmp_path, no_thread_left):
    path = many_tensors(tmp_path, count=5)
    with fastst.safe_open(path) as f:
        loader = f.prefetch()
        assert wait_until(lambda: not loader_threads())
        assert len(dict(loader)) == 5 and list(loader) == []


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_handle_closed_under_the_loader_is_a_clear_error(tmp_path, backend, no_thread_left):
    path = many_tensors(tmp_path, count=20)
    f = fastst.safe_open(path, backend=backend)
    loader = f.prefetch(max_bytes_in_flight=20 * KIB)
    assert wait_until(lambda: len(loader._loading.landed) == 2)
    f.close()
    assert [name for name, _ in (next(loader), next(loader))] == ["t000", "t001"]  # read before
    with pytest.raises(fastst.SafetensorError, match="file is closed") as error:
        loader.take("t010")
    assert str(path) in str(error.value)
    with pytest.raises(fastst.SafetensorError, match="file is closed"):
        list(loader)
    assert wait_until(lambda: not loader_threads())
    loader.close()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_file_truncated_under_the_loader_is_a_clear_error(tmp_path, backend, no_thread_left):
    path = many_tensors(tmp_path, count=20)
    with fastst.safe_open(path, backend=backend) as f:
        loader = f.prefetch(max_bytes_in_flight=20 * KIB)
        assert wait_until(lambda: len(loader._loading.landed) == 2)
        os.truncate(path, f.data_start + 100 * KIB)
        with pytest.raises(fastst.SafetensorError, match="truncated under the reader") as error:
            for _ in loader:
                pass
        assert str(path) in str(error.value)
        assert wait_until(lambda: not loader_threads())
        loader.close()


@pytest.mark.needs("xxhash")
def test_a_verifying_handle_checks_each_tensor_it_hands_out(tmp_path, no_thread_left):
    tensors = {f"t{k}": np.full((8, 100), k, np.int32) for k in range(4)}
    path = tmp_path / "x.safetensors"
    fastst.save_file(tensors, path, checksum="xxh3_64")
    with fastst.safe_open(path) as f:
        at = f.data_start + f.info("t2").data_offsets[0] + 500
    with open(path, "r+b") as out:      # one byte of t2 changed in place
        out.seek(at)
        out.write(b"\xff")
    with fastst.safe_open(path, verify=True, backend="pread") as f:
        with f.prefetch({"t1": None, "t2": None, "t3": slice(2, 4)}) as loader:
            assert_same(loader.take("t3"), tensors["t3"][2:4])
            with pytest.raises(fastst.SafetensorError, match="tensor 't2'.*xxh3_64"):
                loader.take("t2")
            assert_same(loader.take("t1"), tensors["t1"])
        with f.prefetch({"t2": slice(0, 1)}) as loader:     # rows: the whole tensor checked
            with pytest.raises(fastst.SafetensorError, match="tensor 't2'"):
                loader.take("t2")


def test_a_server_that_stalls_gives_a_timeout_in_bounded_time(no_thread_left):
    aiohttp = pytest.importorskip("aiohttp")
    pytest.importorskip("fsspec")
    with RangeServer() as server:
        server.objects["/x.safetensors"] = fastst.save(
            {f"t{k}": np.full(100 * KIB, k, np.uint8) for k in range(4)})
        options = {"client_kwargs": {"timeout": aiohttp.ClientTimeout(sock_read=0.5)}}
        with fastst.safe_open(f"{server.url}/x.safetensors", storage_options=options) as f:
            server.mode = "stall"
            started = time.monotonic()
            with f.prefetch(threads=2) as loader, pytest.raises(TimeoutError):
                loader.take("t3")
            assert time.monotonic() - started < 20      # far below the stall
        server.released.set()


# --- prefetch(plan): devices ------------------------------------------------------------------

@pytest.mark.needs("torch")
def test_a_framework_handle_prefetches_to_another_device(saved, no_thread_left):
    import torch
    path, tensors = saved
    with fastst.safe_open(path, "pt") as f, f.prefetch(PLAN, device="meta") as loader:
        got = dict(loader)
    assert {tensor.device.type for tensor in got.values()} == {"meta"}
    assert tuple(got["fp32_2d"].shape) == (2, 4) and got["fp32_2d"].dtype == torch.float32
    reader = fastst.safe_open(path)
    with fastst.FrameworkHandle(reader, lambda array, name, info: array) as f:
        with pytest.raises(fastst.SafetensorTypeError, match="needs a handle from safe_open"):
            f.prefetch(device="cpu")


cuda = pytest.mark.skipif("not __import__('importlib').util.find_spec('torch') "
                          "or not __import__('torch').cuda.is_available()", reason="needs CUDA")


@pytest.mark.needs("torch")
@cuda
@pytest.mark.parametrize("opened_on, prefetched_to", [("cuda:0", None), ("cpu", "cuda:0")])
def test_a_plan_lands_on_a_cuda_device(saved, opened_on, prefetched_to, no_thread_left):
    path, tensors = saved
    with fastst.safe_open(path, "pt", device=opened_on, backend="pread") as f, \
            f.prefetch(PLAN, device=prefetched_to) as loader:
        got = {"fp16_3d": loader.take("fp16_3d")}
        got.update(loader)
    for name, expected in planned(tensors, PLAN).items():
        assert got[name].device.type == "cuda"
        assert_same(got[name].cpu(), expected)


@pytest.mark.needs("torch", "jax")
@cuda
def test_a_checkpoint_lands_on_a_cuda_device_for_jax_too(tmp_path, no_thread_left):
    tensors = {f"w{k}": np.full((10, 10), k, np.float32) for k in range(4)}
    fastst.save_file(tensors, tmp_path, max_shard_size=800)
    with fastst.safe_open(tmp_path, "jax", device="gpu") as f, \
            f.prefetch({"w3": slice(1, 2), "w0": None}) as loader:
        got = dict(loader)
    assert {next(iter(array.devices())).platform for array in got.values()} == {"gpu"}
    assert_same(got["w3"], tensors["w3"][1:2])
