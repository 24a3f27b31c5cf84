"""Batched row gathers (`f.gather`) and the data loaders of fastst.data."""
import os

import numpy as np
import pytest

import fastst

BACKENDS = ["mmap", "pread"]
INTEGER_DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                  np.uint64]


@pytest.fixture
def features():
    return np.arange(1000 * 6, dtype=np.float32).reshape(1000, 6)


@pytest.fixture
def path(tmp_path, features):
    target = tmp_path / "rows.safetensors"
    fastst.save_file({"x": features, "label": np.arange(1000, dtype=np.int64) % 7,
                      "scalar": np.float32(3)}, target)
    return target


def open_each(path):
    """The file through each backend, and as a buffer."""
    handles = [fastst.safe_open(path, backend=backend) for backend in BACKENDS]
    buffer_handle = fastst.NumpyHandle()
    buffer_handle.open_buffer(path.read_bytes())
    return handles + [buffer_handle]


# ---------------------------------------------------------------------------
# f.gather
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", INTEGER_DTYPES)
def test_gather_takes_any_integer_dtype(path, features, dtype):
    rows = np.array([99, 3, 3, 0, 100, 7], dtype)
    for f in open_each(path):
        np.testing.assert_array_equal(f.gather("x", rows), features[rows], err_msg=f.backend)


@pytest.mark.parametrize("rows", [
    [-1, -1000, 5, 999], [5, 4, 3, 2, 1], list(range(10, 90)), [7] * 20,
    list(range(400, 300, -1)) + list(range(0, 50)), [], np.array([], np.uint8),
    [np.int8(3), 1, np.int64(2)], (4, -2), range(5, 0, -2)])
def test_gather_returns_what_numpy_indexing_does(path, features, rows):
    expected = features[np.asarray(rows, dtype=np.intp)]
    for f in open_each(path):
        gathered = f.gather("x", rows)
        assert gathered.shape == expected.shape and gathered.dtype == expected.dtype
        np.testing.assert_array_equal(gathered, expected, err_msg=f.backend)
        assert gathered.flags.c_contiguous and gathered.flags.owndata


def test_gather_fills_out(path, features):
    rows = np.array([10, 2, 999])
    for f in open_each(path):
        out = np.full((3, 6), -1, np.float32)
        assert f.gather("x", rows, out=out) is out
        np.testing.assert_array_equal(out, features[rows])
        with pytest.raises(ValueError, match="shape"):
            f.gather("x", rows, out=np.empty((4, 6), np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            f.gather("x", rows, out=np.empty((6, 3), np.float32).T)


@pytest.mark.parametrize("rows", [[1000], [-1001], [3, 2**70], [-2**64],
                                  np.array([2**63 + 1], np.uint64),
                                  np.array([0, 1, 5000], np.int32)])
def test_gather_refuses_rows_out_of_range(path, rows):
    for f in open_each(path):
        with pytest.raises(fastst.SafetensorIndexError,
                           match=r"tensor 'x': row -?\d+ out of range for 1000 rows") as caught:
            f.gather("x", rows)
        assert isinstance(caught.value, IndexError) and f.source in str(caught.value)


@pytest.mark.parametrize("rows", [[1.5], [[1, 2]], np.array([True, False]), 3, "ab",
                                  [1, [2]]])
def test_gather_refuses_what_is_not_a_list_of_rows(path, rows):
    for f in open_each(path):
        with pytest.raises(fastst.SafetensorTypeError, match="rows must be a 1-d sequence"):
            f.gather("x", rows)


def test_gather_names_the_tensor_it_cannot_gather_from(path):
    for f in open_each(path):
        with pytest.raises(fastst.SafetensorIndexError, match="'scalar' is 0-d"):
            f.gather("scalar", [0])
        with pytest.raises(fastst.TensorNotFoundError):
            f.gather("missing", [0])
        f.close()
        with pytest.raises(fastst.SafetensorError, match="closed"):
            f.gather("x", [0])


def test_gather_from_a_mapped_file_that_shrank_is_an_error_not_a_crash(path):
    with fastst.safe_open(path) as f:
        os.truncate(path, 100)
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.gather("x", [999])


def test_gather_from_a_torch_handle(path, features):
    torch = pytest.importorskip("torch")
    with fastst.safe_open(path, framework="pt", backend="pread") as f:
        tensor = f.gather("x", [4, 1])
        assert isinstance(tensor, torch.Tensor)
        np.testing.assert_array_equal(tensor.numpy(), features[[4, 1]])
        with pytest.raises(TypeError, match="out="):
            f.gather("x", [4, 1], out=np.empty((2, 6), np.float32))


def read_calls() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("syscr:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs /proc/self/io")
def test_pread_gather_reads_adjacent_rows_in_one_call(path, features):
    """400 shuffled adjacent rows (each twice) take a handful of reads; 400 rows
    far apart take one each."""
    adjacent = np.random.default_rng(0).permutation(np.repeat(np.arange(300, 700), 2))
    spread = np.arange(0, 1000, 2)[:400]
    with fastst.safe_open(path, backend="pread") as f:
        calls = []
        for rows in (adjacent, spread):
            before = read_calls()
            np.testing.assert_array_equal(f.gather("x", rows), features[rows])
            calls.append(read_calls() - before)
    assert calls[0] * 20 < calls[1], calls
    assert calls[1] >= 400


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_releases_the_gil(tmp_path, backend):
    from conftest import cpu_beside
    path = tmp_path / "big.safetensors"
    fastst.save_file({"x": np.ones((8192, 1024), np.float32)}, path)
    rows = np.random.default_rng(0).integers(0, 8192, 8192 * 4)
    out = np.empty((rows.size, 1024), np.float32)
    with fastst.safe_open(path, backend=backend) as f:
        f.gather("x", rows, out=out)    # page the file in and the output
        work_cpu, other_cpu = cpu_beside(lambda: f.gather("x", rows, out=out))
    assert out.sum() == out.size
    assert other_cpu > work_cpu / 2, (other_cpu, work_cpu)


# ---------------------------------------------------------------------------
# fastst.data
# ---------------------------------------------------------------------------

def test_importing_fastst_data_needs_no_framework():
    import subprocess
    import sys
    code = ("import sys, fastst; assert 'fastst.data' not in sys.modules\n"
            "import fastst.data as data\n"
            "print(sorted(m for m in ('torch', 'jax') if m in sys.modules), data.Rows.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "Rows"]


def test_rows_gather_every_named_tensor(path, features):
    from fastst.data import Rows
    for backend in BACKENDS:
        with Rows(path, ["x", "label"], backend=backend) as rows:
            assert len(rows) == 1000 and rows.names == ("x", "label")
            x, label = rows.gather(np.array([9, 2, 9], np.uint16))
            np.testing.assert_array_equal(x, features[[9, 2, 9]])
            np.testing.assert_array_equal(label, np.array([9, 2, 9]) % 7)
        with Rows(path, "x", backend=backend) as single:
            np.testing.assert_array_equal(single.gather([-1]), features[[-1]])


def test_rows_refuse_tensors_they_cannot_pair(tmp_path):
    from fastst.data import Rows
    target = tmp_path / "uneven.safetensors"
    fastst.save_file({"a": np.zeros((4, 2)), "b": np.zeros(5), "c": np.float32(1)}, target)
    with pytest.raises(fastst.SafetensorError, match=r"as many rows each.*'a': 4, 'b': 5"):
        Rows(target, ["a", "b"])
    with pytest.raises(fastst.SafetensorError, match="'c' is 0-d"):
        Rows(target, ["a", "c"])
    with pytest.raises(fastst.TensorNotFoundError, match="'d'"):
        Rows(target, ["a", "d"])
    with pytest.raises(fastst.SafetensorError, match="at least one tensor"):
        Rows(target, [])


@pytest.mark.parametrize("batch_size, drop_last, sizes", [
    (300, False, [300, 300, 300, 100]), (300, True, [300, 300, 300]), (1000, True, [1000]),
    (5000, False, [1000])])
def test_batches_cover_every_row_once(path, features, batch_size, drop_last, sizes):
    from fastst.data import batches
    seen = []
    for x, label in batches(path, ["x", "label"], batch_size, shuffle=True, seed=3,
                            drop_last=drop_last):
        assert isinstance(x, np.ndarray) and x.shape[1:] == (6,)
        np.testing.assert_array_equal(label, (x[:, 0] // 6).astype(np.int64) % 7)
        seen.append(x[:, 0] // 6)
    assert [len(part) for part in seen] == sizes
    rows = np.concatenate(seen)
    assert len(np.unique(rows)) == len(rows) and not np.array_equal(rows, np.sort(rows))
    in_order = np.concatenate(list(batches(path, "x", 256)))
    np.testing.assert_array_equal(in_order, features)


def test_batches_refuse_a_bad_batch_size(path):
    from fastst.data import batches
    for size in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            next(batches(path, "x", size))


def test_batches_for_jax(path, features):
    jax = pytest.importorskip("jax")
    from fastst.data import batches
    first = next(batches(path, "x", 4, framework="jax"))
    assert isinstance(first, jax.Array)
    np.testing.assert_array_equal(np.asarray(first), features[:4])


def test_rows_open_lazily_once_pickled(path, features):
    import pickle
    from fastst.data import Rows
    rows = Rows(path, ["x", "label"], backend="pread")
    copy = pickle.loads(pickle.dumps(rows))
    assert rows.is_open and not copy.is_open and len(copy) == 1000
    np.testing.assert_array_equal(copy.gather([5])[0], features[[5]])
    assert copy.is_open
    rows.close()
    copy.close()
    with pytest.raises(fastst.SafetensorError, match="closed"):
        copy.gather([5])


def test_pickled_rows_refuse_a_changed_file(path, features):
    import pickle
    from fastst.data import Rows
    with Rows(path, "x") as rows:
        payload = pickle.dumps(rows)
    fastst.save_file({"x": features[:10]}, path)
    copy = pickle.loads(payload)     # lazily: the check comes with the first batch
    with pytest.raises(fastst.SafetensorError, match="changed since"):
        copy.gather([0])


def test_row_dataset_gives_rows_and_whole_batches(path, features):
    torch = pytest.importorskip("torch")
    from fastst.data import RowDataset
    dataset = RowDataset(path, ["x", "label"])
    assert isinstance(dataset, torch.utils.data.Dataset) and len(dataset) == 1000
    x, label = dataset[7]
    assert x.shape == (6,) and label.item() == 0
    np.testing.assert_array_equal(x.numpy(), features[7])
    xs, labels = dataset[[3, 1, 4]]
    assert isinstance(xs, torch.Tensor) and xs.shape == (3, 6)
    np.testing.assert_array_equal(labels.numpy(), [3, 1, 4])
    samples = dataset.__getitems__([3, 1])
    assert len(samples) == 2 and samples[1][0].tolist() == features[1].tolist()
    single = RowDataset(path, "x", backend="pread")
    assert single[-1].tolist() == features[-1].tolist()
    assert single[torch.tensor(2)].tolist() == single[np.int8(2)].tolist() == features[2].tolist()
    assert single[torch.tensor([2, 0])].tolist() == features[[2, 0]].tolist()
    with pytest.raises(TypeError):
        single[1.0]
    dataset.close()
    single.close()


def test_a_plain_data_loader_with_a_batch_size_works_too(path, features):
    torch = pytest.importorskip("torch")
    from fastst.data import RowDataset
    with RowDataset(path, ["x", "label"]) as dataset:
        x, label = next(iter(torch.utils.data.DataLoader(dataset, batch_size=5)))
    np.testing.assert_array_equal(x.numpy(), features[:5])
    np.testing.assert_array_equal(label.numpy(), np.arange(5) % 7)


def loaded_rows(loader):
    """Every batch of `loader`, as (row numbers, labels) arrays."""
    rows, labels = [], []
    for x, label in loader:
        assert str(x.dtype) == "torch.float32" and str(label.dtype) == "torch.int64"
        assert x.shape[1] == 6 and len(x) == 16
        rows.append((x[:, 0] // 6).to(dtype=label.dtype).numpy())
        labels.append(label.numpy())
    return np.concatenate(rows), np.concatenate(labels)


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize("backend, context", [("mmap", "fork"), ("pread", "fork"),
                                              ("mmap", "spawn")])   # spawn starts slowly
def test_data_loader_with_workers(tmp_path, backend, context):
    """Two workers, each opening the file on its first batch (spawn) or using the
    parent's handle (fork), together give every row once."""
    torch = pytest.importorskip("torch")
    from fastst.data import RowDataset, data_loader
    path = tmp_path / "small.safetensors"
    count = 96
    fastst.save_file({"x": np.arange(count * 6, dtype=np.float32).reshape(count, 6),
                      "label": np.arange(count, dtype=np.int64) % 7}, path)
    generator = torch.Generator().manual_seed(0)
    with RowDataset(path, ["x", "label"], backend=backend) as dataset:
        loader = data_loader(dataset, 16, shuffle=True, generator=generator, num_workers=2,
                             multiprocessing_context=context, timeout=120)
        rows, labels = loaded_rows(loader)
    assert sorted(rows.tolist()) == list(range(count)) and rows.tolist() != list(range(count))
    np.testing.assert_array_equal(labels, rows % 7)


class LabelsOf:
    """A dataset of one's own that holds a `Rows`: a worker gets the Rows pickled."""

    def __init__(self, path):
        from fastst.data import Rows
        self.rows = Rows(path, "label")

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, row):
        return self.rows.gather([row])[0]


def replaced_under(path, make_datasets):
    """Datasets made on the file at `path`, which is then replaced (as savers do, by a
    new file renamed over it)."""
    fastst.save_file({"x": np.zeros((8, 2), np.float32), "label": np.arange(8)}, path)
    datasets = make_datasets(path)
    fastst.save_file({"x": np.ones((9, 2), np.float32), "label": np.arange(9)}, path)
    return datasets


def batches_or_errors(loader, error):
    """Each batch of `loader`, or the `error` (an exception class) its worker raised
    for it, as its message; every worker has been heard from, and shut down, when this
    returns (a worker still starting when its loader is dropped dies on that)."""
    batches = iter(loader)
    got = []
    for _ in range(len(loader)):
        try:
            got.append(next(batches).tolist())
        except error as raised:
            got.append(str(raised))
    with pytest.raises(StopIteration):
        next(batches)
    return got


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_file_replaced_under_a_data_loader_is_named_in_the_main_process(tmp_path, context):
    """A worker opens the file on its first batch and refuses the new one there, inside
    __getitem__ or __getitems__: DataLoader re-raises fastst's message in the main
    process (no worker exits unexpectedly)."""
    torch = pytest.importorskip("torch")
    from fastst.data import RowDataset
    path = tmp_path / "replaced.safetensors"
    datasets = replaced_under(path, lambda path: [RowDataset(path, "label"), LabelsOf(path)])
    for dataset in datasets:     # a batch through __getitems__, then row by row
        loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2,
                                             multiprocessing_context=context, timeout=120)
        errors = batches_or_errors(loader, fastst.SafetensorError)
        assert len(errors) == 2     # a batch for each worker
        for message in errors:
            assert message.startswith("Caught SafetensorError in DataLoader worker process")
            assert f"{path}: file changed since the handle was pickled (device, inode, " \
                   f"size, mtime (" in message
    datasets[0].close()
    datasets[1].rows.close()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forked_worker_reads_the_file_it_inherited(tmp_path, backend):
    """Under fork a worker uses the handle the parent opened: pread reads that file as
    it was opened, replaced or not; mmap's copies refuse a file replaced since."""
    pytest.importorskip("torch")
    from fastst.data import RowDataset, data_loader
    path = tmp_path / "forked.safetensors"
    (dataset,) = replaced_under(path, lambda path: [RowDataset(path, "label",
                                                               backend=backend)])
    loader = data_loader(dataset, 4, num_workers=2, multiprocessing_context="fork",
                         timeout=120)
    got = batches_or_errors(loader, fastst.SafetensorError)
    if backend == "pread":
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    else:
        assert len(got) == 2 and all(
            f"{path}: file was replaced since it was opened; open it again to read the new "
            f"file\n" in message for message in got)
    dataset.close()
