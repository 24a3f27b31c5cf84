"""fastst.TensorSpec, serialize, serialize_file and deserialize against the
reference's own (safetensors 0.8), side by side."""
import ml_dtypes
import numpy as np
import pytest
import safetensors

import fastst
from fastst.writer import WriteSpec

# torch-style dtype name -> (header code, NumPy dtype holding its bytes)
NAMED = {row.torch: (row.code, row.numpy) for row in fastst.DTYPES if row.torch is not None}


def numpy_dtype(name):
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def specs_for(module, arrays):
    """{name: module.TensorSpec} over `arrays` ({name: (torch dtype name, shape, array)})."""
    return {name: module.TensorSpec(dtype=dtype, shape=shape, data_ptr=array.ctypes.data,
                                    data_len=array.nbytes)
            for name, (dtype, shape, array) in arrays.items()}


@pytest.fixture
def every_dtype(rng):
    arrays = {}
    for dtype, (code, numpy_name) in NAMED.items():
        shape = (3, 4)
        raw = rng.integers(0, 256, size=12 * fastst.writer.numpy_dtype(code).itemsize,
                           dtype=np.uint8)
        if code == "BOOL":
            raw &= 1
        if code == "F4":   # the storage shape: two 4-bit values a byte
            raw = raw[:6]
            shape = (3, 2)
        arrays[f"t_{dtype}"] = (dtype, shape, raw)
    return arrays


def test_the_names_are_importable_as_from_safetensors():
    from fastst import TensorSpec, deserialize, serialize, serialize_file  # noqa: F401
    assert fastst.TensorSpec is fastst.writer.TensorSpec
    assert set(NAMED) == {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                          "int64", "uint64", "float16", "float32", "float64", "bfloat16",
                          "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                          "float8_e8m0fnu", "float4_e2m1fn_x2", "complex64"}


def test_tensor_spec_keeps_the_code_and_doubles_float4_pairs():
    data = np.zeros(6, np.uint8)
    for module in (fastst, safetensors):
        spec = module.TensorSpec(dtype="float4_e2m1fn_x2", shape=(3, 2),
                                 data_ptr=data.ctypes.data, data_len=6)
        assert (spec.dtype, spec.shape, spec.data_ptr, spec.data_len) == (
            "F4", [3, 4], data.ctypes.data, 6)
        spec = module.TensorSpec(dtype="bfloat16", shape=np.array([2]), data_ptr=0, data_len=0)
        assert (spec.dtype, spec.shape) == ("BF16", [2])
    assert repr(fastst.TensorSpec(dtype="float32", shape=[2, 3], data_ptr=7, data_len=24)) == \
        repr(safetensors.TensorSpec(dtype="float32", shape=[2, 3], data_ptr=7, data_len=24))


@pytest.mark.parametrize("kwargs, error", [
    (dict(dtype="F32", shape=(1,), data_ptr=1, data_len=4), "SafetensorError"),
    (dict(dtype="float6_e2m3fn", shape=(1,), data_ptr=1, data_len=4), "SafetensorError"),
    (dict(dtype=b"float32", shape=(1,), data_ptr=1, data_len=4), TypeError),
    (dict(dtype="float32", shape=(-1,), data_ptr=1, data_len=4), OverflowError),
    (dict(dtype="float32", shape=(2**64,), data_ptr=1, data_len=4), OverflowError),
    (dict(dtype="float32", shape=(1.0,), data_ptr=1, data_len=4), TypeError),
    (dict(dtype="float32", shape="ab", data_ptr=1, data_len=4), TypeError),
    (dict(dtype="float32", shape=iter([1]), data_ptr=1, data_len=4), TypeError),
    (dict(dtype="float32", shape=(1,), data_ptr=-1, data_len=4), OverflowError),
    (dict(dtype="float32", shape=(1,), data_ptr=2**64, data_len=4), OverflowError),
    (dict(dtype="float32", shape=(1,), data_ptr=1.5, data_len=4), TypeError),
    (dict(dtype="float32", shape=(1,), data_ptr=1, data_len=-4), OverflowError),
    (dict(dtype="float32", shape=(1,), data_ptr=1), TypeError),
])
def test_tensor_spec_refuses_what_the_reference_refuses_with_the_same_error_type(kwargs, error):
    for module in (fastst, safetensors):
        expected = module.SafetensorError if error == "SafetensorError" else error
        with pytest.raises(expected):
            module.TensorSpec(**kwargs)
    with pytest.raises(TypeError):
        fastst.TensorSpec("float32", (1,), 1, 4)


def test_tensor_spec_fields_are_read_only():
    spec = fastst.TensorSpec(dtype="float32", shape=[1], data_ptr=0, data_len=0)
    with pytest.raises(AttributeError):
        spec.dtype = "F64"


def test_serialize_writes_the_reference_bytes_for_every_dtype(every_dtype):
    metadata = {"k": "v"}   # the reference orders several keys at random; fastst sorts them
    ours = fastst.serialize(specs_for(fastst, every_dtype), metadata=metadata)
    theirs = safetensors.serialize(specs_for(safetensors, every_dtype), metadata=metadata)
    assert ours == theirs
    assert fastst.serialize(specs_for(fastst, every_dtype)) == \
        safetensors.serialize(specs_for(safetensors, every_dtype))
    loaded = fastst.load(ours)
    for name, (dtype, shape, raw) in every_dtype.items():
        assert loaded[name].tobytes() == raw.tobytes()


def test_serialize_file_writes_the_same_bytes_as_serialize(tmp_path, every_dtype):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fastst.serialize_file(specs_for(fastst, every_dtype), ours, {"k": "v"})
    safetensors.serialize_file(specs_for(safetensors, every_dtype), str(theirs), {"k": "v"})
    assert ours.read_bytes() == theirs.read_bytes() == \
        fastst.serialize(specs_for(fastst, every_dtype), {"k": "v"})
    fastst.serialize_file(specs_for(fastst, every_dtype), filename=str(ours), metadata=None)
    assert ours.read_bytes() == fastst.serialize(specs_for(fastst, every_dtype))


def test_serialize_takes_write_specs_with_arrays_and_no_pointer():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    specs = [WriteSpec("a", "F32", (2, 3), array)]
    by_pointer = {"a": fastst.TensorSpec(dtype="float32", shape=(2, 3),
                                         data_ptr=array.ctypes.data, data_len=24)}
    assert fastst.serialize(specs) == fastst.serialize(by_pointer) == fastst.save({"a": array})


def test_an_empty_dict_is_an_empty_file():
    assert fastst.serialize({}) == safetensors.serialize({})


def spec(dtype="float32", shape=(2,), data=None, data_len=None, module=fastst):
    data = np.zeros(8, np.uint8) if data is None else data
    return module.TensorSpec(dtype=dtype, shape=shape, data_ptr=data.ctypes.data,
                             data_len=data.nbytes if data_len is None else data_len)


@pytest.mark.parametrize("make, error", [
    (lambda m: ({"a": spec(data_len=4, module=m)},), "SafetensorError"),
    (lambda m: ({"a": spec(data_len=12, data=np.zeros(12, np.uint8), module=m)},),
     "SafetensorError"),
    (lambda m: ({"a": spec("float4_e2m1fn_x2", (), data_len=1, module=m)},), "SafetensorError"),
    (lambda m: ({"a": spec("bool", (2**63, 2**63), data_len=0, module=m)},), "SafetensorError"),
    (lambda m: ({1: spec(module=m)},), TypeError),
    (lambda m: ({"a": np.zeros(2)},), TypeError),
    (lambda m: ({"a": spec(module=m)}, {"k": 1}), TypeError),
    (lambda m: ({"a": spec(module=m)}, {1: "v"}), TypeError),
    (lambda m: ({"a": spec(module=m)}, [("k", "v")]), TypeError),
    (lambda m: ({"\ud800": spec(module=m)},), ValueError),
])
def test_serialize_refuses_what_the_reference_refuses_with_the_same_error_type(make, error):
    for module in (fastst, safetensors):
        expected = module.SafetensorError if error == "SafetensorError" else error
        with pytest.raises(expected):
            module.serialize(*make(module))


def test_a_null_pointer_with_bytes_is_refused_before_it_is_read():
    with pytest.raises(fastst.SafetensorError, match="data_ptr is NULL"):
        fastst.serialize({"a": fastst.TensorSpec(dtype="float32", shape=(2,), data_ptr=0,
                                                 data_len=8)})
    empty = {"a": fastst.TensorSpec(dtype="float32", shape=(0,), data_ptr=0, data_len=0)}
    assert fastst.serialize(empty) == safetensors.serialize(
        {"a": safetensors.TensorSpec(dtype="float32", shape=(0,), data_ptr=0, data_len=0)})


def test_metadata_cannot_name_a_tensor():
    # The reference writes such a file, which no reader then opens; fastst refuses it.
    with pytest.raises(fastst.SafetensorError, match="reserved"):
        fastst.serialize({"__metadata__": spec()})


def test_serialize_file_reports_io_failures_as_safetensor_errors(tmp_path):
    for module in (fastst, safetensors):
        with pytest.raises(module.SafetensorError):
            module.serialize_file({"a": spec(module=module)}, str(tmp_path / "no" / "x"))
    with pytest.raises(fastst.SafetensorError) as caught:
        fastst.serialize_file({"a": spec()}, tmp_path / "no" / "x")
    assert isinstance(caught.value.__cause__, FileNotFoundError)


def test_serialize_file_leaves_no_file_when_a_spec_is_invalid(tmp_path):
    with pytest.raises(fastst.SafetensorError):
        fastst.serialize_file({"a": spec(data_len=4)}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_deserialize_gives_what_the_reference_gives(every_dtype):
    data = safetensors.serialize(specs_for(safetensors, every_dtype), {"k": "v"})
    ours = fastst.deserialize(data)
    theirs = safetensors.deserialize(data)
    assert sorted(ours) == sorted(theirs, key=lambda item: item[0])
    assert [name for name, _ in ours] == list(fastst.load(data))   # buffer order
    assert all(type(entry["data"]) is bytearray for _, entry in ours)
    assert fastst.deserialize(fastst.save({})) == safetensors.deserialize(fastst.save({})) == []


@pytest.mark.parametrize("data", [b"garbage", b"\x08" + bytes(7) + b"{}     x"])
def test_deserialize_refuses_malformed_buffers_as_the_reference_does(data):
    for module in (fastst, safetensors):
        with pytest.raises(module.SafetensorError):
            module.deserialize(data)


def test_deserialize_refuses_text():
    for module in (fastst, safetensors):
        with pytest.raises(TypeError):
            module.deserialize("not bytes")
