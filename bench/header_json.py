"""The strict header parser with each JSON codec of fastst._json: orjson, and the
standard library's json that a free-threaded build uses, on a header of 100,000
tensors. Rows: the decoding alone (``loads``), ``safe_open`` of a file whose header the fast
scanner passes on to the strict parser (one name is written with an escape), and
writing the header (``dumps``). Rounds alternate the codecs; the table gives medians.

    python bench/header_json.py --rounds 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time

import fastst
from fastst import _json


def header(tensors: int) -> dict:
    return {f"model.layers.{k}.weight": {"dtype": "F16", "shape": [2, 2],
                                         "data_offsets": [8 * k, 8 * k + 8]}
            for k in range(tensors)}


def timed(work) -> float:
    began = time.perf_counter()
    work()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tensors", type=int, default=100_000)
    args = parser.parse_args()
    import orjson

    document = header(args.tensors)
    text = orjson.dumps(document)
    escaped = text.replace(b'"model.layers.0.weight"', b'"model.layers.0.weigh\\u0074"', 1)
    path = os.path.join(tempfile.mkdtemp(), "escaped.safetensors")
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(escaped)) + escaped + bytes(8 * args.tensors))
    codecs = {"orjson": (orjson.loads, orjson.dumps),
              "json": (_json._stdlib_loads, _json._stdlib_dumps)}
    rows = {"loads": lambda: _json.loads(text),
            "safe_open, strict parser": lambda: fastst.safe_open(path).close(),
            "dumps": lambda: _json.dumps(document)}
    times = {(row, codec): [] for row in rows for codec in codecs}
    for _ in range(args.rounds):
        for codec, (loads, dumps) in codecs.items():
            _json._LOADS, _json._DUMPS = loads, dumps
            for row, work in rows.items():
                times[row, codec].append(timed(work))
    os.remove(path)
    print(f"| {args.tensors:,} tensors, {len(text) / 1e6:.1f} MB | orjson | json | json / orjson |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        fast, slow = (statistics.median(times[row, codec]) for codec in codecs)
        print(f"| {row} | {fast * 1e3:.0f} ms | {slow * 1e3:.0f} ms | {slow / fast:.2f}x |")


if __name__ == "__main__":
    main()
