"""Copies into private memory: load_file(copy=True), get_tensor(out=), load_into."""
import os

import numpy as np
import pytest

import fastst
from conftest import WRITABLE_DTYPES, random_array, same_bytes


@pytest.fixture
def checkpoint(tmp_path, rng):
    tensors = {code: random_array(rng, dtype, (3, 5)) for code, dtype in WRITABLE_DTYPES.items()}
    path = tmp_path / "c.safetensors"
    fastst.save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_copy_gives_arrays_that_own_their_memory(checkpoint, backend):
    path, tensors = checkpoint
    loaded = fastst.load_file(path, copy=True, backend=backend)
    assert list(loaded) == fastst.safe_open(path).offset_keys()
    for name, array in loaded.items():
        assert array.flags.owndata and array.flags.writeable and array.flags.c_contiguous
        assert same_bytes(array, tensors[name])
    os.unlink(path)
    assert same_bytes(loaded["F32"], tensors["F32"])


def test_large_copies_are_read_by_several_threads_correctly(tmp_path):
    big = np.arange(40 << 20, dtype=np.uint32)          # 160 MiB: chunked and threaded
    small = np.arange(7, dtype=np.int16)
    path = tmp_path / "big.safetensors"
    fastst.save_file({"big": big, "small": small}, path)
    loaded = fastst.load_file(path, copy=True)
    assert np.array_equal(loaded["big"], big) and np.array_equal(loaded["small"], small)


def test_get_tensor_into_a_given_array(checkpoint):
    path, tensors = checkpoint
    out = np.zeros((3, 5), dtype=np.float32)
    with fastst.safe_open(path) as f:
        assert f.get_tensor("F32", out=out) is out
    assert same_bytes(out, tensors["F32"])


@pytest.mark.parametrize("out, error, message", [
    (np.zeros((5, 3), np.float32), ValueError, "shape"),
    (np.zeros((3, 5), np.float64), ValueError, "dtype"),
    (np.zeros((3, 10), np.float32)[:, ::2], ValueError, "C-contiguous"),
    ([[0.0] * 5] * 3, TypeError, "numpy.ndarray"),
], ids=["shape", "dtype", "strided", "list"])
def test_out_must_match_the_tensor(checkpoint, out, error, message):
    path, _ = checkpoint
    with fastst.safe_open(path) as f, pytest.raises(error, match=message):
        f.get_tensor("F32", out=out)


def test_out_must_be_writable(checkpoint):
    path, _ = checkpoint
    out = np.zeros((3, 5), np.float32)
    out.flags.writeable = False
    with fastst.safe_open(path) as f, pytest.raises(ValueError, match="writable"):
        f.get_tensor("F32", out=out)


def test_load_into_fills_only_the_named_tensors(checkpoint):
    path, tensors = checkpoint
    arrays = {"I64": np.empty((3, 5), np.int64), "BF16": np.empty((3, 5), WRITABLE_DTYPES["BF16"])}
    fastst.load_into(path, arrays)
    assert all(same_bytes(arrays[name], tensors[name]) for name in arrays)
    with pytest.raises(fastst.TensorNotFoundError):
        fastst.load_into(path, {"missing": np.empty(1)})


def test_copies_from_a_buffer(checkpoint):
    path, tensors = checkpoint
    reader = fastst._core.Reader()
    reader.open_buffer(path.read_bytes())
    copies = reader.copy_tensors()
    assert all(a.flags.owndata and same_bytes(a, tensors[n]) for n, a in copies.items())


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_file_truncated_before_a_copy_gives_an_error_not_a_fault(tmp_path, backend):
    """Copies read with pread whatever the backend: a file that shrank under the
    reader gives SafetensorError, where copying from the map would raise SIGBUS."""
    path = tmp_path / "t.safetensors"
    fastst.save_file({"a": np.ones(1 << 16), "b": np.ones(1 << 16)}, path)
    with fastst.safe_open(path, backend=backend) as f:
        os.truncate(path, 4096)
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.copy_tensors()
        with pytest.raises(fastst.SafetensorError, match="truncated"):
            f.get_tensor("b", out=np.empty(1 << 16))
