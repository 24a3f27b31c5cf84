"""Write the seed corpus for fuzz/fuzz_load.py.

Seeds are crafted files that break each rule of the format one at a time (length
prefix, JSON, entries, sizes, layout, metadata), valid files of unusual shapes, files
the reference reads and fastst refuses, shapes NumPy cannot hold, the findings kept in
fuzz/findings/, and files written by ``fastst.save`` holding every writable dtype. The
raw files are built with ``raw_file`` of tests/helpers.py. Each seed is named by its
origin and the hash of its bytes, so rerunning the script rewrites the same files.

    python fuzz/make_corpus.py                 # writes fuzz/corpus/
    python fuzz/make_corpus.py DIR --max-size 4096
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import sys
from typing import Iterator, List, Tuple

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_DIRECTORY = os.path.join(HERE, "corpus")
DEFAULT_MAX_SIZE = 1 << 16

sys.path.insert(0, os.path.join(ROOT, "tests"))
import fastst  # noqa: E402
from helpers import entry, raw_file  # noqa: E402

sys.path.pop(0)

U64_MAX = 2**64 - 1
F32_ONE = np.float32(1).tobytes()


def _one(text: str, data: bytes = F32_ONE) -> bytes:
    """A file holding the tensor "a", its entry given as raw JSON text."""
    return raw_file('{"a":' + text + "}", data)


def prefix_seeds() -> Iterator[Tuple[str, bytes]]:
    valid = raw_file({"a": entry()}, F32_ONE)
    yield "short-3-bytes", valid[:3]
    yield "short-7-bytes", valid[:7]
    yield "prefix-only", valid[:8]
    for name, length in [("zero", 0), ("one-short", len(valid) - 13), ("one-past", 9_999),
                         ("u64-max", U64_MAX), ("2**63", 2**63)]:
        yield f"length-{name}", raw_file({"a": entry()}, F32_ONE, length=length)
    yield "big-endian-prefix", raw_file("{}", prefix=(8).to_bytes(8, "big"))
    yield "nul-padding", raw_file({"a": entry()}, F32_ONE, padding=b"\0")
    yield "unpadded", raw_file({"a": entry()}, F32_ONE, align=1)
    yield "npy-magic", b"\x93NUMPY\x01\x00v\x00" + b" " * 118
    yield "zip-magic", b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + b"\0" * 22
    yield "json-text", b'{"weight_map": {"a": "model-00001-of-00002.safetensors"}}'


def json_seeds() -> Iterator[Tuple[str, bytes]]:
    for name, text in [("array", b"[]"), ("string", b'"x"'), ("number", b"1"),
                       ("null", b"null"), ("bom", b"\xef\xbb\xbf{}"),
                       ("invalid-utf8", b'{"\xff":' + _entry_text() + b"}"),
                       ("trailing-garbage", b"{} x"), ("unterminated", b'{"a":'),
                       ("nul-in-name", b'{"a\x00":' + _entry_text() + b"}"),
                       ("deep-nesting", b'{"__metadata__":' + b"[" * 2000 + b"]" * 2000 + b"}"),
                       ("escaped-name", b'{"\\u0061\\n":' + _entry_text() + b"}")]:
        yield f"json-{name}", raw_file(text, F32_ONE)


def _entry_text(dtype: str = "F32", shape: str = "[1]", offsets: str = "[0,4]") -> bytes:
    return f'{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}'.encode()


def entry_seeds() -> Iterator[Tuple[str, bytes]]:
    for field in ("dtype", "shape", "data_offsets"):
        partial = {key: value for key, value in entry().items() if key != field}
        yield f"entry-missing-{field}", raw_file({"a": partial}, F32_ONE)
    yield "entry-extra-field", raw_file({"a": {**entry(), "align": 64}}, F32_ONE)
    yield "entry-as-array", _one('["F32",[1],[0,4]]')
    yield "entry-as-string", _one('"F32"')
    for name, text in [("dtype-lowercase", _entry_text("f32")), ("dtype-unknown", _entry_text("F128")),
                       ("dtype-number", b'{"dtype":7,"shape":[1],"data_offsets":[0,4]}'),
                       ("shape-negative", _entry_text(shape="[-1]")),
                       ("shape-minus-zero", _entry_text(shape="[-0]")),
                       ("shape-float", _entry_text(shape="[1.0]")),
                       ("shape-exponent", _entry_text(shape="[1e0]")),
                       ("shape-string", _entry_text(shape='["1"]')),
                       ("shape-2**64", _entry_text(shape=f"[{2**64}]")),
                       ("offsets-three", _entry_text(offsets="[0,4,8]")),
                       ("offsets-reversed", _entry_text(offsets="[4,0]")),
                       ("offsets-minus-zero", _entry_text(offsets="[-0,4]")),
                       ("offsets-null", _entry_text(offsets="null"))]:
        yield f"entry-{name}", _one(text.decode())
    yield "entry-duplicate-field", _one('{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}')


def layout_seeds() -> Iterator[Tuple[str, bytes]]:
    two = {"a": entry("U8", (2,), (0, 2)), "b": entry("U8", (2,), (2, 4))}
    yield "layout-valid-two", raw_file(two, b"abcd")
    yield "layout-gap", raw_file({"a": entry("U8", (2,), (0, 2)), "b": entry("U8", (2,), (3, 5))},
                                 b"abcde")
    yield "layout-overlap", raw_file({"a": entry("U8", (2,), (0, 2)),
                                      "b": entry("U8", (2,), (1, 3))}, b"abc")
    yield "layout-trailing-bytes", raw_file(two, b"abcdef")
    yield "layout-past-end", raw_file(two, b"abc")
    yield "layout-size-mismatch", raw_file({"a": entry("F32", (2,), (0, 4))}, F32_ONE)
    yield "layout-overflowing-count", raw_file({"a": entry("U8", (2**32, 2**32, 2), (0, 0))})
    yield "layout-odd-f4", raw_file({"a": entry("F4", (3,), (0, 1))}, b"\0")
    yield "layout-duplicate-name", raw_file('{"a":' + _entry_text().decode() + ',"a":'
                                            + _entry_text().decode() + "}", F32_ONE)
    yield "layout-duplicate-escaped-name", raw_file('{"a":' + _entry_text().decode()
                                                    + ',"\\u0061":' + _entry_text().decode()
                                                    + "}", F32_ONE)


def metadata_seeds() -> Iterator[Tuple[str, bytes]]:
    for name, text in [("null", "null"), ("array", "[]"), ("number-value", '{"k":1}'),
                       ("duplicate-key", '{"k":"v","k":"w"}'), ("empty", "{}"),
                       ("unicode", '{"\u540d":"\u00e9","format":"np"}')]:
        yield f"metadata-{name}", raw_file('{"__metadata__":' + text + "}")
    yield "metadata-with-tensor", raw_file({"__metadata__": {"format": "pt"}, "a": entry()},
                                           F32_ONE)


def shape_seeds() -> Iterator[Tuple[str, bytes]]:
    """Valid headers of unusual shapes, NumPy-unrepresentable ones included."""
    shapes = [("scalar", "F64", ()), ("empty", "U8", (0,)), ("zero-middle", "I32", (3, 0, 2)),
              ("2**63-dim", "U8", (0, 2**63)), ("u64-max-dim", "U8", (2**64 - 1, 0)),
              ("intp-overflow", "U8", (2**40, 0, 2**40)), ("bytes-overflow", "F64", (0, 2**61)),
              ("65-dims", "U8", (1,) * 65), ("64-dims", "U8", (1,) * 64),
              ("f4-rows", "F4", (3, 4)), ("f4-flat", "F4", (2, 3)), ("f6", "F6_E3M2", (2, 2, 4))]
    for name, code, shape in shapes:
        bits = next(row.bits for row in fastst.DTYPES if row.code == code)
        nbytes = int(np.prod(shape, dtype=object)) * bits // 8
        yield f"shape-{name}", raw_file({"a": entry(code, shape, (0, nbytes))},
                                        bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256))
    yield "shape-every-code-empty", raw_file(
        {f"t{k}": entry(code, (0,), (0, 0)) for k, code in enumerate(fastst.DTYPE_CODES)})


def validation_seeds() -> Iterator[Tuple[str, bytes]]:
    """Crafted files, most of them breaking one rule of the format."""
    for seeds in (prefix_seeds, json_seeds, entry_seeds, layout_seeds, metadata_seeds,
                  shape_seeds, findings_seeds):
        yield from seeds()


def findings_seeds() -> Iterator[Tuple[str, bytes]]:
    """The files kept in fuzz/findings/ (each reached a bug once)."""
    for path in sorted(glob.glob(os.path.join(HERE, "findings", "*.safetensors"))
                       + glob.glob(os.path.join(HERE, "findings", "*.input"))):
        with open(path, "rb") as fh:
            yield f"finding-{os.path.basename(path)}", fh.read()


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


# Every NumPy dtype fastst writes (sub-byte dtypes have no NumPy dtype to write from).
SAVED_DTYPES = [_numpy_dtype(row.numpy) for row in fastst.DTYPES if row.bits >= 8]


def _filled(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def saved_seeds() -> Iterator[Tuple[str, bytes]]:
    rng = np.random.default_rng(0)
    shapes = [(), (0,), (3,), (2, 3), (2, 0, 2), (1, 2, 1, 2)]
    everything = {}
    for dtype in SAVED_DTYPES:
        name = np.dtype(dtype).name
        per_dtype = {f"{name}_{k}": _filled(rng, dtype, shape) for k, shape in enumerate(shapes)}
        yield f"saved-{name}", fastst.save(per_dtype)
        everything[name] = _filled(rng, dtype, (2, 2))
    yield "saved-every-dtype", fastst.save(everything)
    yield ("saved-every-dtype-with-metadata",
           fastst.save(everything, metadata={"format": "np", "note": "seed"}))
    yield "saved-empty", fastst.save({})
    yield "saved-long-axis", fastst.save({"rows": _filled(rng, np.uint8, (300,)),
                                          "wide": _filled(rng, np.int16, (130, 2))})
    # Packed F4/F6 files cannot come from fastst.save; header and bytes by hand.
    yield ("packed-mix",
           raw_file({"f4": entry("F4", (4, 4), (0, 8)), "e2m3": entry("F6_E2M3", (2, 4), (8, 14)),
                     "e3m2": entry("F6_E3M2", (3, 4), (14, 23)), "u": entry("U8", (1,), (23, 24))},
                    bytes(range(24))))


def _filename(origin: str, data: bytes) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", origin).strip("-")[:60]
    return f"{slug}-{hashlib.sha1(data).hexdigest()[:12]}"


def write_corpus(directory: str, max_size: int = DEFAULT_MAX_SIZE) -> Tuple[List[str], List[str]]:
    """Write every seed of at most `max_size` bytes to `directory`; return the
    written paths and the origins of the seeds left out for their size."""
    os.makedirs(directory, exist_ok=True)
    written, skipped = [], []
    seen = set()
    for origin, data in list(validation_seeds()) + list(saved_seeds()):
        if len(data) > max_size:
            skipped.append(f"{origin} ({len(data)} bytes)")
            continue
        digest = hashlib.sha1(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        path = os.path.join(directory, _filename(origin, data))
        with open(path, "wb") as out:
            out.write(data)
        written.append(path)
    return written, skipped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=DEFAULT_DIRECTORY)
    parser.add_argument("--max-size", type=int, default=DEFAULT_MAX_SIZE,
                        help="leave out seeds larger than this many bytes "
                             f"(default {DEFAULT_MAX_SIZE})")
    args = parser.parse_args(argv)
    written, skipped = write_corpus(args.directory, args.max_size)
    print(f"wrote {len(written)} seeds to {args.directory}")
    for origin in skipped:
        print(f"left out (over --max-size): {origin}")


if __name__ == "__main__":
    main()
