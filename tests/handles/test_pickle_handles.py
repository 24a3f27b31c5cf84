"""Handles pickle by reopening the same file, so that they pass to spawned workers
and process pools; a forked child reads correctly through an inherited handle."""
import importlib
import importlib.util
import io
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


def test_a_handle_that_hands_out_bits_pickles_as_one(tmp_path):
    """A reader that leaves ml_dtypes out (torch's, a loader's of torch batches) gives
    the bits of bfloat16 tensors after pickling too, from a file and from a checkpoint."""
    from fastst.checkpoint import open_checkpoint

    ml_dtypes = pytest.importorskip("ml_dtypes")
    rows = np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 2)
    single, folder = tmp_path / "bits.safetensors", tmp_path / "sharded"
    fastst.save_file({"b": rows, "i": np.arange(3, dtype=np.int32)}, single)
    fastst.save_file({"b": rows, "i": np.arange(3, dtype=np.int32)}, folder, max_shard_size=8)
    for target in (single, folder):
        with open_checkpoint(target, opened_as=("np", "cpu"), uses_ml_dtypes=False) as f:
            copy = pickle.loads(pickle.dumps(f))
        with copy:
            bits = copy.get_tensor("b")
            assert bits.dtype == np.dtype("<u2"), target
            assert bits.tobytes() == rows.tobytes()


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


# --- every public object: where its class lives, and whether it pickles -----------------

PUBLIC_MODULES = ["fastst", "fastst.numpy", "fastst.torch", "fastst.writer", "fastst.checkpoint",
                  "fastst.integrity", "fastst.state", "fastst.data", "fastst.flax", "fastst.jax",
                  "fastst.dask"]
NEEDS = {"fastst.torch": "torch", "fastst.flax": "jax", "fastst.jax": "jax",
         "fastst.dask": "dask"}


def public_names(module_name):
    module = importlib.import_module(module_name)
    names = list(module.__all__)
    if module_name == "fastst.data" and importlib.util.find_spec("torch"):
        names.append("RowDataset")    # made on first use, with torch
    return [(f"{module_name}.{name}", getattr(module, name)) for name in names]


def found_at(obj):
    """What pickle finds under the name an object says it has."""
    found = importlib.import_module(obj.__module__)
    for part in obj.__qualname__.split("."):
        found = getattr(found, part)
    return found


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_public_class_says_which_fastst_module_holds_it(module_name):
    if module_name in NEEDS:
        pytest.importorskip(NEEDS[module_name])
    wrong = [f"{path}: {obj.__module__}" for path, obj in public_names(module_name)
             if callable(obj) and obj.__module__ != "builtins"
             and not (obj.__module__.partition(".")[0] == "fastst" and found_at(obj) is obj)]
    assert wrong == []


def made_objects(tmp_path):
    """(what, object) for the objects users get from fastst: handles, slices, infos,
    specs, writers and what they hand out, errors."""
    from fastst import checkpoint, data, writer
    path = tmp_path / "objects.safetensors"
    fastst.save_file({"x": np.arange(12.0).reshape(4, 3), "y": np.ones(4, np.int8)}, path,
                     checksum="xxh3_64")
    folder = tmp_path / "checkpoint"
    fastst.save_file({"a": np.zeros(100), "b": np.ones(100)}, folder, max_shard_size=800)
    numpy_handle = fastst.safe_open(path)
    sharded = fastst.safe_open(folder)
    stream = writer.StreamWriter(tmp_path / "streamed.safetensors",
                                 writer.declared_specs({"s": ("F32", (2, 3))}))
    made = [("NumpyHandle", numpy_handle),
            ("pread handle", fastst.safe_open(path, backend="pread")),
            ("VerifyingHandle", fastst.safe_open(path, verify=True)),
            ("SafeSlice", numpy_handle.get_slice("x")),
            ("pread SafeSlice", fastst.safe_open(path, backend="pread").get_slice("x")),
            ("TensorInfo", numpy_handle.info("x")), ("DtypeInfo", fastst.DTYPES[0]),
            ("NumpyShardedHandle", sharded), ("a shard's SafeSlice", sharded.get_slice("b")),
            ("CheckpointIndex", sharded.index),
            ("file object handle", fastst.safe_open(io.BytesIO(path.read_bytes()))),
            ("TensorSpec", fastst.TensorSpec(dtype="float32", shape=[1], data_ptr=0, data_len=4)),
            ("WriteSpec", writer.WriteSpec("w", "F32", [2], None)),
            ("WritePlan", writer.plan_write([writer.spec_of_array("w", np.zeros(2))], None)),
            ("TensorRegion", stream.region("s")), ("StreamWriter", stream),
            ("ShardEntry", checkpoint.ShardEntry(writer.WriteSpec("w", "F32", [2], None), 8,
                                                 None)),
            ("Rows", data.Rows(path, ["x"])),
            ("SafetensorIndexError", fastst.SafetensorIndexError("x: index 9")),
            ("missing file", _missing_file_error(tmp_path))]
    if importlib.util.find_spec("torch"):
        torch_handle = fastst.safe_open(path, framework="pt")
        torch_checkpoint = fastst.safe_open(folder, framework="pt")
        made += [("FrameworkHandle", torch_handle),
                 ("torch SafeSlice", torch_handle.get_slice("x")),
                 ("torch ShardedHandle", torch_checkpoint),
                 ("torch shard's SafeSlice", torch_checkpoint.get_slice("a")),
                 ("RowDataset", data.RowDataset(path, ["x"]))]
    return made, stream


def _missing_file_error(tmp_path):
    try:
        fastst.safe_open(tmp_path / "missing.safetensors")
    except FileNotFoundError as error:
        return error


def test_what_users_get_pickles_or_says_why_not(tmp_path):
    made, stream = made_objects(tmp_path)
    refused = {}
    try:
        for what, obj in made:
            assert type(obj).__module__.partition(".")[0] in ("fastst", "builtins"), what
            try:
                payload = pickle.dumps(obj)
            except TypeError as error:
                refused[what] = str(error)
                continue
            copy = pickle.loads(payload)
            assert type(copy) is type(obj), what
            if hasattr(obj, "shape") and hasattr(obj, "__getitem__") and not isinstance(obj, tuple):
                np.testing.assert_array_equal(np.asarray(copy[1:3]), np.asarray(obj[1:3]))
            elif isinstance(obj, (tuple, BaseException)):
                assert repr(copy) == repr(obj), what
    finally:
        stream.abort()
    # what cannot be pickled says so, and why
    assert sorted(refused) == ["StreamWriter", "file object handle"]
    assert "a StreamWriter cannot be pickled: it owns the file" in refused["StreamWriter"]
    assert "a handle on a file object cannot be pickled" in refused["file object handle"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slice_pickles_as_its_handle_and_reads_the_same(path, tensors, backend):
    with fastst.safe_open(path, backend=backend) as f:
        part = f.get_slice("x")
        copy = pickle.loads(pickle.dumps(part))
    assert copy.get_shape() == [4096, 8] and copy._reader.backend == backend
    np.testing.assert_array_equal(copy[10:20, ::2], tensors["x"][10:20, ::2])


def test_a_slice_made_with_a_converter_and_no_handle_says_why_it_does_not_pickle(path):
    with fastst.safe_open(path) as f:
        part = fastst.SafeSlice(f, "x", lambda array, name, info: array)
        with pytest.raises(TypeError, match="pickle the handle, and call get_slice on it"):
            pickle.dumps(part)
