"""Reading ahead (iter_tensors): the same tensors as get_tensor, in the order asked for,
read by a background thread that never holds more than its budget, stops cleanly,
and reports a file changed under it as a SafetensorError."""
import gc
import os
import threading
import time
import weakref

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastst
from fastst._handles import readahead as _readahead
from helpers import wait_until

KIB = 1 << 10


def reading_threads():
    return [thread for thread in threading.enumerate() if thread.name == "fastst-read-ahead"]


@pytest.fixture
def no_thread_left():
    yield
    gc.collect()
    assert wait_until(lambda: not reading_threads()), "a read-ahead thread is still running"


def save_sizes(path, sizes, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {f"t{k:03d}": rng.integers(0, 255, size, np.uint8) for k, size in enumerate(sizes)}
    fastst.save_file(tensors, path)
    return tensors


@pytest.mark.usefixtures("no_thread_left")
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 40 * KIB), min_size=1, max_size=20),
       budget=st.integers(1, 100 * KIB), backend=st.sampled_from(["mmap", "pread"]),
       data=st.data())
def test_the_tensors_come_in_the_order_asked_with_their_bytes(tmp_path, sizes, budget, backend,
                                                              data):
    path = tmp_path / "x.safetensors"
    tensors = save_sizes(path, sizes)
    names = data.draw(st.one_of(st.none(), st.permutations(sorted(tensors))))
    with fastst.safe_open(path, backend=backend) as f:
        walked = list(f.iter_tensors(names, prefetch_bytes=budget))
    assert [name for name, _ in walked] == (list(tensors) if names is None else names)
    for name, array in walked:
        assert array.tobytes() == tensors[name].tobytes()
        assert array.flags.owndata and array.flags.writeable   # fresh memory, not the map


def test_framework_handles_convert_each_tensor(tmp_path, no_thread_left):
    torch = pytest.importorskip("torch")
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                      "b": np.ones(3, np.int64)}, path)
    with fastst.safe_open(path, framework="pt") as f:
        walked = dict(f.iter_tensors())
    assert torch.equal(walked["a"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(walked["b"], torch.ones(3, dtype=torch.int64))


def test_a_sharded_checkpoint_is_walked_shard_by_shard(tmp_path, no_thread_left):
    tensors = {f"w{k}": np.full(100, k, np.float32) for k in range(5)}
    fastst.save_file(tensors, tmp_path, max_shard_size=800)
    with fastst.safe_open(tmp_path) as f:
        assert [(name, int(t[0])) for name, t in f.iter_tensors()] == [
            (f"w{k}", k) for k in range(5)]
        order = ["w4", "w0", "w1", "w3"]
        with f.iter_tensors(order, prefetch_bytes=400) as walk:
            assert [name for name, _ in walk] == order
            assert walk.peak_bytes == 400
        assert f.will_need(["w0", "w4"]) == 800


def test_names_are_checked_before_any_read(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10, 10])
    with fastst.safe_open(path) as f:
        with pytest.raises(fastst.TensorNotFoundError, match="nope"):
            f.iter_tensors(["t000", "nope"])
        with pytest.raises(fastst.SafetensorTypeError, match="not a str"):
            f.iter_tensors("t000")
        for budget in (0, -1, 1.5, True):
            with pytest.raises(fastst.SafetensorError, match="prefetch_bytes must be a positive"):
                f.iter_tensors(prefetch_bytes=budget)


# --- the budget ------------------------------------------------------------------------------

class Allocations:
    """Counts the bytes of the arrays the read-ahead allocates that are still alive."""

    def __init__(self, monkeypatch):
        self.alive = 0
        self.peak = 0
        self.lock = threading.Lock()
        real = _readahead._read_batch

        def counted(batch):
            arrays = real(batch)
            with self.lock:
                for _, array in arrays:
                    self.alive += array.nbytes
                    weakref.finalize(array, self.freed, array.nbytes)
                self.peak = max(self.peak, self.alive)
            return arrays

        monkeypatch.setattr(_readahead, "_read_batch", counted)

    def freed(self, nbytes):
        with self.lock:
            self.alive -= nbytes


@pytest.mark.parametrize("sizes, budget", [
    ([30 * KIB] * 20, 100 * KIB),
    ([1 * KIB] * 200, 10 * KIB),
    ([5 * KIB, 200 * KIB, 5 * KIB, 5 * KIB, 150 * KIB, 1 * KIB], 64 * KIB),  # two over budget
    ([64 * KIB] * 6, 64 * KIB),
])
def test_never_more_than_the_budget_and_the_current_tensor(tmp_path, monkeypatch, no_thread_left,
                                                           sizes, budget):
    path = tmp_path / "x.safetensors"
    tensors = save_sizes(path, sizes)
    allocations = Allocations(monkeypatch)
    with fastst.safe_open(path, backend="pread") as f, \
            f.iter_tensors(prefetch_bytes=budget) as walk:
        current = 0
        for name, array in walk:
            # whatever the thread holds now, with the tensor the caller holds
            assert allocations.alive <= max(budget, array.nbytes) + array.nbytes
            time.sleep(0.002)     # work: the thread reads ahead meanwhile
            assert array.tobytes() == tensors[name].tobytes()
            current = max(current, array.nbytes)
            del array
        assert walk.peak_bytes <= max([budget] + [size for size in sizes if size > budget])
    assert allocations.peak <= max(budget, max(sizes)) + max(sizes)


def test_the_thread_reads_ahead_up_to_the_budget_while_the_caller_works(tmp_path,
                                                                        no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 12)
    with fastst.safe_open(path, backend="pread") as f:
        walk = f.iter_tensors(prefetch_bytes=40 * KIB)
        next(walk)          # the caller holds t000: the thread reads t001..t004, then waits
        assert wait_until(lambda: walk._shared.held == 40 * KIB)
        time.sleep(0.05)
        assert walk._shared.held == 40 * KIB and walk.peak_bytes == 40 * KIB
        assert len(walk._shared.ready) == 4
        assert [name for name, _ in walk] == [f"t{k:03d}" for k in range(1, 12)]


def test_small_tensors_are_read_in_plans_of_several(tmp_path, no_thread_left, monkeypatch):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [1 * KIB] * 100 + [20 << 20])
    plans = []
    real = _readahead._read_batch
    monkeypatch.setattr(_readahead, "_read_batch", lambda batch: plans.append(len(batch))
                        or real(batch))
    with fastst.safe_open(path) as f:
        assert len(list(f.iter_tensors(prefetch_bytes=64 * KIB))) == 101
    assert plans == [16] * 6 + [4, 1]     # a quarter of the budget at most


# --- stopping --------------------------------------------------------------------------------

def started_walk(path, budget=20 * KIB):
    f = fastst.safe_open(path, backend="pread")
    walk = f.iter_tensors(prefetch_bytes=budget)
    return f, walk


def test_break_stops_the_thread(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 50)
    with fastst.safe_open(path) as f:
        for name, _ in f.iter_tensors(prefetch_bytes=20 * KIB):
            if name == "t002":
                break
        gc.collect()
        assert wait_until(lambda: not reading_threads())


def test_an_exception_in_the_loop_stops_the_thread(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 50)
    with fastst.safe_open(path) as f:
        with pytest.raises(ZeroDivisionError):
            for _ in f.iter_tensors(prefetch_bytes=20 * KIB):
                1 / 0
        assert wait_until(lambda: not reading_threads())


def test_a_dropped_iterator_stops_its_thread(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 50)
    f, walk = started_walk(path)
    next(walk)
    assert wait_until(lambda: walk._shared.held == 20 * KIB)    # the thread waits on the budget
    assert len(reading_threads()) == 1
    del walk
    gc.collect()
    assert wait_until(lambda: not reading_threads())
    f.close()


def test_close_stops_a_thread_waiting_on_the_budget(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 50)
    f, walk = started_walk(path)
    assert wait_until(lambda: walk._shared.held == 20 * KIB)
    walk.close()
    assert not reading_threads()
    with pytest.raises(StopIteration):
        next(walk)
    walk.close()      # twice is fine
    f.close()


def test_a_finished_walk_leaves_no_thread(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10] * 3)
    with fastst.safe_open(path) as f:
        walk = f.iter_tensors()
        assert len(list(walk)) == 3
        assert not reading_threads()
        assert list(walk) == []


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_file_truncated_during_the_walk_is_a_clear_error(tmp_path, no_thread_left, backend):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 20)
    with fastst.safe_open(path, backend=backend) as f:
        walk = f.iter_tensors(prefetch_bytes=20 * KIB)
        seen = [next(walk)[0]]
        assert wait_until(lambda: walk._shared.held == 20 * KIB)
        os.truncate(path, f.data_start + 100 * KIB)
        with pytest.raises(fastst.SafetensorError, match="truncated under the reader") as error:
            for name, _ in walk:
                seen.append(name)
        assert str(path) in str(error.value)
        # pread: t010 is the first tensor past the end; a mapped file's copies refuse
        # a file shorter than when opened: the two tensors read ahead come, no more
        assert seen == [f"t{k:03d}" for k in range(10 if backend == "pread" else 3)]
        assert wait_until(lambda: not reading_threads())


def test_a_file_replaced_during_the_walk_is_a_clear_error(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 20)
    with fastst.safe_open(path) as f:
        walk = f.iter_tensors(prefetch_bytes=20 * KIB)
        next(walk)
        assert wait_until(lambda: walk._shared.held == 20 * KIB)
        save_sizes(path, [10 * KIB] * 20, seed=1)    # replaced atomically: a new file
        with pytest.raises(fastst.SafetensorError, match="file was replaced since it was opened"):
            list(walk)


def test_a_closed_handle_is_a_clear_error(tmp_path, no_thread_left):
    path = tmp_path / "x.safetensors"
    save_sizes(path, [10 * KIB] * 20)
    f = fastst.safe_open(path, backend="pread")
    walk = f.iter_tensors(prefetch_bytes=20 * KIB)
    next(walk)
    assert wait_until(lambda: walk._shared.held == 20 * KIB)
    f.close()
    with pytest.raises(fastst.SafetensorError, match="file is closed"):
        list(walk)


# --- who reads ahead -------------------------------------------------------------------------

class Walks:
    """Records each walk a NumpyHandle starts: (its names, its budget)."""

    def __init__(self, monkeypatch):
        self.started = []
        real = fastst.NumpyHandle.iter_tensors

        def recorded(handle, names=None, *, prefetch_bytes=_readahead.DEFAULT_PREFETCH_BYTES):
            walk = real(handle, names, prefetch_bytes=prefetch_bytes)
            self.started.append((list(names) if names is not None else None, prefetch_bytes))
            return walk

        monkeypatch.setattr(fastst.NumpyHandle, "iter_tensors", recorded)


def test_verify_hashes_each_tensor_while_the_next_are_read(tmp_path, monkeypatch, no_thread_left):
    pytest.importorskip("xxhash")
    from fastst.integrity import verify_file

    path = tmp_path / "x.safetensors"
    fastst.save_file({"b": np.arange(10), "a": np.ones(3)}, path, checksum="xxh3_64")
    walks = Walks(monkeypatch)
    report = verify_file(str(path))
    assert report["ok"] and report["checked"] == 2
    assert walks.started == [(["b", "a"], _readahead.DEFAULT_PREFETCH_BYTES)]


def test_the_converter_compares_its_output_tensor_by_tensor_read_ahead(tmp_path, monkeypatch,
                                                                      no_thread_left):
    torch = pytest.importorskip("torch")
    from fastst.convert import torch_to_safetensors

    torch.save({"w": torch.arange(6.0), "b": torch.ones(2)}, tmp_path / "model.pt")
    walks = Walks(monkeypatch)
    torch_to_safetensors(str(tmp_path / "model.pt"), str(tmp_path / "model.safetensors"),
                         verify_torch=True)
    assert walks.started == [(None, _readahead.DEFAULT_PREFETCH_BYTES)]
