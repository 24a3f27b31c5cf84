"""The streaming writer: peak memory and throughput writing a file larger than
one chunk.

    python bench/stream.py [--gib 4] [--chunk-mib 64] [--repeats 5] [--dir DIR]

Memory: each way of writing runs in a fresh interpreter that reports its peak
resident set (VmHWM) against its resident set after imports (the interpreter).
Throughput: raw ``write()`` of the same bytes, the chunked ``StreamWriter.write``
and filling ``StreamWriter.view`` in place, interleaved, ``sync`` before each run,
the median of `repeats` runs each; ratios are raw time / mode time (higher is
faster, 1.0 is the raw limit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import os, sys, numpy as np, fastst

def vm(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) << 10

mode, path, total, chunk_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
base = vm("VmRSS")
rows = chunk_bytes // 4096
chunks = total // chunk_bytes
specs = {"w": ("F32", (rows * chunks, 1024))}
if mode == "stream":
    chunk = np.empty((rows, 1024), np.float32)
    with fastst.StreamWriter(path, specs) as writer:
        for i in range(chunks):
            chunk.fill(i)
            writer.write("w", chunk, start_row=i * rows)
elif mode == "save_file":
    array = np.empty((rows * chunks, 1024), np.float32)
    for i in range(chunks):
        array[i * rows:(i + 1) * rows] = i
    fastst.save_file({"w": array}, path)
print(base, vm("VmHWM"))
"""


def peak_memory(mode: str, path: str, total: int, chunk: int) -> tuple:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, path, str(total), str(chunk)],
                         capture_output=True, text=True, check=True).stdout.split()
    os.unlink(path)
    return int(out[0]), int(out[1])


def raw_write(path: str, chunk, chunks: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(chunk).cast("B")
        for _ in range(chunks):
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
    finally:
        os.close(fd)


def stream_chunks(path: str, chunk, chunks: int) -> None:
    import fastst
    rows = len(chunk)
    with fastst.StreamWriter(path, {"w": ("F32", (rows * chunks, 1024))}) as writer:
        for i in range(chunks):
            writer.write("w", chunk, start_row=i * rows)


def stream_view(path: str, chunk, chunks: int) -> None:
    import fastst
    rows = len(chunk)
    with fastst.StreamWriter(path, {"w": ("F32", (rows * chunks, 1024))}) as writer:
        view = writer.view("w")
        for i in range(chunks):
            view[i * rows:(i + 1) * rows] = chunk
        del view


def throughput(directory: str, total: int, chunk_bytes: int, repeats: int) -> dict:
    import numpy as np
    chunk = np.full((chunk_bytes // 4096, 1024), 1.5, np.float32)
    chunks = total // chunk_bytes
    modes = {"raw write()": raw_write, "StreamWriter.write": stream_chunks,
             "StreamWriter.view": stream_view}
    times: dict = {name: [] for name in modes}
    for _ in range(repeats):
        for name, run in modes.items():
            path = os.path.join(directory, "throughput.safetensors")
            os.sync()
            start = time.perf_counter()
            run(path, chunk, chunks)
            times[name].append(time.perf_counter() - start)
            os.unlink(path)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()
    chunk = args.chunk_mib << 20
    total = int(args.gib * (1 << 30)) // chunk * chunk
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = os.path.join(directory, "memory.safetensors")
        mib = 1 << 20
        print(f"## Peak resident memory writing {total / (1 << 30):g} GiB from "
              f"{args.chunk_mib} MiB chunks\n")
        print("| way | interpreter | peak | peak beyond the interpreter | in chunks |")
        print("| --- | --- | --- | --- | --- |")
        for mode in ("stream", "save_file"):
            base, peak = peak_memory(mode, path, total, chunk)
            name = "StreamWriter.write" if mode == "stream" else "save_file of a dict"
            print(f"| {name} | {base / mib:.0f} MiB | {peak / mib:.0f} MiB | "
                  f"{(peak - base) / mib:.0f} MiB | {(peak - base) / chunk:.2f}x |")
        print(f"\n## Throughput, {total / (1 << 30):g} GiB, median of {args.repeats}\n")
        print("| way | time | throughput | raw time / this time |")
        print("| --- | --- | --- | --- |")
        medians = throughput(directory, total, chunk, args.repeats)
        raw = medians["raw write()"]
        for name, seconds in medians.items():
            print(f"| {name} | {seconds:.2f} s | {total / seconds / (1 << 30):.2f} GiB/s | "
                  f"{raw / seconds:.2f}x |")


if __name__ == "__main__":
    main()
