"""load() takes every contiguous buffer, read-only or writable; views follow its
writability."""
import array
import mmap

import numpy as np
import pytest

import fastst

TENSORS = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(5, dtype=np.int64)}
BLOB = fastst.save(TENSORS)


def check(loaded, writable):
    assert sorted(loaded) == ["a", "b"]
    for name, expected in TENSORS.items():
        np.testing.assert_array_equal(loaded[name], expected)
        assert loaded[name].flags.writeable == writable


def read_only_array():
    return np.frombuffer(BLOB, np.uint8)


def writable_array():
    return np.frombuffer(bytearray(BLOB), np.uint8)


def array_array():
    return array.array("B", BLOB)


@pytest.mark.parametrize("make, writable", [
    (lambda: BLOB, False),
    (lambda: bytearray(BLOB), True),
    (lambda: memoryview(BLOB), False),
    (lambda: memoryview(bytearray(BLOB)), True),
    (lambda: memoryview(bytearray(BLOB)).toreadonly(), False),
    (read_only_array, False),
    (writable_array, True),
    (lambda: writable_array().reshape(1, -1), True),
    (array_array, True),
], ids=["bytes", "bytearray", "memoryview ro", "memoryview rw", "memoryview toreadonly",
        "ndarray ro", "ndarray rw", "ndarray 2d", "array.array"])
def test_every_contiguous_buffer_loads(make, writable):
    check(fastst.load(make()), writable)


def test_a_read_only_numpy_memmap_loads(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(BLOB)
    mapped = np.memmap(path, mode="r")
    check(fastst.load(mapped), False)


@pytest.mark.parametrize("access, writable", [(mmap.ACCESS_READ, False),
                                              (mmap.ACCESS_COPY, True)])
def test_mmap_objects_load(tmp_path, access, writable):
    path = tmp_path / "model.safetensors"
    path.write_bytes(BLOB)
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=access)
    loaded = fastst.load(mapped)
    check(loaded, writable)
    del loaded


def test_a_non_contiguous_buffer_is_refused_clearly():
    strided = memoryview(bytearray(BLOB * 2))[::2]
    with pytest.raises(fastst.SafetensorTypeError, match="contiguous"):
        fastst.load(strided)
    with pytest.raises(TypeError, match="contiguous"):
        fastst.load(np.frombuffer(BLOB * 2, np.uint8)[::2])


@pytest.mark.parametrize("value", ["text", 3, None, [1, 2]])
def test_a_value_that_is_no_buffer_is_refused_clearly(value):
    with pytest.raises(fastst.SafetensorTypeError, match="expected a bytes-like object"):
        fastst.load(value)
