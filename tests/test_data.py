"""Batched row gathers (`f.gather`) and the data-loader helpers of fastst.data."""
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
    list(range(400, 300, -1)) + list(range(0, 50)), [], np.array([], np.uint8)])
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


@pytest.mark.parametrize("rows", [[1000], [-1001], np.array([2**63 + 1], np.uint64),
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
    from conftest import time_with_longest_pause
    path = tmp_path / "big.safetensors"
    fastst.save_file({"x": np.ones((8192, 1024), np.float32)}, path)
    rows = np.random.default_rng(0).integers(0, 8192, 8192 * 4)
    out = np.empty((rows.size, 1024), np.float32)
    with fastst.safe_open(path, backend=backend) as f:
        f.gather("x", rows, out=out)    # page the file in and the output
        elapsed, longest_pause = time_with_longest_pause(lambda: f.gather("x", rows, out=out))
    assert out.sum() == out.size
    assert longest_pause < elapsed / 2, (longest_pause, elapsed)
