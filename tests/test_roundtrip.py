"""Every dtype, layout and container round-trips bit for bit."""
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

import fastst
from conftest import WRITABLE_DTYPES, random_array, same_bytes

SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (2, 3, 4, 1)]


def load_all_ways(data: bytes, path: pathlib.Path):
    path.write_bytes(data)
    yield "load(bytes)", fastst.load(data)
    yield "load(bytearray)", fastst.load(bytearray(data))
    yield "load_file", fastst.load_file(path)
    yield "load_file pread", fastst.load_file(path, backend="pread")
    with fastst.safe_open(path, framework="np") as f:
        yield "safe_open", {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("code", sorted(WRITABLE_DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dtype_and_shape_round_trips(code, shape, rng, tmp_path):
    array = random_array(rng, WRITABLE_DTYPES[code], shape)
    data = fastst.save({"t": array})
    for how, loaded in load_all_ways(data, tmp_path / "t.safetensors"):
        assert same_bytes(loaded["t"], array), how
    with fastst.safe_open(tmp_path / "t.safetensors") as f:
        assert f.get_slice("t").get_dtype() == code
        assert f.get_slice("t").get_shape() == list(shape)


def test_bfloat16_and_fp8_values_survive_as_ml_dtypes(tmp_path):
    values = [0.0, -1.5, 3.25, float("inf"), -float("inf")]
    tensors = {
        "bf16": np.array(values, dtype=ml_dtypes.bfloat16),
        "e5m2": np.array(values, dtype=ml_dtypes.float8_e5m2),
        "e4m3": np.array(values[:4] + [448.0], dtype=ml_dtypes.float8_e4m3fn),
    }
    fastst.save_file(tensors, tmp_path / "f.safetensors")
    loaded = fastst.load_file(tmp_path / "f.safetensors")
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name].astype(np.float32), array.astype(np.float32))


def test_many_tensors_of_mixed_dtypes_round_trip(rng, tmp_path):
    tensors = {f"layer.{i}.{code}": random_array(rng, dtype, (i % 4, 3))
               for i, (code, dtype) in enumerate(sorted(WRITABLE_DTYPES.items()) * 3)}
    fastst.save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "np"})
    loaded = fastst.load_file(tmp_path / "m.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, array in tensors.items():
        assert same_bytes(loaded[name], array), name


@pytest.mark.parametrize("make", [
    lambda a: np.asfortranarray(a),
    lambda a: a[:, ::2],
    lambda a: a[::-1, ::-3],
    lambda a: a.T,
    lambda a: a.astype(a.dtype.newbyteorder(">")),
    lambda a: np.asfortranarray(a.astype(a.dtype.newbyteorder(">"))),
], ids=["fortran", "strided", "negative-strides", "transposed", "big-endian", "big-endian-fortran"])
def test_layouts_are_written_as_their_values(make, rng):
    """safetensors 0.8 writes the raw memory of Fortran-ordered arrays (wrong values);
    fastst writes what the array holds, in C order, little-endian."""
    base = rng.standard_normal((6, 9)).astype(np.float64)
    array = make(base)
    loaded = fastst.load(fastst.save({"a": array}))["a"]
    assert loaded.dtype == np.dtype("<f8")
    np.testing.assert_array_equal(loaded, array)


def test_read_only_and_non_owning_inputs(rng):
    array = rng.standard_normal((4, 4)).astype(np.float32)
    array.flags.writeable = False
    view = np.frombuffer(array.tobytes(), dtype=np.float32).reshape(4, 4)
    loaded = fastst.load(fastst.save({"ro": array, "view": view}))
    np.testing.assert_array_equal(loaded["ro"], array)
    np.testing.assert_array_equal(loaded["view"], view)


def test_numpy_scalars_and_ndarray_subclasses():
    memmap_like = np.arange(3, dtype=np.int32).view(np.recarray)
    loaded = fastst.load(fastst.save({"s": np.float32(2.5), "sub": memmap_like}))
    assert loaded["s"].shape == () and loaded["s"] == np.float32(2.5)
    np.testing.assert_array_equal(loaded["sub"], [0, 1, 2])


def test_mapping_inputs_and_path_types(tmp_path):
    from types import MappingProxyType
    tensors = MappingProxyType({"x": np.ones(2, np.int16)})
    for path in (tmp_path / "p.safetensors", str(tmp_path / "s.safetensors"),
                 os.fsencode(tmp_path / "b.safetensors")):
        fastst.save_file(tensors, path)
        np.testing.assert_array_equal(fastst.load_file(path)["x"], [1, 1])
        with fastst.safe_open(path) as f:
            assert f.keys() == ["x"]


def test_empty_dict_and_metadata_only():
    assert fastst.load(fastst.save({})) == {}
    data = fastst.save({}, metadata={"k": "v"})
    with_meta = fastst._core.Reader()
    with_meta.open_buffer(data)
    assert with_meta.metadata() == {"k": "v"} and with_meta.keys() == []


def test_numpy_module_is_a_drop_in(tmp_path):
    from fastst import numpy as fnp
    tensors = {"a": np.arange(4.0)}
    fnp.save_file(tensors, tmp_path / "a.safetensors", metadata={"m": "1"})
    assert fnp.load(fnp.save(tensors))["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert fnp.load_file(tmp_path / "a.safetensors")["a"].tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("code", sorted(WRITABLE_DTYPES))
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (17, 33), (16, 16), (1, 40), (40, 1), (0, 4),
                                   (300, 7)], ids=str)
def test_fortran_ordered_matrices_of_every_dtype(code, shape, rng, tmp_path):
    """Fortran-ordered matrices are transposed block by block as they are written."""
    array = np.asfortranarray(random_array(rng, WRITABLE_DTYPES[code], shape))
    expected = np.ascontiguousarray(array)
    assert same_bytes(fastst.load(fastst.save({"m": array}))["m"], expected)
    fastst.save_file({"m": array}, tmp_path / "m.safetensors")
    assert (tmp_path / "m.safetensors").read_bytes() == fastst.save({"m": expected})


def test_unaligned_fortran_matrix(rng):
    raw = np.zeros(1 + 6 * 4 * 8, np.uint8)
    unaligned = np.frombuffer(raw.data, dtype=np.float64, count=24, offset=1)
    matrix = unaligned.reshape((6, 4), order="F")
    matrix[...] = rng.standard_normal((6, 4))
    assert not matrix.flags.aligned and matrix.flags.f_contiguous
    np.testing.assert_array_equal(fastst.load(fastst.save({"m": matrix}))["m"], matrix)


def test_large_fortran_matrix_spanning_many_blocks(rng):
    matrix = np.asfortranarray(rng.standard_normal((4099, 700), dtype=np.float32))
    np.testing.assert_array_equal(fastst.load(fastst.save({"m": matrix}))["m"], matrix)
