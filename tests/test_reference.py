"""Compatibility with the reference implementation, huggingface ``safetensors``.

Golden files written by hand from the format spec, byte-for-byte equality of what
both libraries write, and each library reading what the other wrote.
"""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fastst

safetensors = pytest.importorskip("safetensors")
import safetensors.numpy as reference  # noqa: E402

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _le(value: int) -> bytes:
    return struct.pack("<Q", value)


# ---------------------------------------------------------------------------
# Golden bytes: 8-byte LE header length, compact JSON (metadata first, then
# tensors by dtype rank descending, then name), spaces to a multiple of 8, data.
# ---------------------------------------------------------------------------

GOLDEN = [
    pytest.param(
        {}, None,
        _le(8) + b"{}      ",
        id="empty dict"),
    pytest.param(
        {"a": np.array([1.0, 2.0], np.float32)}, None,
        _le(56)
        + b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  '
        + b"\x00\x00\x80\x3f" + b"\x00\x00\x00\x40",
        id="one F32 vector"),
    pytest.param(
        {"b": np.array([1], np.uint8), "a": np.array([[1, 2]], np.int16)}, {"k": "v"},
        _le(136)
        + b'{"__metadata__":{"k":"v"},'
          b'"a":{"dtype":"I16","shape":[1,2],"data_offsets":[0,4]},'
          b'"b":{"dtype":"U8","shape":[1],"data_offsets":[4,5]}}   '
        + b"\x01\x00\x02\x00" + b"\x01",
        id="metadata, I16 before U8"),
    pytest.param(
        {"z": np.zeros((0, 3), np.float32), "s": np.array(0.5)}, None,
        _le(112)
        + b'{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},'
          b'"z":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}}    '
        + b"\x00\x00\x00\x00\x00\x00\xe0\x3f",
        id="F64 scalar, zero-size F32"),
    pytest.param(
        {"\u00e9": np.array([7], np.uint8), "e": np.array([8], np.uint8)}, None,
        _le(112)
        + b'{"e":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
          b'"\xc3\xa9":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}      '
        + b"\x08\x07",
        id="same dtype sorted by name, raw UTF-8 name"),
    pytest.param(
        {"flag": np.array([True, False]), "w": np.array([258], ">i4")}, None,
        _le(112)
        + b'{"w":{"dtype":"I32","shape":[1],"data_offsets":[0,4]},'
          b'"flag":{"dtype":"BOOL","shape":[2],"data_offsets":[4,6]}} '
        + b"\x02\x01\x00\x00" + b"\x01\x00",
        id="big-endian I32 written little-endian, BOOL last"),
    pytest.param(
        {"h": np.array([1.0], ml_dtypes.bfloat16)}, None,
        _le(56)
        + b'{"h":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]}} '
        + b"\x80\x3f",
        id="BF16"),
    pytest.param(
        {"a\n\"\\": np.array([3], np.int8)}, {"x": "y\tz"},
        _le(88)
        + b'{"__metadata__":{"x":"y\\tz"},'
          b'"a\\n\\"\\\\":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}} '
        + b"\x03",
        id="escaped name and metadata value"),
]


@pytest.mark.parametrize("tensors, metadata, expected", GOLDEN)
def test_golden_save(tensors, metadata, expected):
    assert fastst.save(tensors, metadata=metadata) == expected


@pytest.mark.parametrize("tensors, metadata, expected", GOLDEN)
def test_golden_matches_reference(tensors, metadata, expected):
    assert reference.save(tensors, metadata=metadata) == expected


@pytest.mark.parametrize("tensors, metadata, expected", GOLDEN)
def test_golden_save_file(tmp_path, tensors, metadata, expected):
    path = tmp_path / "golden.safetensors"
    fastst.save_file(tensors, path, metadata=metadata)
    assert path.read_bytes() == expected


@pytest.mark.parametrize("tensors, metadata, expected", GOLDEN)
def test_golden_load(tensors, metadata, expected):
    got = fastst.load(expected)
    assert sorted(got) == sorted(tensors)
    for name, want in tensors.items():
        _assert_tensor(got[name], want)


def test_golden_numpy_module_is_the_same_api():
    tensors = {"a": np.array([1.0, 2.0], np.float32)}
    assert fastst.numpy.save(tensors) == fastst.save(tensors) == reference.save(tensors)


def test_numpy_load_gives_writable_arrays_of_their_own_as_the_reference():
    data = reference.save({"a": np.arange(4, dtype=np.int16), "b": np.ones(2)})
    ours, theirs = fastst.numpy.load(data), reference.load(data)
    for arrays in (ours, theirs):
        held = np.frombuffer(data, np.uint8)
        assert all(array.flags.writeable and not np.shares_memory(array, held)
                   for array in arrays.values())
        arrays["a"] += 1
    assert {name: array.tolist() for name, array in ours.items()} == \
        {name: array.tolist() for name, array in theirs.items()}
    held = bytearray(data)      # the reference takes bytes alone; fastst copies from any buffer
    fastst.numpy.load(held)["a"][0] = 99
    assert held == data
    assert not fastst.load(data)["a"].flags.writeable     # fastst.load views the bytes


# ---------------------------------------------------------------------------
# Metadata ordering: the reference writes several metadata keys in an order
# that changes from run to run; fastst sorts them.
# ---------------------------------------------------------------------------

def _header(data: bytes) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    return data[8:8 + n]


def test_metadata_keys_are_sorted():
    tensors = {"a": np.zeros(1, np.uint8)}
    data = fastst.save(tensors, metadata={"b": "1", "a": "2", "c": "3"})
    assert _header(data).startswith(b'{"__metadata__":{"a":"2","b":"1","c":"3"},"a":')


def test_metadata_order_does_not_depend_on_insertion_order():
    tensors = {"a": np.zeros(1, np.uint8)}
    keys = [f"k{i}" for i in range(30)]
    forward = fastst.save(tensors, metadata={k: k for k in keys})
    backward = fastst.save(tensors, metadata={k: k for k in reversed(keys)})
    assert forward == backward


def test_metadata_with_several_keys_means_the_same_as_the_reference():
    tensors = {"a": np.zeros(1, np.uint8)}
    metadata = {"b": "1", "a": "2", "c": "3", "é": "4"}
    ours = fastst.save(tensors, metadata=metadata)
    theirs = reference.save(tensors, metadata=metadata)
    assert len(ours) == len(theirs)
    assert json.loads(_header(ours)) == json.loads(_header(theirs))
    assert ours[8 + len(_header(ours)):] == theirs[8 + len(_header(theirs)):]


def test_tensor_insertion_order_does_not_matter():
    a = {"x": np.ones(2, np.float32), "y": np.ones(3, np.float32), "z": np.ones(1, np.int64)}
    b = dict(reversed(list(a.items())))
    assert fastst.save(a) == fastst.save(b) == reference.save(a) == reference.save(b)


# ---------------------------------------------------------------------------
# Random dicts of every dtype the reference's NumPy path writes
# ---------------------------------------------------------------------------

DTYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.complex64): "C64",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e8m0fnu): "F8_E8M0",
    np.dtype(ml_dtypes.float8_e4m3fnuz): "F8_E4M3FNUZ",
    np.dtype(ml_dtypes.float8_e5m2fnuz): "F8_E5M2FNUZ",
}
# Dtypes the reference's safe_open(framework="np") can turn into arrays.
REFERENCE_NUMPY_CODES = {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64",
                         "F16", "F32", "F64", "C64"}


def test_reference_writes_every_listed_dtype():
    for dtype, code in DTYPES.items():
        data = reference.save({"x": np.zeros(2, dtype)})
        assert json.loads(_header(data))["x"]["dtype"] == code
        assert fastst.save({"x": np.zeros(2, dtype)}) == data


NAME_CHARS = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from('"\\/\n\t\r\b\f\x00\x01\x1f\x7f\u2028\ufeff:,-{}[] é名😀'),
)
names = st.text(NAME_CHARS, max_size=10).filter(lambda s: s != "__metadata__")
texts = st.text(NAME_CHARS, max_size=12)


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(list(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    count = int(np.prod(shape, dtype=np.int64))
    raw = np.frombuffer(draw(st.binary(min_size=count * dtype.itemsize,
                                       max_size=count * dtype.itemsize)), np.uint8)
    if dtype == np.bool_:
        raw = raw % 2
    array = raw.view(dtype).reshape(shape)
    if dtype.kind in "iufc" and dtype.itemsize > 1 and draw(st.booleans()):
        array = array.astype(dtype.newbyteorder(">"))
    return array


tensor_dicts = st.dictionaries(names, arrays(), max_size=6)
# At most one key: the reference orders several metadata keys differently each run.
metadatas = st.none() | st.dictionaries(texts, texts, max_size=1)


def _reference_writes_valid(tensors, metadata) -> bool:
    """The reference writes the invalid header `{},"__metadata__":{}}` for no tensors
    with empty metadata (see test_reference_bug_empty_dict_with_empty_metadata)."""
    return bool(tensors) or metadata != {}


def _little(array: np.ndarray) -> np.ndarray:
    return array.astype(array.dtype.newbyteorder("<")) if array.dtype.byteorder == ">" else array


def _assert_tensor(got: np.ndarray, want: np.ndarray):
    want = _little(want)
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    if want.dtype.kind in "biu":
        assert np.array_equal(got, want)


def _assert_tensors(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        _assert_tensor(got[name], want[name])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("reference")


@SETTINGS
@given(tensors=tensor_dicts, metadata=metadatas)
def test_save_matches_reference(tensors, metadata):
    assume(_reference_writes_valid(tensors, metadata))
    assert fastst.save(tensors, metadata=metadata) == reference.save(tensors, metadata=metadata)


@SETTINGS
@given(tensors=tensor_dicts, metadata=metadatas)
def test_save_file_matches_reference(workdir, tensors, metadata):
    assume(_reference_writes_valid(tensors, metadata))
    ours, theirs = workdir / "ours.safetensors", workdir / "theirs.safetensors"
    fastst.save_file(tensors, ours, metadata=metadata)
    reference.save_file(tensors, str(theirs), metadata=metadata)
    assert ours.read_bytes() == theirs.read_bytes()


def _offsets(data: bytes) -> dict:
    header = json.loads(_header(data))
    header.pop("__metadata__", None)
    return {name: tuple(info["data_offsets"]) for name, info in header.items()}


def _header_order(data: bytes) -> list:
    return [name for name in json.loads(_header(data)) if name != "__metadata__"]


@SETTINGS
@given(tensors=tensor_dicts, metadata=metadatas)
def test_fastst_reads_reference_files(workdir, tensors, metadata):
    assume(_reference_writes_valid(tensors, metadata))
    data = reference.save(tensors, metadata=metadata)
    _assert_tensors(fastst.load(data), tensors)
    path = workdir / "theirs.safetensors"
    path.write_bytes(data)
    _assert_tensors(fastst.load_file(path), tensors)
    with fastst.safe_open(path, framework="np") as f:
        _assert_tensors({name: f.get_tensor(name) for name in f.keys()}, tensors)
        assert f.metadata() == metadata
        keys, offset_keys = f.keys(), f.offset_keys()
    # The reference's writer lays tensors out in header order.
    assert keys == sorted(tensors)
    assert offset_keys == _header_order(data)
    _assert_same_names_as_reference(path, data, keys, offset_keys, metadata)


@SETTINGS
@given(tensors=tensor_dicts, metadata=metadatas)
def test_reference_reads_fastst_files(workdir, tensors, metadata):
    data = fastst.save(tensors, metadata=metadata)
    views = dict(safetensors.deserialize(data))
    assert sorted(views) == sorted(tensors)
    for name, want in tensors.items():
        assert views[name]["dtype"] == DTYPES[want.dtype.newbyteorder("=")]
        assert list(views[name]["shape"]) == list(want.shape)
        assert bytes(views[name]["data"]) == _little(want).tobytes()

    path = workdir / "ours.safetensors"
    fastst.save_file(tensors, path, metadata=metadata)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == metadata
        for name, want in tensors.items():
            if DTYPES[want.dtype.newbyteorder("=")] in REFERENCE_NUMPY_CODES:
                _assert_tensor(f.get_tensor(name), want)
    numpy_only = {k: v for k, v in tensors.items()
                  if DTYPES[v.dtype.newbyteorder("=")] in REFERENCE_NUMPY_CODES}
    if len(numpy_only) == len(tensors):
        _assert_tensors(reference.load(data), tensors)
        _assert_tensors(reference.load_file(str(path)), tensors)
    with fastst.safe_open(path, framework="np") as f:
        keys, offset_keys = f.keys(), f.offset_keys()
    _assert_same_names_as_reference(path, data, keys, offset_keys, metadata)


def _assert_same_names_as_reference(path, data, keys, offset_keys, metadata):
    """keys() must equal the reference's exactly. offset_keys() must agree with the
    reference's buffer order; where zero-size tensors share an offset the reference's
    order among them varies from run to run, so those ties are compared as sets."""
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.keys() == keys
        assert f.metadata() == metadata
        theirs = f.offset_keys()
    offsets = _offsets(data)
    assert sorted(theirs) == sorted(offset_keys)
    assert [offsets[n] for n in theirs] == [offsets[n] for n in offset_keys]
    assert [offsets[n] for n in offset_keys] == sorted(offsets[n] for n in offset_keys)


# ---------------------------------------------------------------------------
# Buffer order vs name order
# ---------------------------------------------------------------------------

def test_keys_sorted_offset_keys_in_buffer_order(tmp_path):
    tensors = {"b": np.ones(2, np.float64), "a": np.ones(1, np.uint8),
               "c": np.ones(3, np.float64), "d": np.ones(1, np.int32)}
    path = tmp_path / "order.safetensors"
    reference.save_file(tensors, str(path))
    with fastst.safe_open(path, framework="np") as ours, \
            safetensors.safe_open(str(path), framework="np") as theirs:
        assert ours.keys() == theirs.keys() == ["a", "b", "c", "d"]
        assert ours.offset_keys() == theirs.offset_keys() == ["b", "c", "d", "a"]
        assert list(ours.get_tensors()) == ["b", "c", "d", "a"]


def test_offset_keys_of_zero_size_ties_follow_the_header(tmp_path):
    """Zero-size tensors sharing an offset keep the header's order in fastst, every
    time (the reference's order among them varies from one open to the next)."""
    tensors = {c: np.zeros(0, np.uint8) for c in "hgfedcba"}
    tensors["m"] = np.zeros(3, np.uint8)
    path = tmp_path / "ties.safetensors"
    fastst.save_file(tensors, path)
    for _ in range(5):
        with fastst.safe_open(path, framework="np") as f:
            assert f.offset_keys() == list("abcdefgh") + ["m"]


def test_metadata_none_vs_empty(tmp_path):
    tensors = {"a": np.zeros(1, np.uint8)}
    for metadata in (None, {}):
        data = fastst.save(tensors, metadata=metadata)
        assert data == reference.save(tensors, metadata=metadata)
        path = tmp_path / "m.safetensors"
        path.write_bytes(data)
        with fastst.safe_open(path, framework="np") as ours, \
                safetensors.safe_open(str(path), framework="np") as theirs:
            assert ours.metadata() == theirs.metadata() == metadata


def test_reference_bug_empty_dict_with_empty_metadata():
    """The reference writes `{},"__metadata__":{}}` (not JSON) for no tensors and
    empty metadata, and cannot read it back; fastst writes the valid header and
    refuses the reference's bytes."""
    theirs = reference.save({}, metadata={})
    assert _header(theirs).rstrip(b" ") == b'{},"__metadata__":{}}'
    with pytest.raises(Exception):
        reference.load(theirs)
    with pytest.raises(fastst.SafetensorError, match="header is not valid JSON"):
        fastst.load(theirs)
    ours = fastst.save({}, metadata={})
    assert ours == _le(24) + b'{"__metadata__":{}}     '
    assert fastst.load(ours) == {}
    assert reference.load(ours) == {}


# ---------------------------------------------------------------------------
# The reference's modules, name for name: code that imports a name from
# safetensors[.numpy|.torch|.flax] imports it from fastst[...] and calls it with
# the same arguments.
# ---------------------------------------------------------------------------

MODULES = ["", ".numpy", ".torch", ".flax"]
# private names of the reference that libraries import (transformers, vLLM, diffusers,
# torch.distributed.checkpoint): the rest of its private helpers are its own
USED_PRIVATE_NAMES = {".torch": {"_find_shared_tensors", "_is_complete",
                                 "_remove_duplicate_names", "_TYPES", "_SIZE", "_getdtype",
                                 "_to_ndarray"}}


def _modules(suffix: str):
    import importlib

    if suffix == ".torch":
        pytest.importorskip("torch")
    if suffix == ".flax":
        pytest.importorskip("jax")
    return (importlib.import_module("safetensors" + suffix),
            importlib.import_module("fastst" + suffix))


def _offered(module, suffix: str) -> dict:
    """What `module` of the reference offers: its public names and the private ones
    libraries use, less what it imported for itself (modules, typing, a
    collections or JAX class)."""
    import types
    import typing

    return {name: value for name, value in vars(module).items()
            if (not name.startswith("_") or name in USED_PRIVATE_NAMES.get(suffix, ()))
            and not isinstance(value, types.ModuleType)
            and getattr(value, "__module__", None) not in ("typing", "collections", "jax")
            and value is not getattr(typing, name, None)}


@pytest.mark.parametrize("suffix", MODULES)
def test_every_name_the_reference_offers_is_there(suffix):
    theirs, ours = _modules(suffix)
    offered = _offered(theirs, suffix)
    assert "load_file" in offered or suffix == ""
    missing = sorted(name for name in offered if not hasattr(ours, name))
    assert missing == []
    for name, value in offered.items():
        if suffix and getattr(safetensors, name, None) is value:   # re-exported by the module
            assert getattr(ours, name) is getattr(fastst, name), name


def _signatures(suffix: str):
    import inspect

    theirs, ours = _modules(suffix)
    for name, value in _offered(theirs, suffix).items():
        if callable(value) and not isinstance(value, type):
            yield name, inspect.signature(value), inspect.signature(getattr(ours, name))


@pytest.mark.parametrize("suffix", MODULES)
def test_every_function_takes_the_reference_arguments(suffix):
    """Each parameter of the reference's functions is ours at the same place, with
    the same default; a parameter only ours has a default."""
    checked = 0
    for name, theirs, ours in _signatures(suffix):
        positional = [p.name for p in ours.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for index, parameter in enumerate(theirs.parameters.values()):
            mine = ours.parameters.get(parameter.name)
            assert mine is not None, (name, parameter.name)
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
                assert positional[index:index + 1] == [parameter.name], (name, parameter.name)
            if parameter.default not in (parameter.empty, Ellipsis):   # Ellipsis: the Rust API's
                assert mine.default == parameter.default, (name, parameter.name)
        extra = [p for p in ours.parameters.values() if p.name not in theirs.parameters]
        assert all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   for p in extra), (name, extra)
        checked += 1
    assert checked >= 2


def test_numpy_functions_take_the_reference_keywords(tmp_path):
    tensors = {"a": np.arange(3, dtype=np.float32)}
    fastst.numpy.save_file(tensor_dict=tensors, filename=tmp_path / "a.safetensors",
                           metadata={"k": "v"})
    reference.save_file(tensor_dict=tensors, filename=tmp_path / "b.safetensors",
                        metadata={"k": "v"})
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert fastst.numpy.save(tensor_dict=tensors) == reference.save(tensor_dict=tensors)
    with fastst.numpy.safe_open(tmp_path / "b.safetensors", framework="np") as f:
        assert f.metadata() == {"k": "v"}


def test_the_reference_dtype_tables_under_its_names():
    torch = pytest.importorskip("torch")
    import safetensors.torch as theirs
    import fastst.torch as ours

    for code, dtype in theirs._TYPES.items():
        assert ours._TYPES[code] is dtype and ours._getdtype(code) is dtype
    assert ours._SIZE == {dtype: size for dtype, size in theirs._SIZE.items()
                          if dtype in ours._SIZE} and set(theirs._SIZE) <= set(ours._SIZE)
    assert ours._getdtype("F8_E8M0") is torch.float8_e8m0fnu   # the reference lacks it
    assert "F4" not in ours._TYPES   # torch's float4 packs two elements, as there
    with pytest.raises(KeyError):
        ours._getdtype("F6_E2M3")


def test_to_ndarray_gives_the_bytes_of_a_tensor_as_the_reference():
    """diffusers sends a tensor's bytes as ``_to_ndarray(tensor)[0].tobytes()``."""
    torch = pytest.importorskip("torch")
    import safetensors.torch as theirs
    import fastst.torch as ours

    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=generator), torch.arange(6, dtype=torch.int16),
               torch.randn(4, generator=generator).to(torch.bfloat16), torch.tensor(2.5),
               torch.zeros(0, 3), torch.ones(2, dtype=torch.float8_e4m3fn)]
    for tensor in tensors:
        data, kept = ours._to_ndarray(tensor)
        assert data.tobytes() == theirs._to_ndarray(tensor)[0].tobytes()
        assert data.dtype == np.uint8 and data.ndim == 1 and kept is tensor
        if tensor.numel():
            assert data.ctypes.data == tensor.data_ptr()    # a view, as the reference's
    # the reference reads a transposed tensor's storage in its own order: fastst gives
    # the tensor's elements in order
    transposed = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    assert ours._to_ndarray(transposed)[0].tobytes() == transposed.contiguous().numpy().tobytes()
