"""fastst.jax and fastst.flax: jax.Arrays out of safe_open, and a drop-in for
safetensors.flax, cross-checked against the reference's flax module."""
from __future__ import annotations

import gc
import struct

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import fastst  # noqa: E402
from conftest import mapping_ranges  # noqa: E402
import fastst.flax as ff  # noqa: E402

# Dtypes jax holds as they are (64-bit ones become 32-bit without jax_enable_x64).
DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.float16,
          ml_dtypes.bfloat16, np.float32, np.complex64, ml_dtypes.float8_e4m3fn,
          ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz,
          ml_dtypes.float8_e8m0fnu]


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("safetensors")
    import safetensors.flax
    return safetensors.flax


def random_array(rng, dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def assert_same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.fixture
def arrays():
    rng = np.random.default_rng(7)
    return {f"t{i}": jnp.asarray(random_array(rng, dtype, (4, 16)))
            for i, dtype in enumerate(DTYPES)}


def test_flax_save_is_byte_identical_to_the_reference(tmp_path, reference, arrays):
    for metadata in (None, {"format": "flax"}):
        data = ff.save(arrays, metadata=metadata)
        assert data == reference.save(dict(arrays), metadata=metadata)
        ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
        ff.save_file(arrays, ours, metadata=metadata)
        reference.save_file(dict(arrays), str(theirs), metadata=metadata)
        assert ours.read_bytes() == theirs.read_bytes() == data


def test_flax_loads_match_the_reference_both_ways(tmp_path, reference, arrays):
    path = tmp_path / "x.safetensors"
    reference.save_file(dict(arrays), str(path))
    for loaded in (ff.load_file(path), ff.load_file(path, backend="pread"),
                   ff.load(path.read_bytes()), ff.load(bytearray(path.read_bytes()))):
        assert sorted(loaded) == sorted(arrays)
        for name, array in arrays.items():
            assert isinstance(loaded[name], jax.Array)
            assert_same(loaded[name], array)
    # the reference's flax module reads no float8 dtype back
    readable = {name: array for name, array in arrays.items()
                if not np.dtype(array.dtype).name.startswith("float8")}
    ff.save_file(readable, path)
    theirs = reference.load_file(str(path))
    assert sorted(theirs) == sorted(readable)
    for name, array in readable.items():
        assert_same(theirs[name], array)


def test_64_bit_dtypes_follow_jax_rules(tmp_path):
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"i": np.arange(3, dtype=np.int64), "f": np.ones(2)}, path)
    loaded = ff.load_file(path)
    assert loaded["i"].dtype == jnp.asarray(np.arange(3, dtype=np.int64)).dtype
    assert loaded["i"].tolist() == [0, 1, 2] and loaded["f"].tolist() == [1.0, 1.0]


def _aligned_file(tmp_path, tensors) -> str:
    """A valid file whose tensors start 64-byte aligned: the header is padded with
    spaces so the data begins at a multiple of 64, and every tensor is 64n bytes."""
    data = fastst.save(tensors)
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8:8 + n].rstrip(b" ")
    padded = header + b" " * (-(8 + len(header)) % 64)
    path = tmp_path / "aligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(padded)) + padded + data[8 + n:])
    return path


def test_aligned_tensors_are_not_copied(tmp_path):
    tensors = {"w": np.arange(64, dtype=np.float32).reshape(4, 16),
               "h": np.arange(32, dtype=np.float32).astype(ml_dtypes.bfloat16)}
    path = _aligned_file(tmp_path, tensors)
    with fastst.safe_open(path, framework="jax") as f:
        w, h = f.get_tensor("w"), f.get_tensor("h")
        ranges = mapping_ranges(path)
        for array in (w, h):
            pointer = array.unsafe_buffer_pointer()
            assert any(start <= pointer < end for start, end in ranges)
        assert f.get_slice("w")[1:3].unsafe_buffer_pointer() == w.unsafe_buffer_pointer() + 64
    gc.collect()
    assert_same(w, tensors["w"])
    assert_same(h, tensors["h"])
    assert float(jnp.sum(w)) == 2016.0


def test_safe_open_jax_and_flax_frameworks(tmp_path, arrays):
    path = tmp_path / "x.safetensors"
    ff.save_file(arrays, path)
    for framework in ("jax", "flax"):
        f = fastst.safe_open(path, framework=framework)
        got = f.get_tensors()
        one = f["t8"]
        piece = f.get_slice("t9")[1:, ::3]
        f.close()
        del f
        gc.collect()
        for name, array in arrays.items():
            assert_same(got[name], array)
        assert one.dtype == jnp.bfloat16
        assert_same(piece, arrays["t9"][1:, ::3])


def test_devices(tmp_path, arrays):
    path = tmp_path / "x.safetensors"
    ff.save_file(arrays, path)
    cpu = jax.devices("cpu")[0]
    for device in ("cpu", "cpu:0", cpu):
        with fastst.safe_open(path, framework="jax", device=device) as f:
            assert f.get_tensor("t0").devices() == {cpu}
    if not any(d.platform == "gpu" for d in jax.devices()):
        for device in ("cuda", "gpu", "cuda:0"):
            with pytest.raises(RuntimeError, match="not available to JAX"):
                fastst.safe_open(path, framework="jax", device=device)
    for bad in (0, None, "", "cpu:x"):
        with pytest.raises(fastst.SafetensorError, match="device"):
            fastst.safe_open(path, framework="jax", device=bad)


def test_sub_byte_tensors_come_packed(tmp_path):
    header = b'{"x":{"dtype":"F4","shape":[2,4],"data_offsets":[0,4]}}'
    header += b" " * (-len(header) % 8)
    path = tmp_path / "f4.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x01\x23\x45\x67")
    with fastst.safe_open(path, framework="jax") as f:
        x = f.get_tensor("x")
    assert x.dtype == jnp.uint8 and x.shape == (2, 2)
    assert x.tolist() == [[0x01, 0x23], [0x45, 0x67]]


def test_flax_save_leaves_its_input_alone(arrays):
    given = dict(arrays)
    ff.save(given)
    assert all(isinstance(v, jax.Array) for v in given.values())
    with pytest.raises(TypeError, match="dict"):
        ff.save([jnp.zeros(2)])


