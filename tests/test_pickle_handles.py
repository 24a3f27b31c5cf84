"""Handles pickle by reopening the same file, so that they pass to spawned workers
and process pools; a forked child reads correctly through an inherited handle."""
import multiprocessing
import os
import pickle

import numpy as np
import pytest

import fastst

BACKENDS = ["mmap", "pread"]
# JAX, when a test before this one imported it, warns at every fork
FORK_WARNING = pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")


@pytest.fixture
def tensors():
    return {"x": np.arange(4096 * 8, dtype=np.float32).reshape(4096, 8),
            "y": np.arange(4096, dtype=np.int64)}


@pytest.fixture
def path(tmp_path, tensors):
    target = tmp_path / "data.safetensors"
    fastst.save_file(tensors, target, metadata={"kind": "rows"})
    return target


def contents(handle):
    """What a worker sends back: every tensor, and a gather of a few rows."""
    return {"tensors": {name: np.array(handle.get_tensor(name)) for name in handle.keys()},
            "gathered": np.asarray(handle.gather("x", [5, -1, 5, 0])),
            "backend": handle.backend, "source": handle.source}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_pickles_by_reopening_the_file(path, tensors, backend):
    with fastst.safe_open(path, backend=backend) as f:
        copy = pickle.loads(pickle.dumps(f))
    with copy:
        assert isinstance(copy, fastst.NumpyHandle)
        assert copy.backend == backend and copy.metadata() == {"kind": "rows"}
        for name, array in tensors.items():
            np.testing.assert_array_equal(copy.get_tensor(name), array)


def test_a_relative_path_is_reopened_from_where_it_was_opened(path, tensors, monkeypatch,
                                                              tmp_path):
    monkeypatch.chdir(path.parent)
    with fastst.safe_open(path.name) as f:
        payload = pickle.dumps(f)
    monkeypatch.chdir(tmp_path.parent)
    with pickle.loads(payload) as copy:
        assert copy.source == str(path)
        np.testing.assert_array_equal(copy.get_tensor("y"), tensors["y"])


def test_a_torch_handle_keeps_framework_and_device(path, tensors):
    torch = pytest.importorskip("torch")
    with fastst.safe_open(path, framework="pt", device="cpu", backend="pread") as f:
        copy = pickle.loads(pickle.dumps(f))
    with copy:
        assert isinstance(copy, fastst.FrameworkHandle) and copy.backend == "pread"
        tensor = copy.get_tensor("x")
        assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
        np.testing.assert_array_equal(tensor.numpy(), tensors["x"])


def test_a_rewritten_file_is_refused(path, tensors):
    with fastst.safe_open(path) as f:
        payload = pickle.dumps(f)
    fastst.save_file({name: array + 1 for name, array in tensors.items()}, path,
                     metadata={"kind": "rows"})
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # whatever the clock
    with pytest.raises(fastst.SafetensorError, match="file changed since the handle was pickled"):
        pickle.loads(payload)


def test_a_file_changed_in_place_is_refused(path):
    """Same inode and size: the modification time tells."""
    with fastst.safe_open(path, backend="pread") as f:
        payload = pickle.dumps(f)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(fastst.SafetensorError, match=str(path)):
        pickle.loads(payload)


def test_a_missing_file_is_an_os_error(path):
    with fastst.safe_open(path) as f:
        payload = pickle.dumps(f)
    os.remove(path)
    with pytest.raises(FileNotFoundError):
        pickle.loads(payload)


def test_closed_buffer_and_hand_made_handles_do_not_pickle(path):
    f = fastst.safe_open(path)
    f.close()
    with pytest.raises(fastst.SafetensorError, match="closed"):
        pickle.dumps(f)
    buffer_handle = fastst.NumpyHandle()
    buffer_handle.open_buffer(path.read_bytes())
    with pytest.raises(fastst.SafetensorError, match="buffer cannot be pickled"):
        pickle.dumps(buffer_handle)
    with fastst.safe_open(path) as reader:
        hand_made = fastst.FrameworkHandle(reader, lambda array, name, info: array)
        with pytest.raises(fastst.SafetensorError, match="only a handle from safe_open"):
            pickle.dumps(hand_made)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_passes_to_a_spawned_pool(path, tensors, backend):
    with fastst.safe_open(path, backend=backend) as f, \
            multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply_async(contents, (f,)).get(timeout=120)
    assert result["backend"] == backend and result["source"] == str(path)
    for name, array in tensors.items():
        np.testing.assert_array_equal(result["tensors"][name], array)
    np.testing.assert_array_equal(result["gathered"], tensors["x"][[5, -1, 5, 0]])


def send_contents(handle, connection):
    connection.send(contents(handle))
    connection.close()


@FORK_WARNING
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forked_child_reads_through_the_inherited_handle(path, tensors, backend):
    """No pickling here: the child uses the parent's handle (its map, or its
    descriptor, which pread shares without a file position)."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    with fastst.safe_open(path, backend=backend) as f:
        f.get_tensor("x")
        child = context.Process(target=send_contents, args=(f, sender))
        child.start()
        sender.close()
        assert receiver.poll(120), "the forked child sent nothing"
        result = receiver.recv()
        child.join(60)
        # the parent's handle still reads after the child is gone
        np.testing.assert_array_equal(f.gather("y", [3, 1]), [3, 1])
    assert child.exitcode == 0
    for name, array in tensors.items():
        np.testing.assert_array_equal(result["tensors"][name], array)
    np.testing.assert_array_equal(result["gathered"], tensors["x"][[5, -1, 5, 0]])


def corrupt_first_byte_of(path, name):
    with fastst.safe_open(path) as f:
        at = f.data_start + f.info(name).data_offsets[0]
    with open(path, "r+b") as file:
        file.seek(at)
        byte = file.read(1)
        file.seek(at)
        file.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_verifying_handle_pickles_as_one(tmp_path, tensors, framework):
    pytest.importorskip("xxhash")
    if framework == "pt":
        pytest.importorskip("torch")
    path = tmp_path / "checked.safetensors"
    fastst.save_file(tensors, path, checksum="xxh3_64")
    corrupt_first_byte_of(path, "x")
    with fastst.safe_open(path, framework, verify=True) as f:
        copy = pickle.loads(pickle.dumps(f))
    with copy:
        assert type(copy) is type(f)
        np.testing.assert_array_equal(np.asarray(copy.gather("y", [2, 0])), [2, 0])
        with pytest.raises(fastst.SafetensorError, match="tensor 'x': checksum mismatch"):
            copy.gather("x", [0])


def rows_of(handle, first, last):
    return handle.read_rows("x", first, last), os.getpid()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_handle_passes_to_joblib_workers(path, tensors, backend):
    joblib = pytest.importorskip("joblib")
    with fastst.safe_open(path, backend=backend) as f, \
            joblib.Parallel(n_jobs=2, backend="loky", timeout=120) as parallel:
        results = parallel(joblib.delayed(rows_of)(f, first, first + 512)
                           for first in range(0, 4096, 512))
    rows = np.concatenate([np.asarray(part) for part, _ in results])
    np.testing.assert_array_equal(rows, tensors["x"])
    assert os.getpid() not in {pid for _, pid in results}
