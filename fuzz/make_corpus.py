"""Write the seed corpus for fuzz/fuzz_load.py.

Seeds are the crafted files of tests/test_validation.py (malformed, valid, packed,
stricter-than-reference, unrepresentable-shape and mutation-base cases) plus files
written by ``fastst.save`` holding every writable dtype. Each seed is named by its
origin and the hash of its bytes, so rerunning the script rewrites the same files.

    python fuzz/make_corpus.py                 # writes fuzz/corpus/
    python fuzz/make_corpus.py DIR --max-size 4096
"""
from __future__ import annotations

import argparse
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

import fastst  # noqa: E402


def _validation_tables():
    """tests/test_validation.py, imported as a module (it needs pytest and hypothesis)."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import test_validation
    return test_validation


def _params(cases) -> Iterator[Tuple[str, bytes]]:
    for param in cases:
        yield param.id, param.values[0]


def validation_seeds() -> Iterator[Tuple[str, bytes]]:
    tv = _validation_tables()
    for group in ("MALFORMED", "VALID", "STRICTER", "BOTH_REFUSE"):
        for name, data in _params(getattr(tv, group)):
            yield f"{group.lower()}-{name}", data
    for param in tv.UNREPRESENTABLE:
        code, shape = param.values
        count = int(np.prod(shape, dtype=object))
        yield (f"unrepresentable-{param.id}",
               tv.st({"a": tv.t(code, shape, (0, count))}, b"\0" * count))
    for k, data in enumerate(tv.MUTATION_BASES):
        yield f"mutation-base-{k}", data


# Every NumPy dtype fastst writes (sub-byte dtypes have no NumPy dtype to write from).
SAVED_DTYPES = [
    np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
    np.uint64, np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2fnuz,
]


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
    tv = _validation_tables()
    yield ("packed-mix",
           tv.st({"f4": tv.t("F4", (4, 4), (0, 8)), "e2m3": tv.t("F6_E2M3", (2, 4), (8, 14)),
                  "e3m2": tv.t("F6_E3M2", (3, 4), (14, 23)), "u": tv.t("U8", (1,), (23, 24))},
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
