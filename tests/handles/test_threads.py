"""Many threads sharing one handle, checkpoint, Loader and the read options: every
read is right, however the threads interleave, on a build with the GIL and on a
free-threaded one (where fastst must also leave the GIL off)."""
import pathlib
import resource
import sysconfig
import threading
import time

import numpy as np
import pytest

import fastst
from fastst.checkpoint import open_checkpoint, save_array_checkpoint
from fastst.data import Loader
from helpers import bounded_ending
from pages import descriptors_on

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
THREADS = 8
ROUNDS = 200
COUNTED_READS = 20_000     # without a lock, 4 threads lost about 5% of their counts


def tensors(count=64, rows=16):
    """Tensor t{k}, whose row r holds k * 1000 + r: any wrong read shows."""
    return {f"t{k}": (k * 1000 + np.arange(rows, dtype=np.float32)[:, None]
                      + np.zeros(4, np.float32)) for k in range(count)}


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.safetensors"
    fastst.save_file(tensors(), path)
    return path


def in_threads(work, threads=THREADS):
    """Run work(k) in `threads` threads started together; re-raise the first failure."""
    start = threading.Barrier(threads)
    failures = []

    def run(k):
        start.wait()
        try:
            work(k)
        except BaseException as error:     # noqa: B036: carried to the test's thread
            failures.append(error)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert not any(worker.is_alive() for worker in workers), "a thread is still running"
    if failures:
        raise failures[0]


@pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded build (3.13t)")
def test_fastst_leaves_the_gil_off_on_a_free_threaded_build(tmp_path):
    ended = bounded_ending(f"""
        import sys, warnings
        warnings.simplefilter("error")      # "the GIL has been enabled" is a RuntimeWarning
        import numpy as np, fastst, fastst.state, fastst.checkpoint, fastst.data
        path = {str(tmp_path / "a.safetensors")!r}
        fastst.save_file({{"a": np.arange(6, dtype=np.float32)}}, path, metadata={{"k": "v"}})
        with fastst.safe_open(path) as f:
            assert f.get_tensor("a").tolist() == list(range(6)) and f.metadata() == {{"k": "v"}}
        assert fastst.load_file(path, backend="pread")["a"].sum() == 15
        fastst.save_state({str(tmp_path / "s.safetensors")!r}, {{"step": 1, "w": np.ones(2)}})
        assert fastst.load_state({str(tmp_path / "s.safetensors")!r})["step"] == 1
        assert not sys._is_gil_enabled(), "the GIL is on"
        print(sorted(name for name, module in sys.modules.items()
                     if getattr(module, "__file__", "") and module.__file__.endswith(".so")))
    """, timeout=60)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert "fastst._core" in ended.stdout and "orjson" not in ended.stdout


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_threads_sharing_one_handle_read_every_tensor_right(small_file, backend):
    expected = tensors()
    names = sorted(expected)
    with fastst.safe_open(small_file, backend=backend) as handle:
        def work(k):
            rng = np.random.default_rng(k)
            for _ in range(ROUNDS):
                name = names[rng.integers(len(names))]
                want = expected[name]
                np.testing.assert_array_equal(handle.get_tensor(name), want)
                np.testing.assert_array_equal(handle.get_slice(name)[3:9, 1:], want[3:9, 1:])
                rows = rng.integers(0, len(want), 5)
                np.testing.assert_array_equal(handle.gather(name, rows), want[rows])

        in_threads(work)


def test_reads_racing_a_close_are_right_or_refused_and_never_crash(small_file):
    """In a child: a crash (a use of unmapped memory, a descriptor closed under a
    read) would end it by a signal. Once the reads end, the handle holds no descriptor
    on the file, whoever of close() and the last read let it go."""
    ended = bounded_ending(f"""
        import sys, threading
        import numpy as np, fastst
        from fastst import SafetensorError
        sys.path.insert(0, {str(pathlib.Path(__file__).resolve().parents[1])!r})
        from pages import descriptors_on
        for backend in ("mmap", "pread"):
            for round in range(60):
                handle = fastst.safe_open({str(small_file)!r}, backend=backend)
                start, outcomes = threading.Barrier(5), []
                def read(k):
                    start.wait()
                    for _ in range(50):
                        try:
                            rows = handle.gather("t7", [1, 2]) if k % 2 else handle.get_tensor("t7")
                            assert rows[:, 0].min() >= 7000 and rows[:, 0].max() < 7016
                            outcomes.append("read")
                        except SafetensorError as error:
                            assert "closed" in str(error), error
                            outcomes.append("refused")
                def close():
                    start.wait()
                    handle.close()
                threads = [threading.Thread(target=read, args=(k,)) for k in range(4)]
                threads.append(threading.Thread(target=close))
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                assert len(outcomes) == 200 and handle.closed
                assert descriptors_on({str(small_file)!r}) == 0, backend
        print("ok")
    """, timeout=120)
    assert ended.returncode == 0, ended.stderr[-3000:]
    assert ended.stdout.strip() == "ok"


def test_a_pread_handle_closed_during_a_read_lets_its_file_go_when_the_read_ends(tmp_path):
    """close() while a read is in flight leaves the descriptor to that read, which
    ends whole and then lets it go (or, where close() came first, is refused)."""
    path = tmp_path / "large.safetensors"
    expected = np.arange(16 << 20, dtype=np.float32)
    fastst.save_file({"x": expected}, path)
    read_whole = 0
    for attempt in range(8):
        handle = fastst.safe_open(path, backend="pread")
        outcomes = []

        def read():
            try:
                outcomes.append(handle.get_tensor("x"))
            except fastst.SafetensorError as error:
                outcomes.append(error)

        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(0.002 * attempt)     # close() lands before, during or after the read
        handle.close()
        reader.join()
        assert descriptors_on(path) == 0
        if isinstance(outcomes[0], np.ndarray):
            np.testing.assert_array_equal(outcomes[0], expected)
            read_whole += 1
        else:
            assert "closed" in str(outcomes[0])
    assert read_whole


def test_threads_sharing_one_checkpoint_read_every_tensor_right(tmp_path):
    expected = tensors()
    save_array_checkpoint(expected, tmp_path / "model.safetensors", max_shard_size=4096)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    names = sorted(expected)
    with open_checkpoint(tmp_path) as checkpoint:
        def work(k):
            for round in range(ROUNDS // 4):
                name = names[(k * 7 + round) % len(names)]
                np.testing.assert_array_equal(checkpoint.get_tensor(name), expected[name])

        in_threads(work)


def test_read_options_changed_by_threads_never_mix_and_reads_stay_right(small_file,
                                                                       restore_read_options):
    expected = tensors()
    before = fastst.read_options()

    def work(k):
        for round in range(ROUNDS // 4):
            options = fastst.read_options(threads=1 + (k + round) % 4,
                                          request_bytes=(64 << 10) * (1 + k % 2))
            assert 1 <= options.threads <= 4 or options == before
            loaded = fastst.load_file(small_file, backend="pread")
            for name in ("t0", f"t{k}"):
                np.testing.assert_array_equal(loaded[name], expected[name])

    in_threads(work)


def test_read_counters_count_every_request_of_threads_reading_at_once(small_file):
    with fastst.safe_open(small_file, backend="pread") as handle:
        handle.get_tensor("t1")
        counted = fastst._core.read_counters()
        handle.get_tensor("t1")
        per_read = {key: fastst._core.read_counters()[key] - counted[key]
                    for key in ("requests", "bytes")}
        assert per_read["requests"] >= 1
        counted = fastst._core.read_counters()
        in_threads(lambda k: [handle.get_tensor("t1") for _ in range(COUNTED_READS)],
                   threads=4)
        after = fastst._core.read_counters()
    for key, each in per_read.items():
        assert after[key] - counted[key] == each * 4 * COUNTED_READS, key


@pytest.mark.skipif(FREE_THREADED, reason="a free-threaded build has no GIL to hand over")
def test_threads_reading_small_cached_tensors_with_pread_keep_the_gil_between_turns(
        small_file):
    """Each small read from the page cache keeps the GIL: had it let go, the other
    thread would take it at every read, and each handover is a sleep and a wake."""
    reads = 40_000
    with fastst.safe_open(small_file, backend="pread") as handle:
        handle.get_tensors()                    # in the page cache
        before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        in_threads(lambda k: [handle.get_tensor(f"t{n % 64}") for n in range(reads)],
                   threads=2)
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - before
    # tens here; 8,408 when each read let go of it
    assert switches < 1_000


def test_threads_each_iterating_a_loader_over_one_file_get_every_row(small_file):
    def work(k):
        loader = Loader(small_file, ["t3", "t4"], batch_size=5, shuffle=True, seed=k,
                        threads=2)
        for epoch in range(3):
            rows = np.concatenate([batch["t3"][:, 0] for batch in loader])
            assert sorted(rows.tolist()) == [3000 + r for r in range(16)]

    in_threads(work, threads=4)

