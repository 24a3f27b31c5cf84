"""How local files are read into fresh memory: threads, request sizes, posix_fadvise
hints and O_DIRECT (fastst.read_options). Whatever the options, the bytes are the
same; the counts of requests say what the plan did."""
import io
import json
import mmap
import os
import pathlib
import resource
import struct
import sys
import sysconfig

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastst
from fastst._core import free_huge_page_bytes, read_counters, use_huge_page_settings
from helpers import wait_until
from pages import (cached_pages, drop_or_skip, dropped_from_page_cache, flags_of_memory_at,
                   map_flags, pmd_mapped_bytes, read_bytes, resident_bytes)

KIB = 1 << 10
MIB = 1 << 20
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


pytestmark = pytest.mark.usefixtures("restore_read_options")


def counted(action):
    """What `action` did, as the change of the core's read counters."""
    before = read_counters()
    action()
    after = read_counters()
    return {key: after[key] - before[key] for key in after}


def direct_io_works(folder):
    """Whether the file system of `folder` takes O_DIRECT."""
    probe = os.path.join(folder, "probe")
    with open(probe, "wb") as file:
        file.write(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.remove(probe)


TMPFS = "/dev/shm"
OPTIONS = [dict(threads=threads, request_bytes=request, direct=direct, hints=hints)
           for threads in (1, 3, 8) for request in (64 * KIB, 192 * KIB)
           for direct in (False, True) for hints in (True, False)]


def layout_strategy():
    """Tensors of a file: sizes from empty to several requests, any order of dtypes."""
    size = st.one_of(st.integers(0, 64), st.integers(4000, 5000), st.integers(60 * KIB, 70 * KIB),
                     st.integers(200 * KIB, 420 * KIB))
    dtype = st.sampled_from([np.uint8, np.int16, np.float32, np.float64])
    return st.lists(st.tuples(size, dtype), min_size=1, max_size=12)


def build(layout, seed):
    rng = np.random.default_rng(seed)
    return {f"t{k:02d}": rng.integers(0, 255, count * np.dtype(dtype).itemsize, np.uint8)
            .view(dtype) for k, (count, dtype) in enumerate(layout)}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layout_strategy(), seed=st.integers(0, 2**32 - 1), align=st.sampled_from([None, 4096]),
       options=st.sampled_from(OPTIONS), tmpfs=st.booleans())
def test_every_option_reads_the_same_bytes(tmp_path, layout, seed, align, options, tmpfs):
    folder = TMPFS if tmpfs and os.path.isdir(TMPFS) else str(tmp_path)
    path = os.path.join(folder, f"layout-{os.getpid()}.safetensors")
    tensors = build(layout, seed)
    fastst.save_file(tensors, path, align=align)
    try:
        fastst.read_options(**options)
        loaded = [fastst.load_file(path, copy=True), fastst.load_file(path, backend="pread")]
        into = {name: np.empty_like(array) for name, array in tensors.items()}
        fastst.load_into(path, into)
        with fastst.safe_open(path) as f:
            walked = dict(f.iter_tensors(prefetch_bytes=100 * KIB))
        for result in loaded + [into, walked]:
            assert sorted(result) == sorted(tensors)
            for name, array in tensors.items():
                assert result[name].dtype == array.dtype
                assert result[name].tobytes() == array.tobytes()
    finally:
        os.remove(path)


def test_a_plan_is_cut_into_requests_that_threads_share(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(MIB, np.uint8), "b": np.ones(MIB // 2, np.uint8)}, path)
    fastst.read_options(threads=3, request_bytes=256 * KIB)
    done = counted(lambda: fastst.load_file(path, copy=True))
    # the two tensors are one range of the file but two arrays: 4 + 2 requests
    assert done["requests"] == 6 and done["bytes"] == MIB + MIB // 2
    assert done["threads_started"] == 2
    fastst.read_options(threads=1)
    assert counted(lambda: fastst.load_file(path, copy=True))["threads_started"] == 0


def test_by_default_a_plan_has_a_thread_per_usable_cpu_and_at_most_four(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k}": np.full(256 * KIB, k, np.uint8) for k in range(8)}, path)
    assert fastst.read_options(request_bytes=256 * KIB).threads == 0
    started = counted(lambda: fastst.load_file(path, copy=True))["threads_started"]
    assert started == min(fastst._core.usable_cpus(), 4) - 1


def test_the_pread_backend_reads_a_whole_file_in_one_plan(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k}": np.full(256 * KIB, k, np.uint8) for k in range(8)}, path)
    fastst.read_options(threads=4, request_bytes=256 * KIB)
    done = counted(lambda: fastst.load_file(path, backend="pread"))
    # one plan of 8 requests, shared by 4 threads (3 started): not 8 plans of one thread
    assert done["requests"] == 8 and done["threads_started"] == 3
    assert done["hinted_plans"] == 1


def test_a_small_plan_is_read_by_the_calling_thread(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(100 * KIB, np.uint8)}, path)
    fastst.read_options(threads=8, request_bytes=64 * KIB)
    done = counted(lambda: fastst.load_file(path, copy=True))
    assert done["requests"] == 2 and done["threads_started"] == 0 and done["hinted_plans"] == 0


@pytest.mark.skipif(FREE_THREADED, reason="a free-threaded build has no GIL to keep")
def test_a_small_plan_in_the_page_cache_is_read_keeping_the_gil(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.arange(1000, dtype=np.int64)}, path)
    with fastst.safe_open(path, backend="pread") as f:
        f.get_tensor("a")
        done = counted(lambda: np.testing.assert_array_equal(f.get_tensor("a"), np.arange(1000)))
    assert done["requests"] == done["cached_requests"] == 1 and done["bytes"] == 8000


def test_a_small_plan_not_in_the_page_cache_is_read_letting_go_of_the_gil(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.arange(1000, dtype=np.int64)}, path)
    with fastst.safe_open(path, backend="pread") as f:
        drop_or_skip(path)
        done = counted(lambda: np.testing.assert_array_equal(f.get_tensor("a"), np.arange(1000)))
    assert done["requests"] == 1 and done["cached_requests"] == 0 and done["bytes"] == 8000


def test_a_small_plan_reads_what_is_cached_keeping_the_gil_and_the_rest_without(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.full(20 * KIB, 1, np.uint8), "b": np.full(20 * KIB, 2, np.uint8)},
                     path, align=4096)      # b's pages hold nothing of a's
    fastst.read_options(request_bytes=64 * KIB)     # 20 KiB each: a request each
    with fastst.safe_open(path, backend="pread") as f:
        b_starts = f.data_start + f.info("b").data_offsets[0]
        drop_or_skip(path)
        fd = os.open(path, os.O_RDONLY)
        try:                # a's pages back in the page cache, and no page of b's
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, b_starts, 0)
        finally:
            os.close(fd)
        if cached_pages(path, b_starts):
            pytest.skip("the kernel read b's pages ahead")
        tensors = {}
        done = counted(lambda: tensors.update(f.copy_tensors()))
    assert (tensors["a"] == 1).all() and (tensors["b"] == 2).all()
    expect_cached = 0 if FREE_THREADED else 1
    assert done["requests"] == 2 and done["cached_requests"] == expect_cached


def test_a_small_plan_read_from_the_page_cache_finds_its_file_truncated(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k:02d}": np.full(100, k, np.uint8) for k in range(20)}, path)
    with fastst.safe_open(path, backend="pread") as f:
        f.copy_tensors()
        os.truncate(path, f.data_start + 1950)
        with pytest.raises(fastst.SafetensorError, match=r"20 tensors: file was truncated "
                                                         r"under the reader \(50 bytes"):
            f.copy_tensors()


def test_small_tensors_adjacent_in_the_file_share_requests(tmp_path):
    path = tmp_path / "x.safetensors"
    tensors = {f"t{k:03d}": np.full(1000 + k, k, np.uint8) for k in range(200)}
    fastst.save_file(tensors, path)
    fastst.read_options(threads=4, request_bytes=64 * KIB)
    result = {}
    done = counted(lambda: result.update(fastst.load_file(path, copy=True)))
    assert all(result[name].tobytes() == tensors[name].tobytes() for name in tensors)
    total = sum(array.nbytes for array in tensors.values())     # 219,900 bytes
    assert done["requests"] == -(-total // (64 * KIB)) == 4 and done["bytes"] == total
    assert done["threads_started"] == 3


def test_a_truncated_file_is_found_in_a_shared_request(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k:03d}": np.full(1000, k, np.uint8) for k in range(200)}, path)
    fastst.read_options(request_bytes=64 * KIB)
    with fastst.safe_open(path, backend="pread") as f:
        os.truncate(path, f.data_start + 150_500)
        with pytest.raises(fastst.SafetensorError, match=r"200 tensors: file was truncated "
                                                         r"under the reader \(49500 bytes"):
            f.copy_tensors()


def test_hints_are_given_only_to_plans_in_file_order(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(MIB, np.uint8), "b": np.zeros(MIB, np.uint8)}, path)
    fastst.read_options(request_bytes=128 * KIB)
    out = {"b": np.empty(MIB, np.uint8), "a": np.empty(MIB, np.uint8)}
    with fastst.safe_open(path) as f:
        assert counted(lambda: f.read_into(out))["hinted_plans"] == 0       # b before a
        assert counted(lambda: f.read_into(dict(reversed(out.items()))))["hinted_plans"] == 1
        fastst.read_options(hints=False)
        assert counted(lambda: f.copy_tensors())["hinted_plans"] == 0


def threads_named(name):
    """The threads of this process named `name` (Linux names fastst's C threads;
    elsewhere none is seen)."""
    found = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == name:
                    found.append(task)
        except OSError:     # ended meanwhile
            continue
    return found


def primers():
    return threads_named("fastst-primer")


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_whole_file_copy_is_read_ahead_while_its_arrays_are_made(tmp_path, backend):
    """copy_tensors (load_file(copy=True), the pread backend's get_tensors) starts a
    thread reading the tensors' span before it makes their arrays; it stops when the
    plan's readers start and reads nothing the plan counts, nothing past the span."""
    path = tmp_path / "x.safetensors"
    tensors = {f"t{k:03d}": np.full(10_000, k, np.uint8) for k in range(100)}
    fastst.save_file(tensors, path)
    fastst.read_options(request_bytes=64 * KIB)
    result = {}
    done = counted(lambda: result.update(fastst.load_file(path, copy=backend == "mmap",
                                                          backend=backend)))
    assert all(result[name].tobytes() == tensors[name].tobytes() for name in tensors)
    assert done["primed_plans"] == 1 and done["hinted_plans"] == 1
    assert 0 <= done["primed_bytes"] <= 100 * 10_000
    # six tensors a request: one preadv each run of six, as without the read-ahead
    assert done["requests"] == -(-100 // 6) and done["bytes"] == 100 * 10_000
    assert primers() == []      # stopped and joined before the call returned


@pytest.mark.parametrize("options", [dict(hints=False), dict(direct=True),
                                     dict(request_bytes=1024 * KIB)],
                         ids=["no hints", "direct", "a span under two requests"])
def test_a_copy_is_not_read_ahead_without_hints_directly_or_when_small(tmp_path, options):
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k:03d}": np.full(10_000, k, np.uint8) for k in range(100)}, path)
    fastst.read_options(**{"request_bytes": 64 * KIB, **options})
    done = counted(lambda: fastst.load_file(path, copy=True))
    assert done["primed_plans"] == 0 and done["primed_bytes"] == 0


def test_a_copy_that_fails_making_its_arrays_stops_reading_ahead(tmp_path):
    """A tensor NumPy cannot hold, after a large one: copy_tensors raises while it
    makes the arrays, and the thread reading ahead is stopped and joined first."""
    header = {"a": {"dtype": "U8", "shape": [MIB], "data_offsets": [0, MIB]},
              "z": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [MIB, MIB + 1]}}
    encoded = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * (MIB + 1))
    fastst.read_options(request_bytes=64 * KIB)
    for backend in ("mmap", "pread"):
        with fastst.safe_open(path, backend=backend) as f:
            before = read_counters()["primed_plans"]
            with pytest.raises(fastst.SafetensorError, match="cannot be a NumPy array"):
                f.copy_tensors()
            assert read_counters()["primed_plans"] == before + 1 and primers() == []


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="MADV_POPULATE_READ and /proc/self are Linux's")


def small_tensors(path, count=100, size=10_000):
    tensors = {f"t{k:03d}": np.full(size, k, np.uint8) for k in range(count)}
    fastst.save_file(tensors, path)
    return tensors


@LINUX_ONLY
def test_every_tensor_of_a_mapped_file_asked_for_is_read_ahead(tmp_path):
    """get_tensors (load_file) on a mapped file not in the page cache starts one thread
    that reads and maps every tensor's pages in order: untouched, the whole span
    becomes resident in the map."""
    path = tmp_path / "x.safetensors"
    tensors = small_tensors(path)
    drop_or_skip(path)
    fastst.read_options(request_bytes=64 * KIB)
    loaded = {}
    done = counted(lambda: loaded.update(fastst.load_file(path)))
    assert done["maps_read_ahead"] == 1 and done["requests"] == 0
    assert wait_until(lambda: resident_bytes(path) >= 100 * 10_000), resident_bytes(path)
    assert wait_until(lambda: not threads_named("fastst-map-read"))
    assert all(loaded[name].tobytes() == array.tobytes() for name, array in tensors.items())


@LINUX_ONLY
def test_a_mapped_file_in_the_page_cache_is_not_read_ahead(tmp_path):
    """A file the page cache holds (its first and last 64 KiB at least) has nothing to
    read: no thread starts, and none of its pages is mapped."""
    path = tmp_path / "x.safetensors"
    small_tensors(path)
    assert cached_pages(path) * mmap.PAGESIZE >= os.path.getsize(path) - mmap.PAGESIZE
    fastst.read_options(request_bytes=64 * KIB)
    loaded = {}
    assert counted(lambda: loaded.update(fastst.load_file(path)))["maps_read_ahead"] == 0
    assert not threads_named("fastst-map-read") and resident_bytes(path) == 0


@LINUX_ONLY
def test_a_map_is_read_ahead_once_and_only_for_every_tensor_with_hints(tmp_path):
    path = tmp_path / "x.safetensors"
    small_tensors(path)
    drop_or_skip(path)
    fastst.read_options(request_bytes=64 * KIB)
    with fastst.safe_open(path) as f:
        assert counted(lambda: f.get_tensor("t000"))["maps_read_ahead"] == 0
        assert counted(f.get_tensors)["maps_read_ahead"] == 1
        assert counted(f.get_tensors)["maps_read_ahead"] == 0      # once a map
    assert wait_until(lambda: not threads_named("fastst-map-read"))
    dropped_from_page_cache(path)
    fastst.read_options(hints=False)
    kept = []
    assert counted(lambda: kept.append(fastst.load_file(path)))["maps_read_ahead"] == 0
    assert resident_bytes(path) == 0        # nothing touched, nothing read ahead
    fastst.read_options(hints=True, request_bytes=1024 * KIB)
    assert counted(lambda: fastst.load_file(path))["maps_read_ahead"] == 0   # under 2 requests


@LINUX_ONLY
def test_a_file_cut_short_under_its_read_ahead_ends_it_without_a_fault(tmp_path):
    """The read-ahead maps pages with MADV_POPULATE_READ, which fails (EFAULT) past
    the end of a file that shrank, where a touch of the page raises SIGBUS: the
    process survives, the thread ends."""
    path = tmp_path / "x.safetensors"
    fastst.save_file({f"t{k}": np.full(MIB, k, np.uint8) for k in range(8)}, path)
    dropped_from_page_cache(path)       # else there is nothing to read (nor to fail)
    fastst.read_options(request_bytes=64 * KIB)
    loaded = fastst.load_file(path)
    os.truncate(path, 4096)
    assert wait_until(lambda: not threads_named("fastst-map-read"))
    del loaded


def drop_and_load_again(holder, path, sender):
    """In a forked child: let go of the parent's map, whose read-ahead thread (running
    or ended) is not this process's to wait for, then load the file again."""
    import gc
    holder.clear()
    gc.collect()
    sender.send(int(fastst.load_file(path)["t005"][0]))


@LINUX_ONLY
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_a_forked_child_lets_go_of_its_parents_read_ahead(tmp_path):
    import multiprocessing
    path = tmp_path / "x.safetensors"
    small_tensors(path)
    dropped_from_page_cache(path)       # so that a read-ahead starts
    fastst.read_options(request_bytes=64 * KIB)
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    holder = [fastst.load_file(path)]      # the only reference, which the child drops
    child = context.Process(target=drop_and_load_again, args=(holder, path, sender))
    child.start()
    sender.close()
    assert receiver.poll(120), "the forked child sent nothing"
    assert receiver.recv() == 5
    child.join(60)
    assert child.exitcode == 0 and int(holder[0]["t005"][0]) == 5


def test_direct_reads_aligned_tensors_straight_into_aligned_memory(tmp_path):
    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "x.safetensors"
    tensors = {"a": np.arange(MIB // 4, dtype=np.float32), "b": np.arange(MIB // 2, dtype=np.int16)}
    fastst.save_file(tensors, path, align=4096)
    fastst.read_options(direct=True, request_bytes=256 * KIB, threads=2)
    out = {name: aligned_like(array) for name, array in tensors.items()}
    done = counted(lambda: fastst.load_into(path, out))
    assert all(out[name].tobytes() == tensors[name].tobytes() for name in tensors)
    assert done["direct_requests"] == done["requests"] == 8
    assert done["direct_bytes"] == 2 * MIB and done["bounced_bytes"] == 0


def test_direct_reads_unaligned_tensors_through_an_aligned_buffer(tmp_path):
    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "x.safetensors"
    tensors = {"odd": np.arange(3, 300_003, dtype=np.uint8), "b": np.arange(MIB, dtype=np.uint8)}
    fastst.save_file(tensors, path)      # unaligned: the header's length decides the offsets
    fastst.read_options(direct=True, request_bytes=256 * KIB)
    done = counted(lambda: loaded.update(fastst.load_file(path, copy=True)))
    assert all(loaded[name].tobytes() == tensors[name].tobytes() for name in tensors)
    assert done["direct_requests"] >= 6 and done["direct_refused"] == 0
    assert done["bounced_bytes"] == 300_000 + MIB


loaded = {}


@pytest.mark.skipif(not os.path.isdir(TMPFS), reason="no tmpfs at /dev/shm")
def test_direct_reads_on_tmpfs_give_the_same_bytes_whether_it_takes_them_or_not():
    # tmpfs refused O_DIRECT before Linux 6.6, and takes it since
    path = os.path.join(TMPFS, f"fastst-direct-{os.getpid()}.safetensors")
    tensors = {"a": np.arange(MIB, dtype=np.uint8)}
    fastst.save_file(tensors, path, align=4096)
    try:
        fastst.read_options(direct=True, request_bytes=256 * KIB)
        result = {}
        done = counted(lambda: result.update(fastst.load_file(path, copy=True)))
        assert result["a"].tobytes() == tensors["a"].tobytes()
        if direct_io_works(TMPFS):
            assert done["direct_refused"] == 0 and done["direct_requests"] == 4
        else:
            assert done["direct_refused"] == 1 and done["direct_requests"] == 0
        assert done["requests"] == 4
    finally:
        os.remove(path)


@pytest.mark.parametrize("refusal", ["EINVAL", "no O_DIRECT"])
def test_a_file_system_that_refuses_direct_reads_is_read_through_the_cache(
        tmp_path, monkeypatch, refusal):
    path = tmp_path / "x.safetensors"
    tensors = {"a": np.arange(MIB, dtype=np.uint8)}
    fastst.save_file(tensors, path, align=4096)
    if refusal == "EINVAL":
        real_open = os.open

        def refusing_open(name, flags, *args, **kwargs):
            if flags & os.O_DIRECT:
                raise OSError(22, "Invalid argument", name)
            return real_open(name, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", refusing_open)
    else:
        monkeypatch.delattr(os, "O_DIRECT")
    fastst.read_options(direct=True, request_bytes=256 * KIB)
    result = {}
    done = counted(lambda: result.update(fastst.load_file(path, copy=True)))
    assert result["a"].tobytes() == tensors["a"].tobytes()
    assert done["direct_refused"] == 1 and done["direct_requests"] == 0
    assert done["requests"] == 4


def test_a_direct_open_that_fails_otherwise_is_an_error(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.arange(MIB, dtype=np.uint8)}, path)
    real_open = os.open

    def failing_open(name, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise PermissionError(13, "Permission denied", name)
        return real_open(name, flags, *args, **kwargs)

    fastst.read_options(direct=True, request_bytes=256 * KIB)
    with fastst.safe_open(path) as f:
        monkeypatch.setattr(os, "open", failing_open)
        with pytest.raises(PermissionError):
            f.copy_tensors()


def test_direct_reads_find_a_truncated_file(tmp_path):
    if not direct_io_works(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(2 * MIB, np.uint8)}, path, align=4096)
    fastst.read_options(direct=True, request_bytes=256 * KIB)
    with fastst.safe_open(path, backend="pread") as f:
        os.truncate(path, os.path.getsize(path) - MIB - 100)
        with pytest.raises(fastst.SafetensorError, match=r"tensor 'a': file was truncated "
                                                         r"under the reader \(1048676 bytes"):
            f.get_tensor("a")


def aligned_like(array):
    """An empty array of `array`'s dtype and shape whose memory starts on a page."""
    raw = np.empty(array.nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)


@pytest.mark.parametrize("options, message", [
    (dict(threads=-1), "threads must be an integer from 0 to 64, got -1"),
    (dict(threads=65), "threads must be an integer from 0 to 64"),
    (dict(threads=2.0), "threads must be an integer"),
    (dict(request_bytes=4095 * 16), "request_bytes must be a multiple of 4096 from 64 KiB"),
    (dict(request_bytes=32 * KIB), "request_bytes must be a multiple of 4096"),
    (dict(request_bytes=2 << 30), "request_bytes must be a multiple of 4096"),
    (dict(direct=1), "direct must be True or False, got 1"),
    (dict(hints="yes"), "hints must be True or False"),
])
def test_options_out_of_range_are_refused(options, message):
    before = fastst.read_options()
    with pytest.raises(fastst.SafetensorError, match=message.replace("(", r"\(")):
        fastst.read_options(**options)
    assert fastst.read_options() == before      # nothing changed


def test_read_options_returns_what_was_in_force():
    first = fastst.read_options(threads=5)
    assert fastst.read_options(request_bytes=128 * KIB).threads == 5
    assert fastst.read_options(**first._asdict()).request_bytes == 128 * KIB
    assert fastst.read_options() == first


# --- will_need: kernel read-ahead hints ------------------------------------------------------

def test_will_need_asks_for_the_bytes_of_the_tensors_named(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(100, np.uint8), "b": np.zeros(50, np.uint8),
                      "c": np.zeros(7, np.uint8)}, path)
    for backend in ("mmap", "pread"):
        with fastst.safe_open(path, backend=backend) as f:
            assert f.will_need(["c", "a"]) == 107
            assert f.will_need(["a", "b", "c", "a"]) == 157      # one range, counted once
            assert f.will_need([]) == 0
            with pytest.raises(fastst.TensorNotFoundError):
                f.will_need(["nope"])


def test_a_long_will_need_is_asked_for_in_pieces_the_kernel_reads_whole(tmp_path, monkeypatch):
    """Linux reads no more of one posix_fadvise(WILLNEED) than the device's read-ahead
    limit and drops the rest: a longer span is asked for in pieces of at most that
    limit, cut on its multiples, which together are the span, once."""
    from fastst import _core
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(10_000, np.uint8), "b": np.zeros((1000, 40), np.uint8)},
                     path)
    asked = []
    advise = os.posix_fadvise

    def noted(fd, offset, length, advice):
        asked.append((offset, length))
        return advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", noted)
    monkeypatch.setattr(_core, "_readahead_bytes", lambda device: 8 * KIB)
    with fastst.safe_open(path) as f:
        start = f.data_start
        b = start + f.info("b").data_offsets[0]
        for ask, begin, end in ((lambda: f.will_need(["a", "b"]), start, start + 50_000),
                                (lambda: f.prefetch_rows("b", 100, 900), b + 4000, b + 36_000)):
            asked.clear()
            assert ask() == end - begin
            ends = [offset + length for offset, length in asked]
            assert [offset for offset, _ in asked] == [begin] + ends[:-1]    # in order, no gap
            assert ends[-1] == end
            assert all(0 < length <= 8 * KIB for _, length in asked)
            assert all(stop % (8 * KIB) == 0 for stop in ends[:-1])
            assert len(asked) == len(range(begin // (8 * KIB), -(-end // (8 * KIB))))


def test_the_read_ahead_limit_is_the_devices(tmp_path):
    """One WILLNEED reads up to the larger of the device's read-ahead and its largest
    request, as sysfs tells them; 128 KiB, the kernel's default, where it does not."""
    from fastst import _core
    device = os.stat(tmp_path).st_dev
    found = []
    disk = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for queue in (disk + "/queue", disk + "/../queue"):
        try:
            found = [int(pathlib.Path(queue, name).read_text()) * KIB
                     for name in ("read_ahead_kb", "max_sectors_kb")]
            break
        except OSError:
            continue
    assert _core._readahead_bytes(device) == max([128 * KIB] + found)
    assert _core._device_readahead_bytes(os.makedev(0, 0)) == 128 * KIB   # no such disk


def test_will_need_of_a_buffer_or_a_file_object_asks_for_nothing():
    data = fastst.save({"a": np.zeros(100, np.uint8)})
    with fastst.safe_open(io.BytesIO(data)) as f:
        assert f.backend == "ranges" and f.will_need(["a"]) == 0
    with fastst.NumpyHandle() as f:
        f.open_buffer(data)
        assert f.will_need(["a"]) == 0


def test_will_need_refuses_a_replaced_file(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.zeros(100, np.uint8)}, path)
    with fastst.safe_open(path) as f:
        fastst.save_file({"a": np.ones(100, np.uint8)}, path)
        with pytest.raises(fastst.SafetensorError, match="file was replaced"):
            f.will_need(["a"])


THP = os.path.isdir("/sys/kernel/mm/transparent_hugepage")


def table_of_kib_rows(path, rows=8192):
    """A file of one tensor of `rows` rows of 1 KiB (8 MiB by default), each row's
    first float its number; the offset of its first row."""
    fastst.save_file({"x": np.repeat(np.arange(rows, dtype=np.float32)[:, None], 256, 1)},
                     path)
    with fastst.safe_open(path) as f:
        return f.data_start + f.info("x").data_offsets[0]


@LINUX_ONLY
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_cache_rows_reads_the_whole_2_mib_pieces_that_hold_the_rows(tmp_path, backend):
    """cache_rows reads the rows into the page cache before it returns: the 2 MiB-aligned
    pieces of the file that hold them, whole, and (where the kernel has huge pages,
    whose advice is what reads a piece whole) nothing after them."""
    path = tmp_path / "x.safetensors"
    start = table_of_kib_rows(path)
    drop_or_skip(path)
    with fastst.safe_open(path, backend=backend) as f:
        for (first, stop), pieces in (((3000, 3100), [(2, 4)]),      # inside [2 MiB, 4 MiB)
                                      ((4000, 4200), [(2, 4), (4, 6)])):   # across 4 MiB
            assert start + first * KIB >= pieces[0][0] * MIB
            before, returned = read_bytes(), []
            done = counted(lambda: returned.append(f.cache_rows("x", first, stop)))  # noqa: B023
            assert returned == [(stop - first) * KIB] and done["rows_cached"] == 1
            for low, high in pieces:
                assert cached_pages(path, low * MIB, high * MIB) == 512
            assert cached_pages(path, 64 * KIB, 2 * MIB) == 0
            if THP:
                assert cached_pages(path, pieces[-1][1] * MIB) == 0
                assert read_bytes() - before <= 2 * MIB * len(pieces)
        assert f.cache_rows("x", 8000, 10 ** 9) == 192 * KIB      # clipped to the rows
        assert cached_pages(path, 6 * MIB) * mmap.PAGESIZE >= os.path.getsize(path) - 6 * MIB
        assert f.cache_rows("x", 5, 5) == 0 and f.cache_rows("x", -10, 0) == 0


@LINUX_ONLY
def test_cache_rows_reads_nothing_the_page_cache_holds(tmp_path):
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path)
    drop_or_skip(path)
    with fastst.safe_open(path) as f:
        before = read_bytes()
        f.cache_rows("x", 0, 8192)
        assert read_bytes() - before >= 8 * MIB - 64 * KIB     # the header's pages are in
        before = read_bytes()
        assert f.cache_rows("x", 0, 8192) == 8 * MIB and f.cache_rows("x", 10, 20) == 10 * KIB
        assert read_bytes() == before
        assert resident_bytes(path) <= 2 * MIB      # none of its own mapping is left mapped
        rows = f.gather("x", np.array([8191, 0, 4097]))
    assert rows[:, 0].tolist() == [8191, 0, 4097]


@LINUX_ONLY
def test_cache_rows_reads_the_first_piece_as_one_folio_though_its_header_was_read(tmp_path):
    """Opening a file reads its header's pages into the page cache, small pages at the
    start of its first 2 MiB piece, which would keep cache_rows from reading that
    piece as one 2 MiB folio: it drops them first, so that a map of the file maps
    the first piece by one entry as it does the others (skipped where the file system
    or the kernel maps none so)."""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path)           # 8 MiB of rows: pieces 0-3 whole, a few KiB after
    drop_or_skip(path)
    with fastst.safe_open(path, backend="pread") as f:
        assert cached_pages(path, 0, 2 * MIB) > 0          # the header's pages
        f.cache_rows("x", 0, 8192)
    with open(path, "rb") as file:
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as whole:
            sum(whole[piece * 2 * MIB] for piece in range(4))    # a fault in each piece
            mapped = pmd_mapped_bytes(path)
    if mapped < 3 * 2 * MIB:
        pytest.skip("no 2 MiB folio of this file is mapped whole here")
    assert mapped == 4 * 2 * MIB


@LINUX_ONLY
def test_rows_cached_says_whether_cache_rows_would_read(tmp_path):
    """rows_cached: whether the page cache holds the 2 MiB pieces of the rows, as
    cache_rows asks before it reads (asked of the map; a file read without one
    cannot be asked so: False; rows that are no file's: True)."""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path)
    drop_or_skip(path)
    with fastst.safe_open(path) as f:
        assert not f.rows_cached("x", 3000, 3100)
        f.cache_rows("x", 3000, 3100)                  # the piece [2 MiB, 4 MiB)
        assert f.rows_cached("x", 3000, 3100) and f.rows_cached("x", 2100, 4000)
        assert not f.rows_cached("x", 3000, 4200)      # across 4 MiB
        assert f.rows_cached("x", 5, 5) and f.rows_cached("x", 9000, 9100)   # no rows
    with fastst.safe_open(path, backend="pread") as f:
        assert not f.rows_cached("x", 3000, 3100)
    with fastst.safe_open(io.BytesIO(path.read_bytes())) as f:
        assert f.rows_cached("x", 0, 100)
    with pytest.raises(fastst.SafetensorError, match="closed"):
        f.rows_cached("x", 0, 1)


@LINUX_ONLY
def test_a_map_without_read_ahead_reads_only_the_pages_a_gather_touches(tmp_path):
    """read_ahead_on_faults(False): a fault on the file's map reads the pages it
    touches and nothing around them (the map is advised MADV_RANDOM); on again, a
    fault reads ahead of them, as the kernel does by default."""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path)
    drop_or_skip(path)
    with fastst.safe_open(path) as f:
        assert f.read_ahead_on_faults(False) and "rr" in map_flags(path)
        header = cached_pages(path)
        assert f.gather("x", np.array([4000]))[0, 0] == 4000
        assert cached_pages(path) - header <= 2        # a row of 1 KiB: one page or two
        assert f.read_ahead_on_faults(True) and "rr" not in map_flags(path)
        before = cached_pages(path)
        assert f.gather("x", np.array([6000]))[0, 0] == 6000
        assert cached_pages(path) - before > 2
    with fastst.safe_open(path, backend="pread") as f:
        assert not f.read_ahead_on_faults(False)        # no map to advise
    with pytest.raises(fastst.SafetensorError, match="closed"):
        f.read_ahead_on_faults(False)


SPREAD_ROWS = np.arange(500, 16384, 1000)       # 1 MiB apart in a file of 16 MiB


@LINUX_ONLY
@pytest.mark.parametrize("read", [
    lambda f: [f.get_slice("x")[int(row)].copy() for row in SPREAD_ROWS],
    lambda f: f.get_slice("x")[SPREAD_ROWS],
    lambda f: f.get_slice("x")[SPREAD_ROWS, :4],
    lambda f: f.gather("x", SPREAD_ROWS),
    lambda f: [f.read_rows("x", int(row), int(row) + 1)[0].copy() for row in SPREAD_ROWS],
], ids=["rows", "row array", "row array narrowed", "gather", "read_rows"])
def test_a_few_rows_of_a_mapped_file_read_only_the_pages_they_touch(tmp_path, read):
    """Rows far apart, read through the map (a slice's rows, a gather), read the pages
    that hold them and nothing around them: their tensor's range of the map is advised
    MADV_RANDOM, where each fault read up to the disk's read-ahead (read_ahead_kb)
    around its page (with 8 MiB, 16 rows read the whole 16 MiB file)."""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path, rows=16384)
    drop_or_skip(path)
    with fastst.safe_open(path) as f:
        opened, before = cached_pages(path), read_bytes()
        got = np.asarray(read(f))
        assert got[:, 0].tolist() == SPREAD_ROWS.tolist()
        assert cached_pages(path) - opened <= 2 * len(SPREAD_ROWS)   # a row: 1 or 2 pages
        assert read_bytes() - before <= 2 * len(SPREAD_ROWS) * mmap.PAGESIZE + 64 * KIB
        assert "rr" in map_flags(path)


@LINUX_ONLY
@pytest.mark.parametrize("whole", [lambda f: f.get_tensor("x"), lambda f: f["x"],
                                   lambda f: f.get_tensors()["x"],
                                   lambda f: f.get_slice("x")[:]],
                         ids=["get_tensor", "item", "get_tensors", "slice of it all"])
def test_a_tensor_read_whole_after_a_few_rows_is_read_ahead_again(tmp_path, whole):
    """A tensor a few rows were read of, then handed out whole as a view, is read as
    the kernel reads a map by default: each fault that reads from the disk reads ahead
    of its page (no MADV_RANDOM left, where a fault a page took 13x longer)."""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path, rows=16384)
    drop_or_skip(path)
    with fastst.safe_open(path) as f:
        f.get_slice("x")[5].copy()
        assert "rr" in map_flags(path)
        tensor = whole(f)
        assert "rr" not in map_flags(path)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        assert tensor[::4, 0].sum() == np.arange(0, 16384, 4).sum()
        assert resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults <= 16384 // 4 // 8


def test_cache_rows_of_a_buffer_or_a_file_object_reads_nothing():
    data = fastst.save({"x": np.zeros((100, 4), np.uint8)})
    with fastst.safe_open(io.BytesIO(data)) as f:
        assert f.backend == "ranges" and f.cache_rows("x", 0, 100) == 0
    with fastst.NumpyHandle() as f:
        f.open_buffer(data)
        assert counted(lambda: f.cache_rows("x", 0, 100))["rows_cached"] == 0


def test_cache_rows_refuses_what_has_no_rows(tmp_path):
    path = tmp_path / "x.safetensors"
    fastst.save_file({"x": np.zeros((100, 4), np.uint8), "s": np.zeros((), np.uint8)}, path)
    with fastst.safe_open(path) as f:
        with pytest.raises(fastst.TensorNotFoundError):
            f.cache_rows("nope", 0, 1)
        with pytest.raises(IndexError, match="no axis"):
            f.cache_rows("s", 0, 1)
    with pytest.raises(fastst.SafetensorError, match="closed"):
        f.cache_rows("x", 0, 1)


@LINUX_ONLY
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_cache_rows_refuses_a_file_cut_short_or_replaced_under_it(tmp_path, backend):
    """Rows to read are read from the file opened, no shorter: a file cut short, or
    another file at its path, is an error. (Of a mapped file, rows the page cache holds
    already are the bytes the map reads, and are left as they are.)"""
    path = tmp_path / "x.safetensors"
    table_of_kib_rows(path)
    with fastst.safe_open(path, backend=backend) as f, open(path, "rb") as old:
        os.truncate(path, 4 * MIB)
        dropped_from_page_cache(path)
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.cache_rows("x", 6000, 7000)
    table_of_kib_rows(path)
    with fastst.safe_open(path, backend=backend) as f, open(path, "rb") as old:
        table_of_kib_rows(tmp_path / "new.safetensors")
        os.replace(tmp_path / "new.safetensors", path)
        os.fsync(old.fileno())                                  # the old file's pages
        os.posix_fadvise(old.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with pytest.raises(fastst.SafetensorError, match="file was replaced"):
            f.cache_rows("x", 6000, 7000)


def handler_of(array):
    """The name of the NumPy allocation handler that gave an array its memory."""
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:     # NumPy 1.x
        from numpy.core.multiarray import get_handler_name
    return get_handler_name(array)


def tensors_of_an_open_file(path):
    with fastst.safe_open(path, backend="pread") as f:
        return f.get_tensors()


def copies_of_bytes(path):
    with open(path, "rb") as file:
        return fastst.load(file.read(), copy=True)


@pytest.mark.parametrize("read", [
    lambda path: fastst.load_file(path, copy=True),
    lambda path: fastst.load_file(path, backend="pread"),
    tensors_of_an_open_file,
    copies_of_bytes,
])
def test_big_fresh_arrays_take_huge_pages_and_own_their_memory_as_any_array(tmp_path, read):
    """Arrays of 4 MiB or more come from the huge-page handler (small ones from
    NumPy's): they own their memory, grow and shrink, pickle and free as any array."""
    import pickle

    tensors = {"big": np.arange(3 * MIB, dtype=np.float32).reshape(3, MIB),   # 12 MiB
               "edge": np.full(MIB, 7, np.int32),                             # 4 MiB
               "small": np.arange(1000, dtype=np.int16)}
    path = str(tmp_path / "big.safetensors")
    fastst.save_file(tensors, path)
    loaded = read(path)
    assert all((loaded[name] == array).all() for name, array in tensors.items())
    assert handler_of(loaded["big"]) == handler_of(loaded["edge"]) == "fastst_huge_pages"
    assert handler_of(loaded["small"]) == "default_allocator"
    big = loaded.pop("big")
    assert big.flags.owndata and big.base is None and big.flags.writeable
    assert (pickle.loads(pickle.dumps(big)) == tensors["big"]).all()
    big.resize((4, MIB), refcheck=False)          # realloc through the handler
    assert (big[:3] == tensors["big"]).all() and not big[3].any()
    big.resize((10,), refcheck=False)
    assert (big == np.arange(10)).all()
    del big, loaded


def test_huge_pages_can_be_turned_off(tmp_path):
    path = str(tmp_path / "big.safetensors")
    fastst.save_file({"big": np.ones(2 * MIB, np.float32)}, path)
    assert fastst.read_options(huge_pages=False).huge_pages is True
    assert handler_of(fastst.load_file(path, copy=True)["big"]) == "default_allocator"
    with pytest.raises(fastst.SafetensorError, match="huge_pages must be True or False"):
        fastst.read_options(huge_pages=1)


THP_CHOICES = {"enabled": ["always", "madvise", "never"],
               "defrag": ["always", "defer", "defer+madvise", "madvise", "never"]}


def fake_thp_settings(tmp_path, enabled, defrag, free_2mib_blocks=0):
    """A folder of transparent huge page settings as the kernel shows them, and a
    buddyinfo file with `free_2mib_blocks` free blocks of 2 MiB (and some in the DMA
    zone, which serves no process)."""
    folder = tmp_path / f"thp-{enabled}-{defrag}"
    folder.mkdir(exist_ok=True)
    for name, chosen in (("enabled", enabled), ("defrag", defrag)):
        (folder / name).write_text(" ".join(f"[{choice}]" if choice == chosen else choice
                                            for choice in THP_CHOICES[name]) + "\n")
    buddyinfo = tmp_path / f"buddyinfo-{free_2mib_blocks}"
    buddyinfo.write_text(
        "Node 0, zone      DMA      0      0      0      0      0      0      0      0"
        "      1      1      3 \n"
        "Node 0, zone   Normal   5433   1572   1714   3459   1446   1218    944   1197"
        f"    524 {free_2mib_blocks:6d}      0 \n")
    return str(folder), str(buddyinfo)


@pytest.fixture
def thp_settings():
    """use_huge_page_settings, given back to the machine's own at the end."""
    yield use_huge_page_settings
    use_huge_page_settings()


@pytest.mark.parametrize("enabled, defrag, advice", [
    ("never", "madvise", "never"),           # no huge pages
    ("always", "madvise", "never"),          # huge pages unadvised; advice would compact
    ("always", "defer", "never"),
    ("madvise", "defer", "always"),          # an advised fault never compacts
    ("madvise", "never", "always"),
    ("madvise", "madvise", "while free"),    # an advised fault compacts when none is free
    ("madvise", "defer+madvise", "while free"),
    ("madvise", "always", "while free"),
])
def test_huge_page_advice_follows_the_kernels_settings(tmp_path, thp_settings, enabled,
                                                       defrag, advice):
    folder, buddyinfo = fake_thp_settings(tmp_path, enabled, defrag)
    assert thp_settings(folder, buddyinfo) == advice
    assert thp_settings(str(tmp_path / "missing")) == "never"


def test_free_huge_page_bytes_counts_blocks_of_2_mib_or_more_outside_dma(tmp_path):
    _, buddyinfo = fake_thp_settings(tmp_path, "madvise", "madvise", free_2mib_blocks=7)
    if os.sysconf("SC_PAGE_SIZE") != 4096:
        pytest.skip("the fake free lists are of 4 KiB pages")
    assert free_huge_page_bytes(buddyinfo) == 7 * 2 * MIB
    assert free_huge_page_bytes(str(tmp_path / "missing")) == 0


@LINUX_ONLY
@pytest.mark.skipif(not THP or os.sysconf("SC_PAGE_SIZE") != 4096,
                    reason="no transparent huge pages, or pages other than 4 KiB")
@pytest.mark.parametrize("enabled, defrag, free_2mib_blocks, advised", [
    ("madvise", "defer", 0, [True, True]),
    ("madvise", "madvise", 0, [False, False]),
    ("madvise", "madvise", 1000, [True, True]),
    ("madvise", "madvise", 13, [True, False]),  # twice 12 MiB free, then 14 MiB left
    ("always", "madvise", 1000, [False, False]),
    ("never", "defer", 1000, [False, False]),
])
def test_fresh_arrays_are_advised_huge_pages_as_the_settings_and_free_memory_allow(
        tmp_path, thp_settings, enabled, defrag, free_2mib_blocks, advised):
    """Where an advised fault would compact memory when no 2 MiB is free, an array is
    advised only while free 2 MiB blocks hold twice its size, less the arrays advised
    since free memory was read; elsewhere, as the settings say."""
    path = str(tmp_path / "two.safetensors")
    fastst.save_file({"a": np.ones(3 * MIB, np.float32), "b": np.ones(3 * MIB, np.float32)},
                     path)
    thp_settings(*fake_thp_settings(tmp_path, enabled, defrag, free_2mib_blocks))
    loaded = fastst.load_file(path, copy=True)
    assert [handler_of(loaded[name]) for name in "ab"] == ["fastst_huge_pages"] * 2
    assert [("hg" in flags_of_memory_at(loaded[name].ctypes.data)) for name in "ab"] == advised
    assert all((loaded[name] == 1).all() for name in "ab")


def test_memory_of_big_fresh_arrays_goes_back_when_they_are_freed(tmp_path):
    """Each big array is a mapping of its own: freeing it gives its memory back."""
    path = str(tmp_path / "many.safetensors")
    fastst.save_file({f"t{k}": np.full(2 * MIB, k, np.float32) for k in range(16)}, path)

    def rss():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("RSS is read from /proc")
    fastst.load_file(path, copy=True)       # first use: imports, caches
    before = rss()
    loaded = fastst.load_file(path, copy=True)
    held = rss() - before
    del loaded
    assert held >= 120 * MIB and rss() - before < 8 * MIB
