"""fastst.dask: lazy dask arrays over a file's tensors, read by row ranges, and dask
arrays written chunk by chunk into one file; on the threaded scheduler and on a
two-process dask.distributed cluster."""
import os
import pickle

import numpy as np
import pytest

import fastst
from fastst.writer import WriteSpec, serialize

from conftest import WRITABLE_DTYPES, modules_loaded_by, random_array, same_bytes

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
cloudpickle = pytest.importorskip("cloudpickle")
fastst_dask = pytest.importorskip("fastst.dask")
from fastst.dask import from_safetensors, to_safetensors  # noqa: E402

ROWS, COLUMNS = 100, 12


@pytest.fixture
def tensors():
    return {"x": np.arange(ROWS * COLUMNS, dtype=np.float32).reshape(ROWS, COLUMNS),
            "y": np.arange(ROWS, dtype=np.int64),
            "z": np.arange(24, dtype=np.int16).reshape(2, 3, 4)}


@pytest.fixture
def path(tmp_path, tensors):
    target = tmp_path / "data.safetensors"
    fastst.save_file(tensors, target)
    return target


@pytest.fixture
def reads(monkeypatch):
    """Every (tensor, first, last) read through an open NumPy handle."""
    seen = []
    original = fastst.NumpyHandle.read_rows

    def counting(self, name, first, last):
        seen.append((name, first, last))
        return original(self, name, first, last)

    monkeypatch.setattr(fastst.NumpyHandle, "read_rows", counting)
    return seen


@pytest.fixture
def opens(monkeypatch):
    """The files opened by NumPy handles, one entry an opening."""
    opened = []
    original = fastst.NumpyHandle.open_file

    def counting(self, filename, *args, **kwargs):
        opened.append(os.fsdecode(filename))
        return original(self, filename, *args, **kwargs)

    monkeypatch.setattr(fastst.NumpyHandle, "open_file", counting)
    return opened


def task_arguments(array):
    """Every argument of every task of `array`'s graph, nested tuples opened."""
    found = []

    def walk(value):
        if isinstance(value, (tuple, list)):
            for item in value:
                walk(item)
        else:
            found.append(value)
    for task in dict(array.__dask_graph__()).values():
        walk(task)
    return found


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def test_a_tensor_reads_as_a_dask_array(path, tensors):
    x = from_safetensors(path, "x", chunks=30)
    assert isinstance(x, da.Array)
    assert x.chunks == ((30, 30, 30, 10), (COLUMNS,)) and x.dtype == np.float32
    np.testing.assert_array_equal(x.compute(), tensors["x"])
    assert float(x.sum(dtype=np.float64).compute()) == tensors["x"].sum(dtype=np.float64)
    np.testing.assert_array_equal(x[::7, 3].compute(), tensors["x"][::7, 3])


def test_name_none_gives_every_tensor_in_file_order(path, tensors):
    arrays = from_safetensors(path)
    with fastst.safe_open(path) as f:
        assert list(arrays) == f.offset_keys()
    for name, array in arrays.items():
        np.testing.assert_array_equal(array.compute(), tensors[name])


def test_a_list_of_names_gives_those_tensors(path, tensors):
    arrays = from_safetensors(path, ["z", "y"], chunks=1)
    assert list(arrays) == ["z", "y"]
    assert arrays["z"].chunks == ((1, 1), (3,), (4,))
    np.testing.assert_array_equal(arrays["z"].compute(), tensors["z"])


def test_a_sharded_checkpoint_reads_each_tensor_from_its_shard(tmp_path, tensors):
    folder = tmp_path / "checkpoint"
    fastst.save_file(tensors, folder, max_shard_size=1000)
    assert len(list(folder.glob("*.safetensors"))) > 1
    arrays = from_safetensors(folder, chunks=7)
    assert sorted(arrays) == sorted(tensors)
    for name, array in arrays.items():
        np.testing.assert_array_equal(array.compute(), tensors[name])
    x = from_safetensors(folder / "model.safetensors.index.json", "x", chunks=50)
    np.testing.assert_array_equal(x.compute(), tensors["x"])


def test_the_graph_holds_no_open_file_and_pickles_small(path, tensors):
    x = from_safetensors(path, "x", chunks=1)
    arguments = task_arguments(x)
    assert not any(isinstance(value, fastst.NumpyHandle) for value in arguments)
    chunks = [value for value in arguments if isinstance(value, fastst_dask.Chunk)]
    assert sorted((chunk.first, chunk.last) for chunk in chunks) == [(i, i + 1)
                                                                     for i in range(ROWS)]
    one = len(cloudpickle.dumps(dict(from_safetensors(path, "x", chunks=ROWS).__dask_graph__())))
    every_row = len(cloudpickle.dumps(dict(x.__dask_graph__())))
    # the file's identity is pickled once; each further chunk adds its key and rows
    assert one < 1000 and (every_row - one) / (ROWS - 1) < 120
    copy = pickle.loads(cloudpickle.dumps(x))
    np.testing.assert_array_equal(copy.compute(), tensors["x"])


def test_only_the_chunks_asked_for_are_read(path, tensors, reads):
    x = from_safetensors(path, "x", chunks=30)
    assert reads == []
    np.testing.assert_array_equal(x[35:45].compute(), tensors["x"][35:45])
    assert reads == [("x", 30, 60)]
    np.testing.assert_array_equal(x[-1].compute(), tensors["x"][-1])
    assert reads[1:] == [("x", 90, 100)]


def test_a_process_opens_the_file_once_for_all_its_chunks(path, tensors, opens):
    x = from_safetensors(path, "x", chunks=10)
    opens.clear()
    x.compute(scheduler="threads")
    x.compute(scheduler="sync")
    assert opens == [str(path)]
    assert str(path) in fastst_dask.open_files_kept()


@pytest.mark.parametrize("code", sorted(WRITABLE_DTYPES))
def test_every_dtype_reads_bit_exact(tmp_path, rng, code):
    array = random_array(rng, WRITABLE_DTYPES[code], (7, 3))
    target = tmp_path / "one.safetensors"
    fastst.save_file({"t": array}, target)
    dask_array = from_safetensors(target, "t", chunks=3)
    assert dask_array.dtype == array.dtype
    assert same_bytes(dask_array.compute(), array)


@pytest.mark.parametrize("backend", ["pread", "mmap"])
def test_both_local_backends_read(path, tensors, backend):
    x = from_safetensors(path, "x", chunks=16, backend=backend)
    np.testing.assert_array_equal(x.compute(), tensors["x"])


@pytest.mark.parametrize("chunks, rows", [
    ("auto", (ROWS,)),
    (40, (40, 40, 20)),
    (np.int64(50), (50, 50)),
    ("960 B", (20,) * 5),
    ((25, -1), (25,) * 4),
    ((25, None), (25,) * 4),
    ({0: 60}, (60, 40)),
    (((10, 90), (COLUMNS,)), (10, 90)),
    (-1, (ROWS,)),
])
def test_chunks_cut_the_first_axis(path, tensors, chunks, rows):
    x = from_safetensors(path, "x", chunks=chunks)
    assert x.chunks == (rows, (COLUMNS,))
    np.testing.assert_array_equal(x.compute(), tensors["x"])


@pytest.mark.parametrize("chunks, message", [
    ((10, 4), "cut axis 1"),
    ({1: 6}, "cut axis 1"),
    ((10,), "do not fit"),
    (0, "do not fit"),
    (-3, "do not fit"),
    (((10, 10), (COLUMNS,)), "do not fit"),
    ("lots", "do not fit"),
    (2.5, "do not fit"),
])
def test_bad_chunks_are_refused(path, chunks, message):
    with pytest.raises(fastst.SafetensorError, match=f"{path}: tensor 'x': .*{message}"):
        from_safetensors(path, "x", chunks=chunks)


@pytest.mark.parametrize("name", [3, ["x", 3], {"x"}, b"x"])
def test_names_that_are_not_str_are_refused(path, name):
    with pytest.raises(fastst.SafetensorTypeError, match="name must be a tensor name"):
        from_safetensors(path, name)


def test_a_missing_tensor_is_refused(path):
    with pytest.raises(fastst.TensorNotFoundError, match="no tensor named 'w'"):
        from_safetensors(path, "w")
    assert issubclass(fastst.TensorNotFoundError, fastst.SafetensorError)


def test_tensors_without_an_axis_or_of_packed_values_are_refused(tmp_path):
    target = tmp_path / "odd.safetensors"
    target.write_bytes(serialize([
        WriteSpec("scalar", "F32", (), np.ones((), np.float32)),
        WriteSpec("packed", "F4", (4, 2), np.zeros(4, np.uint8)),
        WriteSpec("fine", "F32", (2,), np.ones(2, np.float32))]))
    with pytest.raises(fastst.SafetensorError, match="tensor 'scalar' has no axis"):
        from_safetensors(target, "scalar")
    with pytest.raises(fastst.SafetensorNotImplementedError,
                       match="tensor 'packed' is F4, which packs several values a byte"):
        from_safetensors(target, "packed")
    with pytest.raises(fastst.SafetensorError, match="tensor 'scalar' has no axis"):
        from_safetensors(target)      # every tensor: the caller picks the others by name
    np.testing.assert_array_equal(from_safetensors(target, "fine").compute(), [1, 1])


def test_an_empty_tensor_is_an_empty_array(tmp_path):
    target = tmp_path / "empty.safetensors"
    fastst.save_file({"e": np.zeros((0, 5), np.float32)}, target)
    empty = from_safetensors(target, "e", chunks=4)
    assert empty.shape == (0, 5) and empty.compute().shape == (0, 5)


def rewrite(path, tensors):
    fastst.save_file({name: array + 1 for name, array in tensors.items()}, path)
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # whatever the clock


def test_a_file_changed_before_the_first_read_is_refused(path, tensors):
    x = from_safetensors(path, "x", chunks=30)
    rewrite(path, tensors)
    with pytest.raises(fastst.SafetensorError, match="file changed since"):
        x.compute()


def test_a_file_changed_after_a_read_is_refused(path, tensors):
    x = from_safetensors(path, "x", chunks=30)
    x.compute()                  # the file is now open in this process
    rewrite(path, tensors)
    with pytest.raises(fastst.SafetensorError,
                       match=f"{path}: file changed since the dask array was made"):
        x.compute()
    np.testing.assert_array_equal(from_safetensors(path, "x").compute(), tensors["x"] + 1)


def test_names_are_deterministic_and_follow_the_file(path, tensors):
    first = from_safetensors(path, "x", chunks=30)
    assert from_safetensors(path, "x", chunks=30).name == first.name
    assert from_safetensors(path, "x", chunks=20).name != first.name
    assert from_safetensors(path, "y", chunks=30).name != first.name
    rewrite(path, tensors)
    assert from_safetensors(path, "x", chunks=30).name != first.name


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------


def temp_files(directory):
    return [name for name in os.listdir(directory) if name.endswith(".fastst-tmp")]


def test_dask_arrays_write_the_bytes_save_file_writes(tmp_path, tensors):
    arrays = {name: da.from_array(array, chunks=7) for name, array in tensors.items()}
    to_safetensors(arrays, tmp_path / "dask.safetensors", metadata={"from": "dask"})
    fastst.save_file(tensors, tmp_path / "numpy.safetensors", metadata={"from": "dask"})
    assert (tmp_path / "dask.safetensors").read_bytes() == \
        (tmp_path / "numpy.safetensors").read_bytes()
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("code", sorted(WRITABLE_DTYPES))
def test_every_dtype_round_trips(tmp_path, rng, code):
    array = random_array(rng, WRITABLE_DTYPES[code], (9, 2, 3))
    target = tmp_path / "out.safetensors"
    to_safetensors(da.from_array(array, chunks=(4, 2, 3)), target, name="t")
    assert same_bytes(fastst.load_file(target)["t"], array)
    assert same_bytes(from_safetensors(target, "t", chunks=2).compute(), array)


def test_a_read_then_written_array_round_trips(path, tensors, tmp_path):
    arrays = from_safetensors(path, chunks=13)
    target = tmp_path / "copy.safetensors"
    to_safetensors({name: array * 2 for name, array in arrays.items()}, target)
    for name, array in fastst.load_file(target).items():
        np.testing.assert_array_equal(array, tensors[name] * 2)


def test_chunks_cutting_other_axes_are_written_as_whole_rows(tmp_path, tensors):
    x = da.from_array(tensors["x"], chunks=(7, 5))
    target = tmp_path / "cut.safetensors"
    to_safetensors({"x": x, "z": da.from_array(tensors["z"], chunks=1)}, target)
    loaded = fastst.load_file(target)
    np.testing.assert_array_equal(loaded["x"], tensors["x"])
    np.testing.assert_array_equal(loaded["z"], tensors["z"])


def test_scalars_empty_arrays_and_numpy_arrays_are_written(tmp_path):
    target = tmp_path / "odd.safetensors"
    arrays = {"scalar": da.from_array(np.float64(2.5)), "empty": da.zeros((0, 4), chunks=2),
              "numpy": np.arange(3, dtype=np.uint8)}
    to_safetensors(arrays, target)
    loaded = fastst.load_file(target)
    assert loaded["scalar"] == 2.5 and loaded["scalar"].shape == ()
    assert loaded["empty"].shape == (0, 4)
    np.testing.assert_array_equal(loaded["numpy"], [0, 1, 2])
    to_safetensors({}, target)
    assert fastst.load_file(target) == {}


def test_compute_false_writes_when_computed(tmp_path, tensors):
    target = tmp_path / "later.safetensors"
    pending = to_safetensors(da.from_array(tensors["x"], chunks=10), target, name="x",
                             compute=False)
    assert not target.exists() and len(temp_files(tmp_path)) == 1
    assert pending.compute() is None
    np.testing.assert_array_equal(fastst.load_file(target)["x"], tensors["x"])
    assert temp_files(tmp_path) == []


def failing_block(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 2:
        raise RuntimeError("chunk 2 failed")
    return block


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
def test_a_failed_chunk_leaves_the_old_file(tmp_path, tensors, scheduler):
    target = tmp_path / "kept.safetensors"
    fastst.save_file({"old": np.ones(3)}, target)
    before = target.read_bytes()
    failing = da.from_array(tensors["x"], chunks=10).map_blocks(failing_block, dtype=np.float32)
    with pytest.raises(RuntimeError, match="chunk 2 failed"):
        to_safetensors({"x": failing}, target, scheduler=scheduler)
    assert target.read_bytes() == before and temp_files(tmp_path) == []


@pytest.mark.parametrize("scheduler", ["threads", "sync"])
@pytest.mark.parametrize("chunk_of, message", [
    (lambda block: block[:-1],
     r"the block of rows (0:50|50:100) has shape \(50, 4\), but its piece has shape \(49, 4\)"),
    (lambda block: np.concatenate([block, block[:1]]),
     r"the block of rows (0:50|50:100) has shape \(50, 4\), but its piece has shape \(51, 4\)"),
    (lambda block: block[:, :, None], r"has shape \(50, 4\), but its piece has shape \(50, 4, 1\)"),
    (lambda block: block.astype(np.float32), "must be float64 arrays, got float32 at row (0|50)"),
])
def test_a_chunk_unlike_its_block_is_refused(tmp_path, scheduler, chunk_of, message):
    target = tmp_path / "kept.safetensors"
    fastst.save_file({"old": np.ones(3)}, target)
    before = target.read_bytes()
    array = da.ones((100, 4), chunks=50).map_blocks(chunk_of, dtype=np.float64)
    with pytest.raises(fastst.SafetensorError, match=f"{target}: tensor 'x'.*{message}"):
        to_safetensors({"x": array}, target, scheduler=scheduler)
    assert target.read_bytes() == before and temp_files(tmp_path) == []


def test_arrays_that_cannot_be_written_are_refused(tmp_path):
    target = tmp_path / "refused.safetensors"
    with pytest.raises(fastst.SafetensorNotImplementedError, match="writes local files"):
        to_safetensors({"x": da.zeros(3)}, "s3://bucket/x.safetensors")
    with pytest.raises(fastst.SafetensorTypeError, match="needs a name"):
        to_safetensors(da.zeros(3), target)
    with pytest.raises(fastst.SafetensorTypeError, match="dtype .* has no safetensors code"):
        to_safetensors({"o": da.from_array(np.array(["a", None], dtype=object), chunks=1)}, target)
    unknown = da.zeros(10, chunks=5)
    unknown = unknown[unknown > 1]
    with pytest.raises(fastst.SafetensorError, match="tensor 'u': shape .* is not known"):
        to_safetensors({"u": unknown}, target)
    assert not target.exists() and temp_files(tmp_path) == []


def test_a_region_refuses_pieces_that_do_not_fit(tmp_path):
    with fastst.StreamWriter(tmp_path / "r.safetensors", {"x": ("F32", (4, 3))}) as writer:
        region = pickle.loads(pickle.dumps(writer.region("x")))
        with pytest.raises(fastst.SafetensorError, match="in whole rows; .* cuts axis 1"):
            region[0:2, 0:2] = np.ones((2, 2), np.float32)
        with pytest.raises(fastst.SafetensorTypeError, match="must be float32 arrays"):
            region[0:1] = np.ones((1, 3))
        with pytest.raises(fastst.SafetensorError, match=r"\(2, 3\) does not fit at row 3"):
            region.write(np.ones((2, 3), np.float32), 3)
        region[:] = np.full((4, 3), 5, np.float32)
    np.testing.assert_array_equal(fastst.load_file(tmp_path / "r.safetensors")["x"],
                                  np.full((4, 3), 5))


def test_import_fastst_imports_no_dask():
    assert modules_loaded_by("import fastst, fastst.writer",
                             ("dask", "distributed", "fastst.dask")) == []


# ---------------------------------------------------------------------------
# On a cluster of two worker processes
# ---------------------------------------------------------------------------

GIB_ROWS = 1 << 21          # [GIB_ROWS, 128] float32: 1 GiB
TIMEOUT = 300


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                  dashboard_address="127.0.0.1:0", host="127.0.0.1",
                                  memory_limit="3GiB") as cluster, \
            distributed.Client(cluster, timeout="60s", set_as_default=False) as connected:
        yield connected


@pytest.fixture(scope="module")
def gib_file(tmp_path_factory):
    """1 GiB of float32 small integers (every sum exact in float64), written by
    the streaming writer 64 MiB at a time."""
    target = tmp_path_factory.mktemp("gib") / "big.safetensors"
    step = 1 << 17
    with fastst.StreamWriter(target, {"x": ("F32", (GIB_ROWS, 128))}) as writer:
        for first in range(0, GIB_ROWS, step):
            values = np.arange(first * 128, (first + step) * 128, dtype=np.int64) % 7
            writer.write("x", values.astype(np.float32).reshape(step, 128), first)
    return target


def test_a_reduction_over_1_gib_on_the_cluster_equals_numpy(client, gib_file):
    x = from_safetensors(gib_file, "x")
    assert x.nbytes == 1 << 30 and x.numblocks[0] > 2
    futures = client.compute([x.sum(dtype=np.float64), x.mean(dtype=np.float64)])
    total, mean = (future.result(timeout=TIMEOUT) for future in futures)
    with fastst.safe_open(gib_file) as f:
        data_start = f.data_start
    mapped = np.memmap(gib_file, np.float32, "r", data_start, (GIB_ROWS, 128))
    assert total == np.sum(mapped, dtype=np.float64)
    assert mean == np.mean(mapped, dtype=np.float64)
    del mapped


def test_writing_then_reading_on_the_cluster_round_trips(client, tmp_path, rng):
    source = rng.standard_normal((5000, 64)).astype(np.float32)
    labels = np.arange(5000, dtype=np.int32)
    target = tmp_path / "cluster.safetensors"
    to_safetensors({"x": da.from_array(source, chunks=(600, 32)),
                    "labels": da.from_array(labels, chunks=1000)}, target,
                   metadata={"written": "cluster"}, scheduler=client)
    arrays = from_safetensors(target, chunks=700)
    x, y = (future.result(timeout=TIMEOUT)
            for future in client.compute([arrays["x"], arrays["labels"]]))
    np.testing.assert_array_equal(x, source)
    np.testing.assert_array_equal(y, labels)
    copy = tmp_path / "copy.safetensors"
    client.compute(to_safetensors({"doubled": arrays["x"] * 2}, copy, compute=False)
                   ).result(timeout=TIMEOUT)
    np.testing.assert_array_equal(fastst.load_file(copy)["doubled"], source * 2)
    assert temp_files(tmp_path) == []


def test_a_changed_file_is_refused_on_the_cluster(client, tmp_path, tensors):
    target = tmp_path / "changing.safetensors"
    fastst.save_file(tensors, target)
    x = from_safetensors(target, "x", chunks=10)
    rewrite(target, tensors)
    with pytest.raises(fastst.SafetensorError, match="file changed since"):
        client.compute(x).result(timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# From object stores on the loopback interface
# ---------------------------------------------------------------------------

from servers import http_store, s3_store  # noqa: E402,F401  (fixtures)


def test_chunks_of_a_url_are_ranged_reads_of_their_rows_only(http_store, tensors):
    http_store.objects["/dask.safetensors"] = fastst.save(tensors)
    url = f"{http_store.url}/dask.safetensors"
    x = from_safetensors(url, "x", chunks=25)
    assert x.numblocks[0] == 4
    http_store.reset_counts()
    np.testing.assert_array_equal(x[30:45].compute(scheduler="threads"), tensors["x"][30:45])
    row_bytes = tensors["x"][0].nbytes
    # the chunk holding rows 25..50, and no other: a worker opens the URL (one
    # request for its head) and reads one range
    assert len(http_store.gets()) <= 3
    assert http_store.bytes_sent <= (64 << 10) + 25 * row_bytes
    np.testing.assert_array_equal(from_safetensors(url, "x").compute(), tensors["x"])


def test_a_url_changed_after_the_array_was_made_is_refused(http_store, tensors):
    http_store.objects["/changing.safetensors"] = fastst.save(tensors)
    x = from_safetensors(f"{http_store.url}/changing.safetensors", "x", chunks=50)
    changed = dict(tensors, x=tensors["x"] + 1)
    http_store.objects["/changing.safetensors"] = fastst.save(changed)
    with pytest.raises(fastst.SafetensorError, match="changed"):
        x.compute(scheduler="sync")


def test_an_s3_tensor_sums_on_the_cluster(client, s3_store, rng):
    source = rng.standard_normal((4000, 32)).astype(np.float32)
    url = "s3://fastst/dask/cluster.safetensors"
    fastst.save_file({"x": source}, url, storage_options=s3_store)
    x = from_safetensors(url, "x", chunks=1000, storage_options=s3_store)
    total = client.compute(x.sum(dtype=np.float64)).result(timeout=TIMEOUT)
    assert total == pytest.approx(np.sum(source, dtype=np.float64), rel=1e-12)


def test_a_checkpoint_url_reads_each_tensor_from_its_shard(http_store, tmp_path):
    tensors = {f"layer.{k}": np.arange(k, k + 300, dtype=np.float32).reshape(100, 3)
               for k in range(4)}
    fastst.save_file(tensors, tmp_path, max_shard_size=2500)
    for name in os.listdir(tmp_path):
        http_store.objects[f"/ckpt-dask/{name}"] = (tmp_path / name).read_bytes()
    arrays = from_safetensors(f"{http_store.url}/ckpt-dask/model.safetensors.index.json",
                              chunks=30)
    assert list(arrays) == list(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(arrays[name].compute(scheduler="threads"), array)
