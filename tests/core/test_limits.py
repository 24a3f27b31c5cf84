"""Hostile headers cost linear time and bounded messages; arguments are checked."""
import numpy as np
import pytest

import fastst
from fastst import _core


def framed(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


def metadata_with_last_key_twice(n: int) -> bytes:
    keys = b",".join(b'"k%d":"v"' % i for i in range(n))
    return framed(b'{"__metadata__":{' + keys + b',"k%d":"v"}}' % (n - 1))


class CountedKey(str):
    """A key of a header object that counts the hashes and comparisons made of it, and
    stops a search that makes more than `budget` of them."""
    work = 0
    budget = 0

    def __hash__(self):
        CountedKey.count()
        return str.__hash__(self)

    def __eq__(self, other):
        CountedKey.count()
        return str.__eq__(self, other)

    @staticmethod
    def count():
        CountedKey.work += 1
        if CountedKey.work > CountedKey.budget:
            raise AssertionError(f"more than {CountedKey.budget} hashes and comparisons of keys")


def work_to_reject(keys: int, monkeypatch) -> int:
    """How many hashes and comparisons of keys rejecting a header of `keys` metadata keys,
    the last one twice, takes (at most a hundred a key): the search for the key it names
    runs over the parser's (key, value) pairs, whose keys are CountedKeys here."""
    class CountingPairs(_core._Pairs):
        def __init__(self, pairs):
            super().__init__((CountedKey(key), value) for key, value in pairs)

    monkeypatch.setattr(_core, "_Pairs", CountingPairs)
    CountedKey.work, CountedKey.budget = 0, 100 * keys
    with pytest.raises(fastst.SafetensorError, match="duplicate key"):
        fastst.load(metadata_with_last_key_twice(keys))
    return CountedKey.work


def test_a_duplicate_after_many_metadata_keys_is_named():
    with pytest.raises(fastst.SafetensorError, match=r"__metadata__: duplicate key 'k999'"):
        fastst.load(metadata_with_last_key_twice(1000))


def test_rejecting_a_duplicate_is_linear_in_the_number_of_keys(monkeypatch):
    small = work_to_reject(20_000, monkeypatch)
    large = work_to_reject(200_000, monkeypatch)
    assert small >= 20_000        # every key was looked at
    assert large < 20 * small     # ten times the keys; quadratic work would be 100 times


def test_a_duplicate_tensor_field_after_many_tensors_is_named():
    entries = b",".join(
        b'"t%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i for i in range(20_000))
    header = b'{' + entries + b',"t0":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}'
    with pytest.raises(fastst.SafetensorError, match=r"duplicate tensor name 't0'"):
        fastst.load(framed(header))


# --- deeply nested values: a short SafetensorError, never a RecursionError --------------

def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def nested_object(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


ENTRY = '{"dtype":%s,"shape":%s,"data_offsets":%s}'
HOSTILE_HEADERS = {
    "dtype": lambda v: '{"t":' + ENTRY % (v, "[2]", "[0,2]") + "}",
    "shape": lambda v: '{"t":' + ENTRY % ('"U8"', v, "[0,2]") + "}",
    "shape item": lambda v: '{"t":' + ENTRY % ('"U8"', "[" + v + "]", "[0,2]") + "}",
    "data_offsets": lambda v: '{"t":' + ENTRY % ('"U8"', "[2]", v) + "}",
    "data_offsets item": lambda v: '{"t":' + ENTRY % ('"U8"', "[2]", "[0," + v + "]") + "}",
    "entry": lambda v: '{"t":' + v + "}",
    "metadata": lambda v: '{"__metadata__":' + v + "}",
    "metadata value": lambda v: '{"__metadata__":{"k":' + v + "}}",
    "extra field": lambda v: '{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":'
                             + v + "}}",
    "header": lambda v: v,
}


@pytest.mark.parametrize("depth", [1000, 100_000])
@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("field", sorted(HOSTILE_HEADERS))
def test_deeply_nested_values_give_a_short_error(tmp_path, field, kind, depth):
    value = nested(depth) if kind == "array" else nested_object(depth)
    blob = framed(HOSTILE_HEADERS[field](value).encode(), b"\0\0")
    path = tmp_path / "nested.safetensors"
    path.write_bytes(blob)
    for read in (lambda: fastst.load(blob), lambda: fastst.load_file(path),
                 lambda: fastst.safe_open(path, "np"),
                 lambda: fastst.safe_open(path, "np", backend="pread")):
        with pytest.raises(fastst.SafetensorError) as error:
            read()
        assert len(str(error.value)) < 300 + len(str(path))


def test_a_huge_name_is_shortened_in_messages():
    name = "n" * 1_000_000
    header = ('{"%s":{"dtype":"X9","shape":[2],"data_offsets":[0,2]}}' % name).encode()
    with pytest.raises(fastst.SafetensorError, match="unknown dtype 'X9'") as error:
        fastst.load(framed(header, b"\0\0"))
    assert len(str(error.value)) < 500


def test_a_long_offsets_array_is_shortened_in_messages():
    offsets = "[" + ",".join(["1"] * 100_000) + "]"
    header = ('{"t":{"dtype":"U8","shape":[2],"data_offsets":%s}}' % offsets).encode()
    with pytest.raises(fastst.SafetensorError, match=r"data_offsets must be an array") as error:
        fastst.load(framed(header, b"\0\0"))
    assert len(str(error.value)) < 300


@pytest.mark.parametrize("value, shown", [
    ("abc", "'abc'"),
    ([1, [2, [3, [4, [5]]]]], "[1, [2, [3, [...]]]]"),
    ({"a": None, "b": True}, "{'a': None, 'b': True}"),
    ((7,), "(7,)"),
    (2 ** 1000, "<1001-bit integer>"),
])
def test_values_are_shown_briefly_in_messages(tmp_path, value, shown):
    with pytest.raises(fastst.SafetensorError) as error:
        fastst.safe_open(small_file(tmp_path), "np", backend=value)
    assert str(error.value) == f"backend must be 'mmap' or 'pread', got {shown}"


def test_a_tensor_entry_written_as_an_array_is_rejected():
    header = framed(b'{"t":["U8",[2],[0,2]]}', b"\0\0")
    with pytest.raises(fastst.SafetensorError, match=r"tensor 't': entry must be an object"):
        fastst.load(header)


# --- arguments --------------------------------------------------------------------------

def small_file(tmp_path):
    path = tmp_path / "small.safetensors"
    fastst.save_file({"t": np.arange(3, dtype=np.uint8)}, path)
    return path


def openers(tmp_path):
    path = small_file(tmp_path)
    blob = path.read_bytes()
    return {
        "load": lambda limit: fastst.load(blob, max_header_size=limit),
        "load_file": lambda limit: fastst.load_file(path, max_header_size=limit),
        "safe_open": lambda limit: fastst.safe_open(path, "np", max_header_size=limit),
        "safe_open pread": lambda limit: fastst.safe_open(
            path, "np", backend="pread", max_header_size=limit),
    }


@pytest.mark.parametrize("limit", [1.5, True, False, "100", None, 100.0])
def test_max_header_size_must_be_an_integer(tmp_path, limit):
    for read in openers(tmp_path).values():
        with pytest.raises(fastst.SafetensorTypeError, match="max_header_size must be an integer"):
            read(limit)


@pytest.mark.parametrize("limit", [-1, -(2 ** 70)])
def test_max_header_size_must_not_be_negative(tmp_path, limit):
    for read in openers(tmp_path).values():
        with pytest.raises(fastst.SafetensorError, match="max_header_size must not be negative"):
            read(limit)


@pytest.mark.parametrize("limit", [np.int64(1000), 2 ** 64, 2 ** 100, 1000])
def test_max_header_size_takes_any_large_enough_integer(tmp_path, limit):
    for read in openers(tmp_path).values():
        read(limit)


def test_max_header_size_below_the_header_is_refused(tmp_path):
    for read in openers(tmp_path).values():
        with pytest.raises(fastst.SafetensorError, match="exceeds the limit of 8 bytes"):
            read(8)


@pytest.mark.parametrize("backend", ["MMAP", "", None, 1, ["mmap"]])
def test_an_unknown_backend_is_a_safetensor_error(tmp_path, backend):
    path = small_file(tmp_path)
    with pytest.raises(fastst.SafetensorError, match=r"backend must be 'mmap' or 'pread'"):
        fastst.safe_open(path, "np", backend=backend)
    with pytest.raises(fastst.SafetensorError, match=r"backend must be 'mmap' or 'pread'"):
        fastst.load_file(path, backend=backend)
