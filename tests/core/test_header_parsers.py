"""The fast header scanner and the strict parser (orjson, or the standard library's
json on a free-threaded build) accept exactly the same headers and read them the
same way."""
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

import fastst
from fastst import _core

# The strict parser decodes with orjson, and with json as a free-threaded build does.
pytestmark = pytest.mark.usefixtures("json_codec")

CODES = list(fastst.DTYPE_CODES)
BITS = {code: _core.dtype_bits(code) for code in CODES}


def outcome(parse, header: bytes, data_len: int):
    try:
        return "ok", _core._describe(parse(header, "<h>", data_len))
    except fastst.SafetensorError as error:
        return "error", str(error)


def agree(header: bytes, data_len: int):
    fast = outcome(_core.parse_header, header, data_len)
    strict = outcome(_core._parse_header_strictly, header, data_len)
    assert fast == strict
    return fast


def spaced(rng: random.Random, tokens) -> str:
    """Join JSON tokens with random (valid) whitespace."""
    space = lambda: "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 0, 1, 2])))
    return space() + space().join(tokens) + space()


def entry_tokens(rng, code, shape, begin, end):
    fields = [
        ['"dtype"', ":", json.dumps(code)],
        ['"shape"', ":", "["] + sum(([str(d), ","] for d in shape), [])[:-1] + ["]"],
        ['"data_offsets"', ":", "[", str(begin), ",", str(end), "]"],
    ]
    rng.shuffle(fields)
    tokens = ["{"]
    for i, field in enumerate(fields):
        tokens += field + ([","] if i < 2 else [])
    return tokens + ["}"]


@st.composite
def headers(draw):
    rng = random.Random(draw(st.integers(0, 2**32)))
    names = draw(st.lists(st.text(st.characters(codec="utf-8"), max_size=6), max_size=6,
                          unique=True))
    tokens, offset = ["{"], 0
    members = []
    if draw(st.booleans()):
        meta = draw(st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3))
        body = ["{"]
        for key, value in meta.items():
            body += [json.dumps(key, ensure_ascii=rng.random() < 0.5), ":",
                     json.dumps(value, ensure_ascii=rng.random() < 0.5), ","]
        members.append(['"__metadata__"', ":"] + (body[:-1] if meta else body) + ["}"])
    for name in names:
        code = rng.choice(CODES)
        shape = [rng.choice([0, 1, 2, 3, 4, 8]) for _ in range(rng.randint(0, 3))]
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * BITS[code] // 8
        members.append([json.dumps(name, ensure_ascii=rng.random() < 0.3), ":"]
                       + entry_tokens(rng, code, shape, offset, offset + nbytes))
        offset += nbytes
    rng.shuffle(members)
    for i, member in enumerate(members):
        tokens += member + ([","] if i < len(members) - 1 else [])
    tokens.append("}")
    return spaced(rng, tokens).encode(), offset


@settings(max_examples=400, deadline=None)
@given(case=headers())
def test_both_parsers_read_valid_headers_alike(case):
    header, data_len = case
    agree(header, data_len)


@settings(max_examples=600, deadline=None)
@given(case=headers(), position=st.integers(0, 10_000), byte=st.integers(0, 255),
       extra=st.integers(-2, 2))
def test_both_parsers_agree_on_damaged_headers(case, position, byte, extra):
    header, data_len = case
    damaged = bytearray(header)
    if damaged:
        damaged[position % len(damaged)] = byte
    agree(bytes(damaged), max(0, data_len + extra))


@pytest.mark.parametrize("text", [
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"shape":[1],"data_offsets":[0,4],"dtype":"F32"}}',
    ' { "a" : { "dtype" : "F32" , "shape" : [ 1 ] , "data_offsets" : [ 0 , 4 ] } } ',
    '{"\\u0061":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1e0],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"F32"}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"__metadata__":{},"__metadata__":{},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}\x00',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},}',
    '{"a\x01":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}  \n\t\r  ',
    '{"\xed\xa0\x80":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
    '{}',
    '{"__metadata__":{}}',
], ids=repr)
def test_both_parsers_agree_on_edge_cases(text):
    agree(text.encode("latin-1") if "\xed" in text else text.encode(), 4)


def test_both_parsers_agree_on_100000_entries():
    header = json.dumps({f"layer.{i}.weight": {"dtype": "F16", "shape": [2], "data_offsets":
                                               [4 * i, 4 * i + 4]} for i in range(100_000)},
                        separators=(",", ":")).encode()
    assert agree(header, 400_000)[0] == "ok"
