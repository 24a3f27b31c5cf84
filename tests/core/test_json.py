"""The standard library's json as fastst uses it where orjson cannot be (a
free-threaded build) reads every text as orjson does, and refuses what it refuses."""
import json

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from fastst import _json

TEXTS = [
    b"18446744073709551615", b"18446744073709551616", b"-9223372036854775808",
    b"-9223372036854775809", b"99999999999999999999", b"-9999999999999999999",
    b"-18446744073709551616", b"12345678901234567890e-5", b"1" * 309, b"1" * 400,
    b"1" * 5000, b"1e400", b"1e99999", b"1.7976931348623157e309", b"1e-400", b"1E2",
    b"0." + b"0" * 400 + b"1", b"-0", b"-0.0", b"-0e0", b"[-0]", b"[1e5,-1E-5,2.5e+3]",
    b"NaN", b"-Infinity", b"[Infinity]", b"01", b"1.", b"-", b"+1", b"[1,]", b"nul",
    b'"\\ud800"', b'"\\udc00"', b'"\\ud800\\u0041"', b'{"\\ud800":1}', b'["\\\\ud800"]',
    b'"\\ud83d\\ude00"', b'"\\uD800\\uDC00"', b'"\\uffff"', b'"\\u0000"', b'"\\/"', b'"\\x"',
    b"\xef\xbb\xbf{}", b'"\xff"', b'"\xed\xa0\x80"', b'"\xc0\xaf"', "{}".encode("utf-16"),
    b'"\x01"', b'"\x7f"', '"\u2028"'.encode(), b" \t\n\r{}\n", b"\x0c{}", b"", b"{} x",
    b'{"a":1,"a":2}', b'{"a" : 1 }', b'"a\\"b"', b'["\\"[","]"]', b'["\\\\","[[[["]',
    b"[" * 1024 + b"]" * 1024, b"[" * 1025 + b"]" * 1025, b"[" * 1024 + b"x",
    b'{"a":' * 1024 + b"1" + b"}" * 1024, b'{"a":' * 1025 + b"1" + b"}" * 1025,
    b'[{"a":' * 512 + b"1" + b"}]" * 512, b'[{"a":' * 513 + b"1" + b"}]" * 513,
    b'"' + b"[" * 2000 + b'"', b"[" * 100_000, b"[" * 10,
]


def tokens(value):
    """`value` as a flat list of (type, scalar) tokens, however deep it nests."""
    out, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            out.append(("dict", len(item)))
            pending.extend(reversed([part for pair in item.items() for part in pair]))
        elif isinstance(item, list):
            out.append(("list", len(item)))
            pending.extend(reversed(item))
        else:
            out.append((type(item).__name__, repr(item)))
    return out


def outcome(loads, text):
    try:
        return "read", tokens(loads(text))
    except _json.JSONDecodeError:
        return "refused", None


def agree(text: bytes):
    expected = outcome(orjson.loads, text)
    assert outcome(_json._stdlib_loads, text) == expected
    try:
        as_str = text.decode("utf-8")
    except UnicodeDecodeError:
        return
    assert outcome(_json._stdlib_loads, as_str) == outcome(orjson.loads, as_str)


@pytest.mark.parametrize("text", TEXTS, ids=lambda text: repr(text[:24]))
def test_json_reads_and_refuses_each_edge_case_as_orjson_does(text):
    agree(text)


def json_values(floats):
    return st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | floats
        | st.text(st.characters(codec="utf-8"), max_size=4),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                     max_size=3),
        max_leaves=12)


JSON_VALUES = json_values(st.floats(allow_nan=False))     # json writes inf as Infinity


@settings(max_examples=500, deadline=None)
@given(value=JSON_VALUES, position=st.integers(0, 1000), byte=st.integers(0, 255),
       damage=st.booleans())
def test_json_agrees_with_orjson_on_random_and_damaged_texts(value, position, byte, damage):
    text = bytearray(json.dumps(value, ensure_ascii=position % 2 == 0).encode())
    if damage and text:
        text[position % len(text)] = byte
    agree(bytes(text))


@settings(max_examples=300, deadline=None)
@given(value=json_values(st.floats(allow_nan=False, allow_infinity=False)))
def test_json_writes_what_orjson_writes(value):
    try:
        expected = orjson.dumps(value)
    except TypeError:       # ints beyond 64 bits: fastst writes none
        return
    written = _json._stdlib_dumps(value)
    assert tokens(orjson.loads(written)) == tokens(orjson.loads(expected))


def test_a_lone_surrogate_cannot_be_written():
    with pytest.raises(TypeError, match="UTF-8"):
        _json._stdlib_dumps({"\ud800": 1})


def test_a_float_json_cannot_hold_is_refused_not_written():
    with pytest.raises(ValueError):
        _json._stdlib_dumps([float("inf")])
