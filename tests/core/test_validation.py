"""Malformed and edge-case files, built byte by byte.

Every malformed case must be refused by all three entry points (``load`` on a
buffer, ``load_file`` and ``safe_open`` on a path) with a ``SafetensorError`` whose
message names the broken rule (and, for paths, the file). Every valid edge case
must load with exact values through the same three entry points.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

import fastst
from fastst import SafetensorError
from helpers import raw_file as st
from servers import http_store  # noqa: F401  (a fixture)

# The strict parser decodes with orjson, and with json as a free-threaded build does.
pytestmark = pytest.mark.usefixtures("json_codec")

U64_MAX = 2**64 - 1


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------

def t(dtype: str = "F32", shape=(1,), offsets=(0, 4)) -> dict:
    """One tensor entry."""
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def entry(dtype: str = "F32", shape: str = "[1]", offsets: str = "[0,4]") -> str:
    """One tensor entry as raw JSON text, for values json.dumps cannot write."""
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}'


def one(dtype: str = "F32", shape: str = "[1]", offsets: str = "[0,4]",
        data: bytes = b"\0" * 4) -> bytes:
    """A file holding the single tensor "a", its entry written as raw JSON text."""
    return st('{"a":' + entry(dtype, shape, offsets) + "}", data)


VALID_A = st({"a": t()}, b"\0" * 4)
ZIP_LOCAL_HEADER = b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + b"\0" * 20

DEEP = 10_000


def case(id: str, data: bytes, pattern: str):
    return pytest.param(data, pattern, id=id)


def header_cut(length: int, size: int) -> str:
    """The message for a header of `length` bytes in a file of `size`."""
    return (rf"the file is truncated: its header describes at least {8 + length} bytes, the "
            rf"file holds {size}$")


def data_cut(described: int, held: int, name: str, begin: int, end: int) -> str:
    """The message for a file of `held` bytes whose header describes more, the first
    tensor cut off being `name`."""
    return (rf"the file is truncated: its header describes {described} bytes, the file holds "
            rf"{held} \(tensor '{name}', at data_offsets \[{begin}, {end}\], is the first cut "
            rf"off\)$")


# ---------------------------------------------------------------------------
# Malformed files: (description, bytes, message regex)
# ---------------------------------------------------------------------------

PREFIX_CASES = [
    case("empty file", b"", r"file is 0 bytes, shorter than the 8-byte header length"),
    case("1-byte file", b"\x00", r"file is 1 bytes, shorter than the 8-byte"),
    case("7-byte file", b"\x02" + b"\0" * 6, r"file is 7 bytes, shorter than the 8-byte"),
    case("header length 0, nothing after", st(b"", length=0), r"header is not valid JSON"),
    case("header length 0, header after it", st(b"", b"{}      ", length=0),
         r"header is not valid JSON"),
    # past the end of the file: raising the limit would not help, and is not offered
    case("header length one past default limit",
         st("{}", length=100_000_001),
         header_cut(100_000_001, 16)),
    case("header length exactly at default limit, past EOF",
         st("{}", length=100_000_000),
         header_cut(100_000_000, 16)),
    case("header length 2**63", st("{}", length=2**63),
         header_cut(2**63, 16)),
    case("header length 2**64-1", st("{}", length=U64_MAX),
         header_cut(U64_MAX, 16)),
    case("header length one past EOF", st("{}", length=9),
         header_cut(9, 16)),
    case("header length 8 in an 8-byte file", struct.pack("<Q", 8),
         header_cut(8, 8)),
    case("header length larger than file, big-endian prefix",
         st("{}", prefix=struct.pack(">Q", 8)), header_cut(8 << 56, 16)),
]

JSON_CASES = [
    case("non-UTF-8 byte in a name", st(b'{"\xff":' + entry().encode() + b"}", b"\0" * 4),
         r"header is not valid UTF-8 \(byte 2\)"),
    case("non-UTF-8 byte in metadata value", st(b'{"__metadata__":{"k":"\xfe"}}'),
         r"header is not valid UTF-8 \(byte 22\)"),
    case("overlong UTF-8 encoding of NUL", st(b'{"__metadata__":{"k":"\xc0\x80"}}'),
         r"header is not valid UTF-8 \(byte 22\)"),
    case("UTF-8-encoded surrogate", st(b'{"__metadata__":{"k":"\xed\xa0\x80"}}'),
         r"header is not valid UTF-8 \(byte 22\)"),
    case("truncated UTF-8 sequence", st(b'{"__metadata__":{"k":"\xe2\x82"}}'),
         r"header is not valid UTF-8 \(byte 22\)"),
    case("UTF-8 BOM before the object", st(b"\xef\xbb\xbf{}"), r"header is not valid JSON"),
    case("NUL padding instead of spaces", st("{}", padding=b"\0"),
         r"header is not valid JSON"),
    case("raw NUL inside a name", st(b'{"a\x00":' + entry().encode() + b"}", b"\0" * 4),
         r"header is not valid JSON"),
    case("NUL before the object", st(b"\x00{}"), r"header is not valid JSON"),
    case("lone high surrogate escape in a name",
         st('{"\\ud800":' + entry() + "}", b"\0" * 4), r"header is not valid JSON"),
    case("lone low surrogate escape in a name",
         st('{"\\udc00":' + entry() + "}", b"\0" * 4), r"header is not valid JSON"),
    case("lone surrogate escape in metadata", st('{"__metadata__":{"k":"x\\ud800"}}'),
         r"header is not valid JSON"),
    case("reversed surrogate pair", st('{"__metadata__":{"k":"\\udc00\\ud800"}}'),
         r"header is not valid JSON"),
    case("header is a list", st("[]"), r"header must be a JSON object, got an array"),
    case("header is a string", st('"abc"'), r"header must be a JSON object, got a string"),
    case("header is a number", st("12"), r"header must be a JSON object, got an integer"),
    case("header is a float", st("1.5"), r"header must be a JSON object, got a float"),
    case("header is null", st("null"), r"header must be a JSON object, got null"),
    case("header is true", st("true"), r"header must be a JSON object, got a boolean"),
    case("header is blank", st("        "), r"header is not valid JSON"),
    case("trailing comma in the object", st('{"a":' + entry() + ",}", b"\0" * 4),
         r"header is not valid JSON"),
    case("trailing comma in shape", one(shape="[1,]"), r"header is not valid JSON"),
    case("trailing comma in metadata", st('{"__metadata__":{"k":"v",}}'),
         r"header is not valid JSON"),
    case("line comment", st('{"a":' + entry() + "} // note", b"\0" * 4),
         r"header is not valid JSON"),
    case("block comment", st('{/* note */"a":' + entry() + "}", b"\0" * 4),
         r"header is not valid JSON"),
    case("NaN in shape", one(shape="[NaN]"), r"header is not valid JSON"),
    case("Infinity in data_offsets", one(offsets="[0,Infinity]"), r"header is not valid JSON"),
    case("-Infinity in shape", one(shape="[-Infinity]"), r"header is not valid JSON"),
    case("single-quoted strings", st("{'__metadata__':{}}"), r"header is not valid JSON"),
    case("unquoted key", st('{a:' + entry() + "}", b"\0" * 4), r"header is not valid JSON"),
    case("truncated object", st('{"a":'), r"header is not valid JSON"),
    case("two objects", st("{}{}"), r"header is not valid JSON"),
    case("text after the object", st("{} x"), r"header is not valid JSON"),
    case("integer with 400 digits", one(shape="[1" + "0" * 400 + "]"),
         r"header is not valid JSON"),
    case(f"{DEEP} nested arrays in a tensor entry",
         st('{"a":{"dtype":"F32","shape":' + "[" * DEEP + "]" * DEEP
            + ',"data_offsets":[0,0]}}'),
         r"header is not valid JSON"),
    case(f"{DEEP} unclosed arrays in a tensor entry",
         st('{"a":{"dtype":"F32","shape":' + "[" * DEEP), r"header is not valid JSON"),
    case(f"{DEEP} nested arrays in __metadata__",
         st('{"__metadata__":{"k":' + "[" * DEEP + "]" * DEEP + "}}"),
         r"header is not valid JSON"),
    case(f"{DEEP} nested objects in __metadata__",
         st('{"__metadata__":' + '{"k":' * DEEP + '"v"' + "}" * DEEP + "}"),
         r"header is not valid JSON"),
    case("100 nested arrays in __metadata__",
         st('{"__metadata__":{"k":' + "[" * 100 + "]" * 100 + "}}"),
         r"__metadata__\['k'\] must be a string, got an array"),
    case("100 nested arrays in shape",
         st('{"a":{"dtype":"F32","shape":' + "[" * 100 + "]" * 100
            + ',"data_offsets":[0,0]}}'),
         r"tensor 'a': shape must hold unsigned integers, got an array"),
]

ENTRY_CASES = [
    case("entry is a list", st({"a": [1]}), r"tensor 'a': entry must be an object .*got an array"),
    case("entry is a string", st({"a": "F32"}), r"tensor 'a': entry must be an object .*got a string"),
    case("entry is null", st({"a": None}), r"tensor 'a': entry must be an object .*got null"),
    case("entry is a number", st({"a": 4}), r"tensor 'a': entry must be an object .*got an integer"),
    case("entry is empty", st({"a": {}}), r"tensor 'a': missing field 'dtype'"),
    case("missing dtype", st({"a": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
         r"tensor 'a': missing field 'dtype'"),
    case("missing shape", st({"a": {"dtype": "F32", "data_offsets": [0, 4]}}, b"\0" * 4),
         r"tensor 'a': missing field 'shape'"),
    case("missing data_offsets", st({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4),
         r"tensor 'a': missing field 'data_offsets'"),
    case("misspelled data_offsets", st({"a": {"dtype": "F32", "shape": [1], "offsets": [0, 4]}},
                                       b"\0" * 4),
         r"tensor 'a': missing field 'data_offsets'"),
    case("extra field", st({"a": {**t(), "extra": "x"}}, b"\0" * 4),
         r"tensor 'a': unexpected field 'extra'"),
    case("extra field that is null", st({"a": {**t(), "strides": None}}, b"\0" * 4),
         r"tensor 'a': unexpected field 'strides'"),
    case("dtype is a number", st({"a": t(dtype=7)}, b"\0" * 4),
         r"tensor 'a': dtype must be a string, got an integer"),
    case("dtype is null", st({"a": t(dtype=None)}, b"\0" * 4),
         r"tensor 'a': dtype must be a string, got null"),
    case("dtype is a list", st({"a": t(dtype=["F32"])}, b"\0" * 4),
         r"tensor 'a': dtype must be a string, got an array"),
    case("dtype is an object", st({"a": t(dtype={"F32": 1})}, b"\0" * 4),
         r"tensor 'a': dtype must be a string, got an object"),
    case("unknown dtype F128", st({"a": t(dtype="F128")}, b"\0" * 4),
         r"tensor 'a': unknown dtype 'F128'"),
    case("lower-case dtype f32", st({"a": t(dtype="f32")}, b"\0" * 4),
         r"tensor 'a': unknown dtype 'f32'"),
    case("dtype with trailing space", st({"a": t(dtype="F32 ")}, b"\0" * 4),
         r"tensor 'a': unknown dtype 'F32 '"),
    case("dtype with leading space", st({"a": t(dtype=" F32")}, b"\0" * 4),
         r"tensor 'a': unknown dtype ' F32'"),
    case("NumPy dtype name float32", st({"a": t(dtype="float32")}, b"\0" * 4),
         r"tensor 'a': unknown dtype 'float32'"),
    case("empty dtype", st({"a": t(dtype="")}, b"\0" * 4), r"tensor 'a': unknown dtype ''"),
    case("mixed-case dtype Bf16", st({"a": t(dtype="Bf16", offsets=(0, 2))}, b"\0" * 2),
         r"tensor 'a': unknown dtype 'Bf16'"),
    case("ml_dtypes-style F8_E4M3FN", st({"a": t(dtype="F8_E4M3FN", offsets=(0, 1))}, b"\0"),
         r"tensor 'a': unknown dtype 'F8_E4M3FN'"),
    case("dtype with NUL escape", st({"a": t(dtype="F32\0")}, b"\0" * 4),
         r"tensor 'a': unknown dtype 'F32\\x00'"),
    case("shape is a string", st({"a": {**t(), "shape": "1"}}, b"\0" * 4),
         r"tensor 'a': shape must be an array of unsigned integers, got a string"),
    case("shape is an integer", st({"a": {**t(), "shape": 1}}, b"\0" * 4),
         r"tensor 'a': shape must be an array of unsigned integers, got an integer"),
    case("shape is null", st({"a": {**t(), "shape": None}}, b"\0" * 4),
         r"tensor 'a': shape must be an array of unsigned integers, got null"),
    case("shape is an object", st({"a": {**t(), "shape": {"0": 1}}}, b"\0" * 4),
         r"tensor 'a': shape must be an array of unsigned integers, got an object"),
    case("float 1.0 in shape", one(shape="[1.0]"),
         r"tensor 'a': shape must hold unsigned integers, got a float"),
    case("exponent 1e0 in shape", one(shape="[1e0]"),
         r"tensor 'a': shape must hold unsigned integers, got a float"),
    case("exponent 1e2 in shape", one(dtype="U8", shape="[1e2]", offsets="[0,100]",
                                      data=b"\0" * 100),
         r"tensor 'a': shape must hold unsigned integers, got a float"),
    case("boolean in shape", one(shape="[true]"),
         r"tensor 'a': shape must hold unsigned integers, got a boolean"),
    case("string in shape", one(shape='["1"]'),
         r"tensor 'a': shape must hold unsigned integers, got a string"),
    case("null in shape", one(shape="[null]"),
         r"tensor 'a': shape must hold unsigned integers, got null"),
    case("nested list in shape", one(shape="[[1]]"),
         r"tensor 'a': shape must hold unsigned integers, got an array"),
    case("negative dim", one(shape="[-1]"),
         r"tensor 'a': shape must hold unsigned integers, got -1"),
    case("-0 in shape", one(dtype="U8", shape="[-0]", offsets="[0,0]", data=b""),
         r"tensor 'a': shape holds -0"),
    case("-0 in shape, second dim", one(dtype="U8", shape="[4,-0]", offsets="[0,0]", data=b""),
         r"tensor 'a': shape holds -0"),
    case("2**64 in shape", one(shape=f"[{2**64}]"),
         r"tensor 'a': shape must hold unsigned integers"),
    case("data_offsets is an object", st({"a": {**t(), "data_offsets": {"begin": 0, "end": 4}}},
                                         b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("data_offsets is a string", st({"a": {**t(), "data_offsets": "0,4"}}, b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("data_offsets is null", st({"a": {**t(), "data_offsets": None}}, b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("data_offsets of length 0", st({"a": t(offsets=())}, b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("data_offsets of length 1", st({"a": t(offsets=(4,))}, b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("data_offsets of length 3", st({"a": t(offsets=(0, 4, 4))}, b"\0" * 4),
         r"tensor 'a': data_offsets must be an array \[begin, end\]"),
    case("float in data_offsets", one(offsets="[0,4.0]"),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("boolean in data_offsets", one(offsets="[false,4]"),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("strings in data_offsets", one(offsets='["0","4"]'),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("null in data_offsets", one(offsets="[null,4]"),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("negative data_offsets", one(dtype="U8", shape="[4]", offsets="[-4,0]"),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("-0 in data_offsets", one(offsets="[-0,4]"), r"tensor 'a': data_offsets holds -0"),
    case("2**64 in data_offsets", one(offsets=f"[0,{2**64}]"),
         r"tensor 'a': data_offsets must hold unsigned integers"),
    case("begin past end", st({"a": t(offsets=(8, 4))}, b"\0" * 8),
         r"tensor 'a': data_offsets begin 8 is past end 4"),
]

SIZE_CASES = [
    case("element count overflows: [2**32, 2**32]", st({"a": t("U8", (2**32, 2**32), (0, 0))}),
         r"tensor 'a': element count of shape \[4294967296, 4294967296\] overflows 64 bits"),
    case("element count wraps to 2: [3, 6148914691236517206] F32, 8 bytes",
         st({"a": t("F32", (3, 6148914691236517206), (0, 8))}, b"\0" * 8),
         r"tensor 'a': element count of shape .* overflows 64 bits"),
    case("element count wraps to 1: [3, 12297829382473034411] F32, 4 bytes",
         st({"a": t("F32", (3, 12297829382473034411), (0, 4))}, b"\0" * 4),
         r"tensor 'a': element count of shape .* overflows 64 bits"),
    case("element count wraps to 0: [2**63, 2] U8", st({"a": t("U8", (2**63, 2), (0, 0))}),
         r"tensor 'a': element count of shape .* overflows 64 bits"),
    case("element count overflows with a later zero dim: [2**63, 2, 0]",
         st({"a": t("U8", (2**63, 2, 0), (0, 0))}),
         r"tensor 'a': element count of shape .* overflows 64 bits"),
    case("byte size wraps to 4: [2**62+1] F32",
         st({"a": t("F32", (2**62 + 1,), (0, 4))}, b"\0" * 4),
         r"tensor 'a': byte size of shape \[4611686018427387905\] x F32 overflows 64 bits"),
    case("byte size wraps to 0: [2**61] F64", st({"a": t("F64", (2**61,), (0, 0))}),
         r"tensor 'a': byte size of shape \[2305843009213693952\] x F64 overflows 64 bits"),
    case("byte size 2**62 of U8 fits in 64 bits but not in the buffer",
         st({"a": t("U8", (2**62,), (0, 2**62))}),
         data_cut(104 + 2**62, 104, "a", 0, 2**62)),
    case("byte size 2**61 of F4 fits in 64 bits but not in the buffer",
         st({"a": t("F4", (2**62,), (0, 2**61))}),
         data_cut(104 + 2**61, 104, "a", 0, 2**61)),
    case("2 F32 in 4 bytes", st({"a": t("F32", (2,), (0, 4))}, b"\0" * 4),
         r"tensor 'a': data_offsets \[0, 4\] hold 4 bytes but shape \[2\] x F32 needs 8"),
    case("scalar F32 in 8 bytes", st({"a": t("F32", (), (0, 8))}, b"\0" * 8),
         r"tensor 'a': data_offsets \[0, 8\] hold 8 bytes but shape \[\] x F32 needs 4"),
    case("zero-size U8 in 1 byte", st({"a": t("U8", (0,), (0, 1))}, b"\0"),
         r"tensor 'a': data_offsets \[0, 1\] hold 1 bytes but shape \[0\] x U8 needs 0"),
    case("BF16 counted as 1 byte", st({"a": t("BF16", (2,), (0, 2))}, b"\0" * 2),
         r"tensor 'a': data_offsets \[0, 2\] hold 2 bytes but shape \[2\] x BF16 needs 4"),
    case("F4 counted as 1 byte", st({"a": t("F4", (4,), (0, 4))}, b"\0" * 4),
         r"tensor 'a': data_offsets \[0, 4\] hold 4 bytes but shape \[4\] x F4 needs 2"),
    case("F6_E2M3 counted as 1 byte", st({"a": t("F6_E2M3", (4,), (0, 4))}, b"\0" * 4),
         r"tensor 'a': data_offsets \[0, 4\] hold 4 bytes but shape \[4\] x F6_E2M3 needs 3"),
    case("F4 x3: 12 bits", st({"a": t("F4", (3,), (0, 2))}, b"\0" * 2),
         r"tensor 'a': 3 elements of F4 \(4 bits each\) do not fill whole bytes"),
    case("F4 scalar: 4 bits", st({"a": t("F4", (), (0, 1))}, b"\0"),
         r"tensor 'a': 1 elements of F4 \(4 bits each\) do not fill whole bytes"),
    case("F4 [3, 3]: 36 bits", st({"a": t("F4", (3, 3), (0, 5))}, b"\0" * 5),
         r"tensor 'a': 9 elements of F4 \(4 bits each\) do not fill whole bytes"),
    case("F6_E2M3 x1: 6 bits", st({"a": t("F6_E2M3", (1,), (0, 1))}, b"\0"),
         r"tensor 'a': 1 elements of F6_E2M3 \(6 bits each\) do not fill whole bytes"),
    case("F6_E2M3 x5: 30 bits", st({"a": t("F6_E2M3", (5,), (0, 4))}, b"\0" * 4),
         r"tensor 'a': 5 elements of F6_E2M3 \(6 bits each\) do not fill whole bytes"),
    case("F6_E3M2 [2]: 12 bits", st({"a": t("F6_E3M2", (2,), (0, 2))}, b"\0" * 2),
         r"tensor 'a': 2 elements of F6_E3M2 \(6 bits each\) do not fill whole bytes"),
    case("F6_E3M2 [3, 2]: 36 bits", st({"a": t("F6_E3M2", (3, 2), (0, 5))}, b"\0" * 5),
         r"tensor 'a': 6 elements of F6_E3M2 \(6 bits each\) do not fill whole bytes"),
]

LAYOUT_CASES = [
    case("offsets past the end of an empty buffer", st({"a": t()}),
         data_cut(68, 64, "a", 0, 4)),
    case("offsets past the end by one byte", st({"a": t()}, b"\0" * 3),
         data_cut(68, 67, "a", 0, 4)),
    case("second tensor past the end",
         st({"a": t(), "b": t(offsets=(4, 8))}, b"\0" * 6),
         data_cut(128, 126, "b", 4, 8)),
    case("zero-size tensor at u64 max", st({"a": t("U8", (0,), (U64_MAX, U64_MAX))}),
         data_cut(104 + U64_MAX, 104, "a", U64_MAX, U64_MAX)),
    case("hole between tensors",
         st({"a": t(), "b": t(offsets=(8, 12))}, b"\0" * 12),
         r"tensor 'b': data_offsets begin 8 leaves a gap of 4 bytes"),
    case("hole between tensors, header out of buffer order",
         st({"b": t(offsets=(8, 12)), "a": t()}, b"\0" * 12),
         r"tensor 'b': data_offsets begin 8 leaves a gap of 4 bytes"),
    case("first tensor not at 0", st({"a": t(offsets=(4, 8))}, b"\0" * 8),
         r"tensor 'a': data_offsets begin 4 leaves a gap of 4 bytes"),
    case("overlapping tensors",
         st({"a": t("F32", (2,), (0, 8)), "b": t("F32", (2,), (4, 12))}, b"\0" * 12),
         r"tensor 'b': data_offsets \[4, 12\] overlap tensor 'a'"),
    case("two tensors on the same bytes", st({"a": t(), "b": t()}, b"\0" * 4),
         r"tensor '[ab]': data_offsets \[0, 4\] overlap tensor '[ab]'"),
    case("zero-size tensor inside another",
         st({"a": t("F32", (2,), (0, 8)), "b": t("U8", (0,), (4, 4))}, b"\0" * 8),
         r"tensor 'b': data_offsets \[4, 4\] overlap tensor 'a'"),
    case("one trailing byte", VALID_A + b"\0",
         r"1 trailing bytes after the last tensor: the tensors cover 4 of the buffer's 5 bytes"),
    case("ZIP local-file header appended", VALID_A + ZIP_LOCAL_HEADER,
         r"30 trailing bytes after the last tensor"),
    case("empty header with data", st("{}", b"\0" * 4),
         r"4 trailing bytes after the last tensor: the tensors cover 0 of"),
    case("metadata only with data", st({"__metadata__": {"k": "v"}}, b"abc"),
         r"3 trailing bytes after the last tensor"),
    case("zero-size tensor followed by data", st({"a": t("U8", (0,), (0, 0))}, b"\0"),
         r"1 trailing bytes after the last tensor"),
]

DUPLICATE_CASES = [
    case("duplicate tensor name, same entry",
         st('{"a":' + entry() + ',"a":' + entry() + "}", b"\0" * 4),
         r"duplicate tensor name 'a'"),
    case("duplicate tensor name, entries tiling the buffer",
         st('{"a":' + entry() + ',"a":' + entry(offsets="[4,8]") + "}", b"\0" * 8),
         r"duplicate tensor name 'a'"),
    case("duplicate tensor name spelled with \\u0061",
         st('{"a":' + entry() + ',"\\u0061":' + entry() + "}", b"\0" * 4),
         r"duplicate tensor name 'a'"),
    case("duplicate tensor name spelled with \\/",
         st('{"x/y":' + entry() + ',"x\\/y":' + entry() + "}", b"\0" * 4),
         r"duplicate tensor name 'x/y'"),
    case("duplicate name holding a colon",
         st('{"a:b":' + entry() + ',"a:b":' + entry() + "}", b"\0" * 4),
         r"duplicate tensor name 'a:b'"),
    case("duplicate __metadata__",
         st('{"__metadata__":{"k":"v"},"__metadata__":{"k":"v"}}'),
         r"duplicate __metadata__ key '__metadata__'"),
    case("duplicate metadata key", st('{"__metadata__":{"k":"v","k":"v"}}'),
         r"__metadata__: duplicate key 'k'"),
    case("duplicate metadata key with different values",
         st('{"__metadata__":{"k":"v","k":"w"}}'),
         r"__metadata__: duplicate key 'k'"),
    case("duplicate metadata key spelled with \\u006b",
         st('{"__metadata__":{"k":"v","\\u006b":"v"}}'),
         r"__metadata__: duplicate key 'k'"),
    case("duplicate dtype field",
         st('{"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
         r"tensor 'a': duplicate key 'dtype'"),
    case("duplicate shape field with different values",
         st('{"a":{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
         r"tensor 'a': duplicate key 'shape'"),
    case("duplicate data_offsets field",
         st('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8],"data_offsets":[0,4]}}',
            b"\0" * 4),
         r"tensor 'a': duplicate key 'data_offsets'"),
]

METADATA_CASES = [
    case("__metadata__ is a list", st({"__metadata__": ["k", "v"]}),
         r"__metadata__ must be an object mapping strings to strings, got an array"),
    case("__metadata__ is a string", st({"__metadata__": "k=v"}),
         r"__metadata__ must be an object mapping strings to strings, got a string"),
    case("__metadata__ is null", st({"__metadata__": None}),
         r"__metadata__ must be an object mapping strings to strings, got null"),
    case("__metadata__ is a number", st({"__metadata__": 0}),
         r"__metadata__ must be an object mapping strings to strings, got an integer"),
    case("metadata value is an integer", st({"__metadata__": {"k": 1}}),
         r"__metadata__\['k'\] must be a string, got an integer"),
    case("metadata value is a float", st({"__metadata__": {"k": 1.5}}),
         r"__metadata__\['k'\] must be a string, got a float"),
    case("metadata value is null", st({"__metadata__": {"k": None}}),
         r"__metadata__\['k'\] must be a string, got null"),
    case("metadata value is a boolean", st({"__metadata__": {"k": True}}),
         r"__metadata__\['k'\] must be a string, got a boolean"),
    case("metadata value is a list", st({"__metadata__": {"k": ["v"]}}),
         r"__metadata__\['k'\] must be a string, got an array"),
    case("metadata value is an object", st({"__metadata__": {"k": {"v": "w"}}}),
         r"__metadata__\['k'\] must be a string, got an object"),
    case("tensor entry under the __metadata__ name", st({"__metadata__": t()}, b"\0" * 4),
         r"__metadata__\['shape'\] must be a string, got an array"),
]

MALFORMED = (PREFIX_CASES + JSON_CASES + ENTRY_CASES + SIZE_CASES + LAYOUT_CASES
             + DUPLICATE_CASES + METADATA_CASES)


def _write(tmp_path, data: bytes) -> str:
    path = tmp_path / "case.safetensors"
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("data, pattern", MALFORMED)
def test_load_rejects(data, pattern):
    with pytest.raises(SafetensorError, match=pattern) as info:
        fastst.load(data)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("data, pattern", MALFORMED)
def test_load_file_rejects(tmp_path, data, pattern):
    path = _write(tmp_path, data)
    with pytest.raises(SafetensorError, match=pattern) as info:
        fastst.load_file(path)
    assert path in str(info.value)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("data, pattern", MALFORMED)
def test_safe_open_rejects(tmp_path, data, pattern, backend):
    path = _write(tmp_path, data)
    with pytest.raises(SafetensorError, match=pattern) as info:
        fastst.safe_open(path, framework="np", backend=backend)
    assert path in str(info.value)


# ---------------------------------------------------------------------------
# The header-size limit, set with max_header_size=
# ---------------------------------------------------------------------------

EIGHT_BYTE_HEADER = st("{}")          # "{}" plus six spaces: a header of exactly 8 bytes


def _open_all(tmp_path, data: bytes, **kwargs):
    """Open `data` through all three entry points; return what each gives."""
    path = _write(tmp_path, data)
    got = [fastst.load(data, **kwargs), fastst.load_file(path, **kwargs)]
    with fastst.safe_open(path, framework="np", **kwargs) as f:
        got.append({name: f.get_tensor(name) for name in f.keys()})
    return path, got


def _refuse_all(tmp_path, data: bytes, pattern: str, **kwargs):
    path = _write(tmp_path, data)
    with pytest.raises(SafetensorError, match=pattern):
        fastst.load(data, **kwargs)
    with pytest.raises(SafetensorError, match=pattern) as info:
        fastst.load_file(path, **kwargs)
    assert path in str(info.value)
    with pytest.raises(SafetensorError, match=pattern) as info:
        fastst.safe_open(path, framework="np", **kwargs)
    assert path in str(info.value)


def test_header_exactly_at_limit_is_read(tmp_path):
    _, got = _open_all(tmp_path, EIGHT_BYTE_HEADER, max_header_size=8)
    assert got == [{}, {}, {}]


def test_header_one_past_limit_is_refused(tmp_path):
    _refuse_all(tmp_path, EIGHT_BYTE_HEADER, r"header length 8 exceeds the limit of 7 bytes",
                max_header_size=7)


def test_limit_zero_refuses_any_header(tmp_path):
    _refuse_all(tmp_path, EIGHT_BYTE_HEADER, r"header length 8 exceeds the limit of 0 bytes",
                max_header_size=0)


def test_raising_the_limit_is_offered_only_when_a_header_follows_the_prefix(tmp_path):
    """A length over the limit but within the file: raising the limit is the answer
    when a JSON header follows, never when something else does."""
    header = {"a": t()}
    _refuse_all(tmp_path, st(header, b"\0" * 4),
                r"header length 56 exceeds the limit of 10 bytes \(raise max_header_size "
                r"to read it\)$", max_header_size=10)
    no_header = struct.pack("<Q", 56) + b"x" * 56 + b"\0" * 4
    _refuse_all(tmp_path, no_header,
                r"not a safetensors file: its first 8 bytes give a header length of 56, and "
                r"no JSON header follows them$", max_header_size=10)


def test_limit_counts_padding(tmp_path):
    """The limit applies to the padded length the prefix states, not the JSON text."""
    data = st({"__metadata__": {"k": "v" * 20}})
    assert len(data) - 8 == 48
    _open_all(tmp_path, data, max_header_size=48)
    _refuse_all(tmp_path, data, r"header length 48 exceeds the limit of 47", max_header_size=47)


@pytest.mark.parametrize("length", [U64_MAX, U64_MAX - 7, U64_MAX - 6, 2**63, 2**63 - 1],
                         ids=["2**64-1", "2**64-8 (+8 wraps to 0)", "2**64-7 (+8 wraps to 1)",
                              "2**63", "2**63-1"])
def test_header_length_whose_plus_8_would_wrap(tmp_path, length):
    """With the limit lifted to u64 max, a length near 2**64 must still be refused as
    running past the end of the file, never wrap around to a small data start."""
    data = st("{}", length=length)
    _refuse_all(tmp_path, data, header_cut(length, 16), max_header_size=U64_MAX)


def test_header_length_at_default_limit_in_a_large_enough_file_is_read(tmp_path):
    """A header of exactly 100,000,000 bytes is the largest the default accepts."""
    limit = fastst.DEFAULT_MAX_HEADER_SIZE
    assert limit == 100_000_000
    data = struct.pack("<Q", limit) + b"{}" + b" " * (limit - 2)
    assert fastst.load(data) == {}
    assert fastst.load_file(_write(tmp_path, data)) == {}


# ---------------------------------------------------------------------------
# Not a file
# ---------------------------------------------------------------------------

def test_missing_file(tmp_path):
    path = str(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError):
        fastst.load_file(path)
    with pytest.raises(FileNotFoundError):
        fastst.safe_open(path, framework="np")


def test_directory_without_a_checkpoint(tmp_path):
    with pytest.raises(fastst.SafetensorError, match="no model.safetensors.index.json"):
        fastst.load_file(tmp_path)
    with pytest.raises(fastst.SafetensorError, match="no model.safetensors.index.json"):
        fastst.safe_open(str(tmp_path), framework="np")


def test_fifo_is_not_a_regular_file(tmp_path):
    path = str(tmp_path / "pipe")
    os.mkfifo(path)
    with pytest.raises(SafetensorError, match="not a regular file") as info:
        fastst.safe_open(path, framework="np")
    assert path in str(info.value)


def test_load_rejects_non_buffers():
    with pytest.raises(TypeError):
        fastst.load("not bytes")


# ---------------------------------------------------------------------------
# Files of other formats: named by what their first bytes say, whoever opens them
# ---------------------------------------------------------------------------

def _npy(array) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def _npz(**arrays) -> bytes:
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


# what `python -m http.server` answers for a folder
FOLDER_LISTING = (b'<!DOCTYPE HTML>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
                  b"<title>Directory listing for /</title>\n</head>\n<body>\n<ul>\n"
                  b'<li><a href="model.safetensors">model.safetensors</a></li>\n</ul>\n'
                  b"</body>\n</html>\n")
ANOTHER_FORMAT = {
    "npy": (_npy(np.arange(100)), "it is a NumPy .npy file"),
    "npz": (_npz(x=np.arange(100)), "it is a zip archive (.npz, .pt, wheel...)"),
    "pickle, protocol 2": (pickle.dumps({"x": list(range(50))}, protocol=2),
                           "it is a Python pickle"),
    "pickle, protocol 5": (pickle.dumps({"x": list(range(50))}, protocol=5),
                           "it is a Python pickle"),
    "HDF5": (b"\x89HDF\r\n\x1a\n\x00\x00\x00\x00\x00\x08\x08\x00" + bytes(200),
             "it is an HDF5 file"),
    "GGUF": (b"GGUF" + struct.pack("<IQQ", 3, 2, 0) + bytes(100), "it is a GGUF file"),
    "gzip": (gzip.compress(fastst.save({"x": np.arange(100)})),
             "it is gzip-compressed (decompress it first)"),
    "JSON": (json.dumps({"metadata": {"total_size": 8},
                         "weight_map": {"x": "model-00001-of-00002.safetensors"}}).encode(),
             "it is JSON text (a sharded checkpoint is opened by its directory or its "
             "*.index.json)"),
    "text": ("Modèle: these are not tensors\n".encode(), "it is text"),
    "HTML": (FOLDER_LISTING, "it is an HTML page (a web page or a folder listing, not "
                             "the file itself)"),
    "Git LFS pointer": (b"version https://git-lfs.github.com/spec/v1\noid sha256:"
                        + b"0" * 64 + b"\nsize 1234567\n",
                        "it is a Git LFS pointer, not the file it stands for (git lfs pull "
                        "fetches it)"),
}


@pytest.mark.parametrize("kind", ANOTHER_FORMAT)
def test_a_file_of_another_format_is_named_by_every_way_of_opening_it(
        tmp_path, kind, http_store):
    """A path (either backend), a buffer, a file object and a URL give the same message,
    and none offers to raise max_header_size: no limit makes such a file readable."""
    data, what = ANOTHER_FORMAT[kind]
    path = _write(tmp_path, data)
    http_store.objects["/other"] = data
    url = f"{http_store.url}/other"
    opening = {
        path: [lambda: fastst.load_file(path),
               lambda: fastst.safe_open(path, backend="pread"),
               lambda: fastst.load_file(path, max_header_size=2**64 - 1)],
        "<buffer>": [lambda: fastst.load(data)],
        "<BytesIO>": [lambda: fastst.safe_open(io.BytesIO(data))],
        url: [lambda: fastst.load_file(url), lambda: fastst.safe_open(url)],
    }
    for source, opens in opening.items():
        for open_it in opens:
            with pytest.raises(SafetensorError) as info:
                open_it()
            assert str(info.value) == f"{source}: not a safetensors file: {what}"


def test_a_length_past_the_end_and_no_header_after_it_is_not_a_safetensors_file(tmp_path):
    data = b"\xff" * 8 + bytes(32)
    message = ("not a safetensors file: its first 8 bytes give a header length of "
               "18446744073709551615, past the end of the 40-byte file")
    with pytest.raises(SafetensorError, match=f"^<buffer>: {message}$"):
        fastst.load(data)
    with pytest.raises(SafetensorError, match=f": {message}$"):
        fastst.safe_open(_write(tmp_path, data))


# ---------------------------------------------------------------------------
# Valid edge cases: (description, bytes, expected tensors, expected metadata)
# ---------------------------------------------------------------------------

def _f32(*values) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


def _valid(id, data, tensors, metadata=None):
    return pytest.param(data, tensors, metadata, id=id)


SIXTY_FOUR_ZERO_DIMS = (0,) * 64
TINY_COUNT = 20_000
TINY = st({f"t{i:05d}": t("U8", (1,), (i, i + 1)) for i in range(TINY_COUNT)},
          bytes(i % 256 for i in range(TINY_COUNT)))

UNICODE_NAMES = ["é", "名前", "😀", "a b", 'a"b', "a\\b", "", "\0", "a:b", "a-b", "-0",
                 "\u2028", "__metadata", "__METADATA__", "x" * 300]

VALID = [
    _valid("empty header {}", st("{}"), {}),
    _valid("unpadded {} of length 2", st("{}", align=1), {}),
    _valid("metadata only", st({"__metadata__": {"format": "np"}}), {}, {"format": "np"}),
    _valid("empty metadata", st({"__metadata__": {}}), {}, {}),
    _valid("metadata with JSON punctuation",
           st({"__metadata__": {"a:b": 'x,"y":-0', "-1": "{}[]:,\\"}}),
           {}, {"a:b": 'x,"y":-0', "-1": "{}[]:,\\"}),
    _valid("metadata after tensors",
           st('{"a":' + entry() + ',"__metadata__":{"k":"v"}}', _f32(1.5)),
           {"a": np.array([1.5], "<f4")}, {"k": "v"}),
    _valid("scalar F32", st({"a": t("F32", (), (0, 4))}, _f32(2.5)),
           {"a": np.array(2.5, "<f4")}),
    _valid("scalar BOOL and I64",
           st({"b": t("BOOL", (), (8, 9)), "i": t("I64", (), (0, 8))},
              struct.pack("<q", -7) + b"\x01"),
           {"b": np.array(True), "i": np.array(-7, "<i8")}),
    _valid("zero-size F32", st({"a": t("F32", (0,), (0, 0))}), {"a": np.zeros(0, "<f4")}),
    _valid("zero dim next to 2**40: [0, 2**40] U8", st({"a": t("U8", (0, 2**40), (0, 0))}),
           {"a": np.zeros((0, 2**40), np.uint8)}),
    _valid("2**40 next to zero dim: [2**40, 0] F64", st({"a": t("F64", (2**40, 0), (0, 0))}),
           {"a": np.zeros((2**40, 0), "<f8")}),
    _valid("zero dim next to 2**63-1: [0, 2**63-1] U8",
           st({"a": t("U8", (0, 2**63 - 1), (0, 0))}),
           {"a": np.zeros((0, 2**63 - 1), np.uint8)}),
    _valid("64 zero dims", st({"a": t("I32", SIXTY_FOUR_ZERO_DIMS, (0, 0))}),
           {"a": np.zeros(SIXTY_FOUR_ZERO_DIMS, "<i4")}),
    _valid("zero-size tensors between others",
           st({"a": t("F32", (1,), (0, 4)), "z": t("U8", (0,), (4, 4)),
               "y": t("F64", (0, 3), (4, 4)), "b": t("F32", (1,), (4, 8))}, _f32(1, 2)),
           {"a": np.array([1], "<f4"), "b": np.array([2], "<f4"),
            "y": np.zeros((0, 3), "<f8"), "z": np.zeros(0, np.uint8)}),
    _valid("zero-size tensor at the end",
           st({"a": t(), "z": t("U8", (0,), (4, 4))}, _f32(3)),
           {"a": np.array([3], "<f4"), "z": np.zeros(0, np.uint8)}),
    _valid("leading whitespace", st(" \n\t\r{}"), {}),
    _valid("whitespace everywhere",
           st(' { "a" : { "dtype" : "F32" , "shape" : [ 1 ] , "data_offsets" : [ 0 , 4 ] } }\n',
              _f32(4)),
           {"a": np.array([4], "<f4")}),
    _valid("trailing newline and tab", st("{}\n\t"), {}),
    _valid("padding longer than needed", st("{}" + " " * 62), {}),
    _valid("buffer order differs from header order",
           st({"a": t("F32", (1,), (4, 8)), "b": t("F32", (1,), (0, 4))}, _f32(1, 2)),
           {"a": np.array([2], "<f4"), "b": np.array([1], "<f4")}),
    _valid("keys out of order in the entry",
           st('{"a":{"data_offsets":[0,4],"shape":[1],"dtype":"F32"}}', _f32(5)),
           {"a": np.array([5], "<f4")}),
    _valid("escaped name \\u00e9", st('{"\\u00e9":' + entry() + "}", _f32(6)),
           {"é": np.array([6], "<f4")}),
    _valid("surrogate-pair escape", st('{"\\ud83d\\ude00":' + entry() + "}", _f32(7)),
           {"😀": np.array([7], "<f4")}),
    _valid("unicode and escaped names",
           st({name: t("U8", (1,), (i, i + 1)) for i, name in enumerate(UNICODE_NAMES)},
              bytes(range(len(UNICODE_NAMES)))),
           {name: np.array([i], np.uint8) for i, name in enumerate(UNICODE_NAMES)}),
    _valid("ensure_ascii=False names",
           st(json.dumps({"名前": t(), "é": t("F32", (1,), (4, 8))},
                         separators=(",", ":"), ensure_ascii=False), _f32(8, 9)),
           {"名前": np.array([8], "<f4"), "é": np.array([9], "<f4")}),
    _valid("U64 max value",
           st({"a": t("U64", (1,), (0, 8))}, struct.pack("<Q", U64_MAX)),
           {"a": np.array([U64_MAX], "<u8")}),
    _valid("BF16 and F8 tensors",
           st({"b": t("BF16", (2,), (0, 4)), "e": t("F8_E4M3", (2,), (4, 6)),
               "m": t("F8_E5M2", (1,), (6, 7)), "z": t("F8_E8M0", (1,), (7, 8))},
              np.array([1.5, -2], ml_dtypes.bfloat16).tobytes()
              + np.array([0.5, 3], ml_dtypes.float8_e4m3fn).tobytes()
              + np.array([-4], ml_dtypes.float8_e5m2).tobytes()
              + np.array([8], ml_dtypes.float8_e8m0fnu).tobytes()),
           {"b": np.array([1.5, -2], ml_dtypes.bfloat16),
            "e": np.array([0.5, 3], ml_dtypes.float8_e4m3fn),
            "m": np.array([-4], ml_dtypes.float8_e5m2),
            "z": np.array([8], ml_dtypes.float8_e8m0fnu)}),
    _valid("unpadded header, F32 data at an unaligned address",
           st('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', _f32(1.25, -3), align=1),
           {"a": np.array([1.25, -3], "<f4")}),
    _valid("F64 at an odd offset",
           st({"u": t("U8", (1,), (0, 1)), "d": t("F64", (1,), (1, 9))},
              b"\x05" + struct.pack("<d", 0.1)),
           {"u": np.array([5], np.uint8), "d": np.array([0.1], "<f8")}),
    _valid(f"{TINY_COUNT} tiny tensors", TINY,
           {f"t{i:05d}": np.array([i % 256], np.uint8) for i in range(TINY_COUNT)}),
]

# Sub-byte dtypes surface as packed uint8: the last axis holds the bytes when it
# packs evenly (last dim x bits is a multiple of 8), otherwise one flat axis of bytes.
PACKED = [
    ("F4 [4]", "F4", (4,), (2,)),
    ("F4 [3, 2]", "F4", (3, 2), (3, 1)),
    ("F4 [2, 2, 4]", "F4", (2, 2, 4), (2, 2, 2)),
    ("F4 [2, 3] flat", "F4", (2, 3), (3,)),
    ("F4 [0]", "F4", (0,), (0,)),
    ("F4 [5, 0]", "F4", (5, 0), (5, 0)),
    ("F4 [0, 3] flat", "F4", (0, 3), (0,)),
    ("F6_E2M3 [4]", "F6_E2M3", (4,), (3,)),
    ("F6_E2M3 [2, 4]", "F6_E2M3", (2, 4), (2, 3)),
    ("F6_E2M3 [4, 3] flat", "F6_E2M3", (4, 3), (9,)),
    ("F6_E3M2 [8]", "F6_E3M2", (8,), (6,)),
    ("F6_E3M2 [4, 2] flat", "F6_E3M2", (4, 2), (6,)),
]

for _id, _code, _shape, _packed in PACKED:
    _n = int(np.prod(_packed))
    _bytes = bytes((7 * i + 3) % 256 for i in range(_n))
    VALID.append(_valid(f"packed {_id} -> {_packed}",
                        st({"p": t(_code, _shape, (0, _n))}, _bytes),
                        {"p": np.frombuffer(_bytes, np.uint8).reshape(_packed)}))


def _assert_same(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        have = got[name]
        assert have.dtype == want.dtype, name
        assert have.shape == want.shape, name
        if have.size:
            assert have.tobytes() == want.tobytes(), name


@pytest.mark.parametrize("data, tensors, metadata", VALID)
def test_valid_load(data, tensors, metadata):
    _assert_same(fastst.load(data), tensors)


@pytest.mark.parametrize("data, tensors, metadata", VALID)
def test_valid_load_file(tmp_path, data, tensors, metadata):
    _assert_same(fastst.load_file(_write(tmp_path, data)), tensors)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("data, tensors, metadata", VALID)
def test_valid_safe_open(tmp_path, data, tensors, metadata, backend):
    with fastst.safe_open(_write(tmp_path, data), framework="np", backend=backend) as f:
        assert f.keys() == sorted(tensors)
        assert f.metadata() == metadata
        _assert_same({name: f.get_tensor(name) for name in f.keys()}, tensors)


def test_buffer_order_is_offset_order():
    data = st({"a": t("F32", (1,), (4, 8)), "b": t("F32", (1,), (0, 4))}, _f32(1, 2))
    assert list(fastst.load(data)) == ["b", "a"]


def test_buffer_order_through_safe_open(tmp_path):
    data = st({"c": t("F32", (1,), (4, 8)), "a": t("F32", (1,), (8, 12)),
               "b": t("F32", (1,), (0, 4))}, _f32(1, 2, 3))
    with fastst.safe_open(_write(tmp_path, data), framework="np") as f:
        assert f.keys() == ["a", "b", "c"]
        assert f.offset_keys() == ["b", "c", "a"]
        assert list(f.get_tensors()) == ["b", "c", "a"]


def test_packed_dtypes_report_their_logical_shape(tmp_path):
    data = st({"p": t("F4", (3, 2), (0, 3))}, b"\x12\x34\x56")
    with fastst.safe_open(_write(tmp_path, data), framework="np") as f:
        s = f.get_slice("p")
        assert s.get_dtype() == "F4"
        assert s.get_shape() == [3, 2]
        assert f.get_tensor("p").shape == (3, 1)
        assert f.get_tensor("p").dtype == np.uint8
        assert s[1].tobytes() == b"\x34"


def test_loaded_buffer_arrays_are_read_only_for_bytes_and_writable_for_bytearray():
    data = st({"a": t()}, _f32(1))
    assert not fastst.load(data)["a"].flags.writeable
    assert fastst.load(bytearray(data))["a"].flags.writeable
    assert fastst.load(memoryview(data))["a"].tobytes() == _f32(1)


# ---------------------------------------------------------------------------
# Shapes the header allows but NumPy cannot hold
# ---------------------------------------------------------------------------

UNREPRESENTABLE = [
    pytest.param("U8", (0, 2**63), id="[0, 2**63] U8: a dim past 2**63-1"),
    pytest.param("U8", (2**64 - 1, 0), id="[2**64-1, 0] U8: a dim past 2**63-1"),
    pytest.param("U8", (2**40, 0, 2**40), id="[2**40, 0, 2**40] U8: non-zero dims overflow intp"),
    pytest.param("F64", (0, 2**61), id="[0, 2**61] F64: bytes of non-zero dims overflow intp"),
    pytest.param("U8", (1,) * 65, id="65 dims"),
]


@pytest.mark.parametrize("code, shape", UNREPRESENTABLE)
def test_valid_header_with_shape_numpy_cannot_hold(tmp_path, code, shape):
    """The header is valid (the element count is 0 or 1, the offsets tile the buffer)
    but NumPy cannot make an array of this shape. The file opens, its header is
    readable, and asking for the array raises a SafetensorError that names the tensor
    and its shape; load and load_file, which build every array, raise the same."""
    count = int(np.prod(shape, dtype=object))
    data = st({"a": t(code, shape, (0, count))}, b"\0" * count)
    path = _write(tmp_path, data)
    pattern = r"tensor 'a': shape \[.*\] cannot be a NumPy array"
    with fastst.safe_open(path, framework="np") as f:
        assert f.keys() == ["a"]
        assert f.get_slice("a").get_shape() == list(shape)
        with pytest.raises(SafetensorError, match=pattern):
            f.get_tensor("a")
    with pytest.raises(SafetensorError, match=pattern):
        fastst.load(data)
    with pytest.raises(SafetensorError, match=pattern):
        fastst.load_file(path)
    with fastst.safe_open(path, framework="np", backend="pread") as f:
        with pytest.raises(SafetensorError, match=pattern):
            f.get_tensor("a")


# ---------------------------------------------------------------------------
# Files the reference accepts and fastst refuses on purpose
# ---------------------------------------------------------------------------

STRICTER = [
    case("duplicate tensor name (reference keeps one)",
         st('{"a":' + entry() + ',"a":' + entry() + "}", _f32(1)),
         r"duplicate tensor name 'a'"),
    case("duplicate tensor name via \\u0061 escape (reference keeps one)",
         st('{"a":' + entry() + ',"\\u0061":' + entry() + "}", _f32(1)),
         r"duplicate tensor name 'a'"),
    case("duplicate tensor name via \\/ escape (reference keeps one)",
         st('{"x/y":' + entry() + ',"x\\/y":' + entry() + "}", _f32(1)),
         r"duplicate tensor name 'x/y'"),
    case("duplicate metadata key (reference keeps the last)",
         st('{"__metadata__":{"k":"v","k":"w"}}'), r"__metadata__: duplicate key 'k'"),
    case("extra field in a tensor entry (reference ignores it)",
         st({"a": {**t(), "extra": "x"}}, _f32(1)), r"tensor 'a': unexpected field 'extra'"),
    case("extra null field in a tensor entry (reference ignores it)",
         st({"a": {**t(), "strides": None}}, _f32(1)), r"tensor 'a': unexpected field 'strides'"),
    case("__metadata__ null (reference reads no metadata)", st({"__metadata__": None}),
         r"__metadata__ must be an object mapping strings to strings, got null"),
]

# The reference refuses these too (serde rejects duplicate fields, and -0 parses
# as a float there); kept here so a change on either side shows up.
BOTH_REFUSE = [
    case("duplicate field in a tensor entry",
         st('{"a":{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}}', _f32(1)),
         r"tensor 'a': duplicate key 'shape'"),
    case("-0 in shape", one(dtype="U8", shape="[-0]", offsets="[0,0]", data=b""),
         r"tensor 'a': shape holds -0"),
    case("-0 in data_offsets", one(offsets="[-0,4]", data=_f32(1)),
         r"tensor 'a': data_offsets holds -0"),
]


def _reference_accepts(tmp_path, data):
    """The reference's numpy loader and safe_open both read `data` without error."""
    safetensors = pytest.importorskip("safetensors")
    import safetensors.numpy

    safetensors.numpy.load(data)
    path = _write(tmp_path, data)
    with safetensors.safe_open(path, framework="np") as f:
        for name in f.keys():
            f.get_tensor(name)
        f.metadata()


@pytest.mark.parametrize("data, pattern", STRICTER)
def test_reference_accepts_what_fastst_refuses(tmp_path, data, pattern):
    """Documented strictness: these files load in the reference but are ambiguous or
    malformed, so fastst refuses them with a message naming the rule."""
    _reference_accepts(tmp_path, data)
    _refuse_all(tmp_path, data, pattern)


@pytest.mark.parametrize("data, pattern", BOTH_REFUSE)
def test_reference_and_fastst_both_refuse(tmp_path, data, pattern):
    safetensors = pytest.importorskip("safetensors")
    import safetensors.numpy

    with pytest.raises(Exception):
        safetensors.numpy.load(data)
    _refuse_all(tmp_path, data, pattern)


# ---------------------------------------------------------------------------
# Mutated files: never anything but a SafetensorError, never laxer than the reference
# ---------------------------------------------------------------------------

MUTATION_BASES = [
    st({"__metadata__": {"k": "v"}, "a": t("F32", (2,), (0, 8)), "b": t("U8", (0, 3), (8, 8)),
        "c": t("F4", (2, 2), (8, 10))}, b"\0" * 10),
    st({"a": t("I16", (1, 2), (0, 4)), "b": t("F6_E2M3", (4,), (4, 7))}, b"\1" * 7),
]
MUTATION_BYTES = b'{}[]",:-0123456789 eE.\\tnulfas\x00\xff'


@hst.composite
def mutated_files(draw) -> bytes:
    data = bytearray(draw(hst.sampled_from(MUTATION_BASES)))
    for _ in range(draw(hst.integers(1, 3))):
        pos = draw(hst.integers(0, len(data) - 1))
        op = draw(hst.sampled_from(["replace", "delete", "insert"]))
        byte = draw(hst.sampled_from(MUTATION_BYTES))
        if op == "replace":
            data[pos] = byte
        elif op == "delete":
            del data[pos]
        else:
            data.insert(pos, byte)
    if draw(hst.booleans()):
        (n,) = struct.unpack("<Q", bytes(data[:8]))
        data[:8] = struct.pack("<Q", max(0, n + draw(hst.sampled_from([-1, 0, 1]))))
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(data=mutated_files())
def test_mutated_files_fail_cleanly(data):
    """A damaged file raises SafetensorError (nothing else); one fastst accepts, the
    reference accepts too."""
    try:
        fastst.load(data)
    except SafetensorError:
        return
    safetensors = pytest.importorskip("safetensors")
    safetensors.deserialize(data)
