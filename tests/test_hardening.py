"""Hostile paths, concurrency, crashes mid-save and files that change underneath."""
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastst
from conftest import WRITABLE_DTYPES, cpu_beside, random_array, same_bytes
from pages import descriptors_on, open_descriptors, opened_since

# ---------------------------------------------------------------------------
# Paths that are not regular files
# ---------------------------------------------------------------------------


def run_python(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout)


def test_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(fastst.SafetensorError, match="no model.safetensors.index.json"):
        fastst.safe_open(tmp_path)


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_character_devices_are_refused_at_once(device):
    with pytest.raises(fastst.SafetensorError, match="not a regular file"):
        fastst.load_file(device)


def test_fifo_without_writer_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    out = run_python(f"""
        import fastst
        try:
            fastst.safe_open({str(fifo)!r})
        except fastst.SafetensorError as error:
            print("refused:", error)
    """, timeout=20)
    assert "refused:" in out.stdout and "not a regular file" in out.stdout, out.stderr


def test_dangling_symlink_is_file_not_found(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError):
        fastst.load_file(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_permission_error(tmp_path):
    path = tmp_path / "secret.safetensors"
    fastst.save_file({"x": np.ones(1)}, path)
    path.chmod(0)
    with pytest.raises(PermissionError):
        fastst.load_file(path)


# ---------------------------------------------------------------------------
# Bounded resources
# ---------------------------------------------------------------------------


def mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_opening_10000_files_leaks_no_descriptor_or_mapping(tmp_path, backend):
    path = tmp_path / "leak.safetensors"
    fastst.save_file({"a": np.arange(10.0), "b": np.ones((3, 3), np.int8)}, path)
    gc.collect()    # what earlier tests dropped closes now, not during the count
    fds, maps = open_descriptors(), mappings()
    for i in range(10_000):
        if i % 2:
            with fastst.safe_open(path, backend=backend) as f:
                f.get_tensor("a")
        else:
            fastst.safe_open(path, backend=backend).get_tensor("b")   # dropped unclosed
    assert descriptors_on(path) == 0
    assert opened_since(fds) == {}
    assert mappings() <= maps + 2


def test_huge_claimed_shape_fails_before_allocating(tmp_path):
    from helpers import raw_file
    data = raw_file({"x": {"dtype": "F32", "shape": [1 << 40],
                           "data_offsets": [0, 1 << 42]}})
    path = tmp_path / "huge.safetensors"
    path.write_bytes(data)
    out = run_python(f"""
        import resource, fastst, fastst._api
        # 1 GiB past what the process holds: a free-threaded Python's allocator
        # reserves about a GiB of address space before anything is read
        held = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
        resource.setrlimit(resource.RLIMIT_AS, (held + (1 << 30), held + (1 << 30)))
        for backend in ("mmap", "pread"):
            try:
                fastst.load_file({str(path)!r}, backend=backend)
            except fastst.SafetensorError as error:
                print("refused:", error)
    """)
    assert out.stdout.count("refused:") == 2 and "the file is truncated" in out.stdout, out.stderr


# ---------------------------------------------------------------------------
# Concurrency
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_threads_share_a_handle_while_another_closes_it(tmp_path, backend):
    path = tmp_path / "shared.safetensors"
    tensors = {f"t{i}": np.full((64, 64), i, dtype=np.float32) for i in range(16)}
    fastst.save_file(tensors, path)
    handle = fastst.safe_open(path, backend=backend)
    problems, reads = [], [0] * 8
    start = threading.Barrier(9)

    def reader(k):
        start.wait()
        rng = random.Random(k)
        while True:
            i = rng.randrange(16)
            try:
                if rng.random() < 0.5:
                    value = handle.get_tensor(f"t{i}")
                else:
                    value = handle.get_slice(f"t{i}")[rng.randrange(64)]
            except fastst.SafetensorError as error:
                if "closed" not in str(error):
                    problems.append(repr(error))
                return
            except Exception as error:  # noqa: BLE001 - any other type is a failure
                problems.append(repr(error))
                return
            if not (value == i).all():
                problems.append(f"wrong data for t{i}")
                return
            reads[k] += 1

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    start.wait()
    time.sleep(0.3)
    handle.close()
    for thread in threads:
        thread.join(timeout=30)
    assert problems == []
    assert all(count > 0 for count in reads)


def test_parallel_saves_to_different_files(tmp_path, rng):
    tensors = [{f"w{k}": random_array(rng, np.dtype(np.float32), (256, 257)) for k in range(4)}
               for _ in range(6)]
    errors = []

    def save(i):
        try:
            for _ in range(5):
                fastst.save_file(tensors[i], tmp_path / f"m{i}.safetensors")
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for i, expected in enumerate(tensors):
        loaded = fastst.load_file(tmp_path / f"m{i}.safetensors")
        assert all(same_bytes(loaded[name], array) for name, array in expected.items())


def test_save_releases_the_gil_while_writing(tmp_path):
    """Another thread keeps running while a large tensor is written."""
    big = {"big": np.ones(384 << 20, dtype=np.uint8)}

    def save_twice():
        fastst.save_file(big, tmp_path / "big.safetensors")
        fastst.save(big)

    work_cpu, other_cpu = cpu_beside(save_twice)
    assert work_cpu > 0.1
    assert other_cpu > work_cpu / 2, (other_cpu, work_cpu)


@pytest.mark.skipif(not getattr(sys, "_is_gil_enabled", lambda: True)(),
                    reason="no GIL to hold: the interpreter is free-threaded")
def test_a_call_that_holds_the_gil_leaves_the_other_thread_no_cpu():
    """What the tests above measure: a C call that keeps the GIL (bytes.count) is seen."""
    data = bytes(512 << 20)
    work_cpu, other_cpu = cpu_beside(lambda: data.count(b"\1"))
    assert work_cpu > 0.05
    assert other_cpu < work_cpu / 2, (other_cpu, work_cpu)


# ---------------------------------------------------------------------------
# Crash safety of saves
# ---------------------------------------------------------------------------

SAVER = """
import sys
import numpy as np
import fastst
path = sys.argv[1]
versions = [{"w": np.full(8 << 20, v, dtype=np.float32), "v": np.array([v])} for v in (1, 2)]
print("ready", flush=True)
i = 0
while True:
    fastst.save_file(versions[i % 2], path, metadata={"version": str(i % 2 + 1)})
    i += 1
"""


def test_save_file_killed_at_random_moments_never_corrupts_the_old_file(tmp_path):
    check_kills_leave_a_whole_file(tmp_path, SAVER, rounds=20, seed=7)


def check_kills_leave_a_whole_file(tmp_path, saver, rounds, seed):
    """Kill `saver` (a script that prints "ready", then saves versions 1 and 2 of
    model.safetensors, its tensor "w" all that version, over and over) at random
    moments: the file always holds one whole version."""
    path = tmp_path / "model.safetensors"
    fastst.save_file({"w": np.full(8 << 20, 0, dtype=np.float32), "v": np.array([0])}, path)
    rng = random.Random(seed)
    for _ in range(rounds):
        child = subprocess.Popen([sys.executable, "-c", saver, str(path)], stdout=subprocess.PIPE)
        assert child.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        loaded = fastst.load_file(path)
        version = int(loaded["v"][0])
        assert version in (0, 1, 2)
        assert (loaded["w"] == version).all()
    leftovers = [name for name in os.listdir(tmp_path) if name != "model.safetensors"]
    assert all(name.startswith(".model.safetensors.") and name.endswith(".fastst-tmp")
               for name in leftovers)


# ---------------------------------------------------------------------------
# Files that change underneath
# ---------------------------------------------------------------------------


def test_pread_backend_reports_truncation_instead_of_crashing(tmp_path):
    path = tmp_path / "t.safetensors"
    fastst.save_file({"a": np.ones(1000), "b": np.ones(1000)}, path)
    with fastst.safe_open(path, backend="pread") as f:
        os.truncate(path, os.path.getsize(path) - 4000)
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.get_tensor(f.offset_keys()[-1])
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.get_slice(f.offset_keys()[-1])[900:]


def test_pread_backend_sees_a_rewrite_only_after_reopening(tmp_path):
    path = tmp_path / "r.safetensors"
    fastst.save_file({"a": np.zeros(4)}, path)
    with fastst.safe_open(path, backend="pread") as f:
        fastst.save_file({"a": np.ones(4)}, path)   # atomic rename: the open file is unchanged
        assert f.get_tensor("a").tolist() == [0.0] * 4
    assert fastst.load_file(path, backend="pread")["a"].tolist() == [1.0] * 4


def test_mmap_views_of_a_file_truncated_by_another_process_fault(tmp_path):
    """Documented limit of memory maps (here as in every mmap reader, the reference
    included): touching pages that a truncation removed raises SIGBUS. The pread
    backend exists for files that may change while open."""
    path = tmp_path / "m.safetensors"
    fastst.save_file({"a": np.ones(1 << 20)}, path)
    out = run_python(f"""
        import os, fastst
        a = fastst.load_file({str(path)!r})["a"]
        os.truncate({str(path)!r}, 4096)
        print(a.sum())
    """)
    assert out.returncode == -signal.SIGBUS


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8"), min_size=0, max_size=12).filter(
    lambda name: name != "__metadata__")
shapes = st.lists(st.integers(0, 4), max_size=3).map(tuple)
entries = st.dictionaries(names, st.tuples(st.sampled_from(sorted(WRITABLE_DTYPES)), shapes),
                          max_size=6)
metadata = st.one_of(st.none(), st.dictionaries(st.text(st.characters(codec="utf-8")),
                                                st.text(st.characters(codec="utf-8")),
                                                max_size=3))


@settings(max_examples=150, deadline=None)
@given(spec=entries, meta=metadata, seed=st.integers(0, 2**32 - 1))
def test_any_valid_dict_round_trips(spec, meta, seed):
    rng = np.random.default_rng(seed)
    tensors = {name: random_array(rng, WRITABLE_DTYPES[code], shape)
               for name, (code, shape) in spec.items()}
    data = fastst.save(tensors, metadata=meta)
    loaded = fastst.load(data)
    assert loaded.keys() == tensors.keys()
    assert all(same_bytes(loaded[name], array) for name, array in tensors.items())
    reader = fastst._core.Reader()
    reader.open_buffer(data)
    assert reader.metadata() == meta


@pytest.fixture(scope="module")
def valid_file():
    rng = np.random.default_rng(3)
    return fastst.save({f"t{i}": random_array(rng, dtype, (2, 3))
                        for i, dtype in enumerate(WRITABLE_DTYPES.values())},
                       metadata={"k": "v"})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 10_000), value=st.integers(0, 255))
def test_any_single_byte_corruption_loads_or_raises_safetensor_error(valid_file, position, value):
    data = bytearray(valid_file)
    data[position % len(data)] = value
    try:
        loaded = fastst.load(bytes(data))
    except fastst.SafetensorError:
        return
    for array in loaded.values():
        array.tobytes()
