#!/usr/bin/env python
"""Checksums: how fast each candidate hashes, and what checking a file costs against
reading it.

    python bench/integrity.py                 # 256 MiB hashing buffer, 1 GiB file
    python bench/integrity.py --size-mib 256  # a smaller file

Part 1 hashes one buffer held in memory (hot) with each library that is installed
(xxhash's XXH3 and XXH64, crc32c, blake3), beside a memcpy of the same buffer, and
checks whether the hash releases the GIL (two threads on two halves). Part 2 writes a
file of 64 F32 tensors with checksums, reads it once to warm the page cache, then
times, each in a fresh process: reading it into memory (``load_file(copy=True)``
and one ``readinto``), ``fastst verify``'s checking (``verify_file``), and
``safe_open(verify=True)`` + ``get_tensors()``; and saving it with and without
checksums. Prints markdown tables.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

import numpy as np

HASH_MIB = 256


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def hashers() -> Dict[str, Callable[[memoryview], object]]:
    found: Dict[str, Callable[[memoryview], object]] = {}
    try:
        import xxhash
        found["xxhash xxh3_64"] = xxhash.xxh3_64_hexdigest
        found["xxhash xxh3_128"] = xxhash.xxh3_128_hexdigest
        found["xxhash xxh64"] = xxhash.xxh64_hexdigest
    except ImportError:
        pass
    try:
        import crc32c
        found["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import blake3
        found["blake3 (1 thread)"] = lambda data: blake3.blake3(data).hexdigest()
        found["blake3 (all cores)"] = lambda data: blake3.blake3(
            data, max_threads=blake3.blake3.AUTO).hexdigest()
    except ImportError:
        pass
    return found


def in_two_threads(hash_one: Callable[[memoryview], object], data: memoryview) -> None:
    half = len(data) // 2
    threads = [threading.Thread(target=hash_one, args=(part,))
               for part in (data[:half], data[half:])]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def hashing_table(repeats: int) -> List[str]:
    buffer = np.random.default_rng(0).integers(0, 256, HASH_MIB << 20, dtype=np.uint8)
    data = memoryview(buffer)
    target = np.empty_like(buffer)
    rows = [("memcpy (np.copyto)", best_seconds(lambda: np.copyto(target, buffer), repeats),
             None)]
    for name, hash_one in hashers().items():
        alone = best_seconds(lambda: hash_one(data), repeats)
        two = (None if "all cores" in name
               else best_seconds(lambda: in_two_threads(hash_one, data), repeats))
        rows.append((name, alone, two))
    lines = [f"### Hashing {HASH_MIB} MiB held in memory (best of {repeats})", "",
             "| hash | GiB/s | two threads, two halves: GiB/s |", "| --- | ---: | ---: |"]
    for name, seconds, two in rows:
        gib = HASH_MIB / 1024
        lines.append(f"| {name} | {gib / seconds:.1f} | "
                     f"{'' if two is None else f'{gib / two:.1f}'} |")
    return lines


CHILD = {
    "load_file(copy=True)": "fastst.load_file(path, copy=True)",
    "readinto one buffer": ("buf = bytearray(os.path.getsize(path))\n"
                            "with open(path, 'rb', buffering=0) as f: f.readinto(buf)"),
    "verify_file (fastst verify)": "assert verify_file(path)['ok']",
    "safe_open(verify=True) + get_tensors()":
        "with fastst.safe_open(path, verify=True) as f: f.get_tensors()",
}


def child_seconds(code: str, path: str) -> float:
    program = ("import os, time, fastst\nfrom fastst.integrity import verify_file\n"
               f"path = {path!r}\nstart = time.perf_counter()\n{code}\n"
               "print(time.perf_counter() - start)")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          check=True)
    return float(done.stdout)


def file_tables(size_mib: int, repeats: int, folder: str) -> List[str]:
    import fastst

    count = 64
    tensors = {f"layer{i:02d}": np.random.default_rng(i).standard_normal(
        (size_mib << 20) // count // 4, dtype=np.float32) for i in range(count)}
    path = os.path.join(folder, "integrity.safetensors")
    plain = os.path.join(folder, "plain.safetensors")
    variants = {"save_file": {}, "save_file(checksum='xxh3_64')": {"checksum": "xxh3_64"},
                "save_file(checksum='xxh3_128')": {"checksum": "xxh3_128"}}
    saves: Dict[str, float] = {}
    for _ in range(repeats):      # interleaved, so that a busy spell hits every variant
        for name, options in variants.items():
            start = time.perf_counter()
            fastst.save_file(tensors, path if options.get("checksum") == "xxh3_64" else plain,
                             **options)
            saves[name] = min(saves.get(name, 1e9), time.perf_counter() - start)
    del tensors
    child_seconds("fastst.load_file(path, copy=True)", path)      # page cache hot
    reads = {name: statistics.median(child_seconds(code, path) for _ in range(repeats))
             for name, code in CHILD.items()}
    base = reads["load_file(copy=True)"]
    lines = [f"### Checking a {size_mib} MiB file of {count} F32 tensors (xxh3_64), page "
             f"cache hot", "", f"Median of {repeats} runs, each in a fresh process.", "",
             "| operation | median | GiB/s | × load_file(copy=True) throughput |",
             "| --- | ---: | ---: | ---: |"]
    for name, seconds in reads.items():
        lines.append(f"| {name} | {seconds * 1e3:.0f} ms | {size_mib / 1024 / seconds:.1f} | "
                     f"{base / seconds:.2f}× |")
    lines += ["", f"### Saving it (best of {repeats}, page cache)", "",
              "| operation | time | × plain save_file |", "| --- | ---: | ---: |"]
    for name, seconds in saves.items():
        lines.append(f"| {name} | {seconds * 1e3:.0f} ms | {seconds / saves['save_file']:.2f}× |")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="file size (default 1024)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", default=None, help="where the file goes (default: a "
                                                         "temporary folder)")
    args = parser.parse_args(argv)
    lines = hashing_table(args.repeats) + [""]
    with tempfile.TemporaryDirectory(dir=args.data_dir) as folder:
        lines += file_tables(args.size_mib, args.repeats, folder)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
