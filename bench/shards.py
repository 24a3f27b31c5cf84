#!/usr/bin/env python
"""Loading a sharded checkpoint: fastst's load_file over a directory of shards
(read in parallel) against the same bytes in one file, the raw I/O limit, and
reading the shards one after another. See bench/README.md.

    python bench/shards.py                       # 1 GiB, 5 runs a row
    python bench/shards.py --size-mib 64 --repeats 1     # smoke run
    python bench/shards.py --markdown out.md     # also write the table as markdown

Each measurement runs in a fresh process, after a warm-up call on a small
checkpoint of the same layout; the page cache is hot (every file is read once
first). Rows are interleaved, their order rotated each round; the table shows
medians.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
TENSORS = 64


# ---------------------------------------------------------------------------
# What is timed (in the child)
# ---------------------------------------------------------------------------

def shard_files(directory: str) -> List[str]:
    return sorted(os.path.join(directory, name) for name in os.listdir(directory)
                  if name.endswith(".safetensors"))


def raw_readinto(path: str) -> int:
    """The raw limit: the whole file into one fresh buffer."""
    import numpy as np

    size = os.path.getsize(path)
    buffer = np.empty(size, dtype=np.uint8)
    with open(path, "rb", buffering=0) as file:
        done = 0
        while done < size:
            done += file.readinto(memoryview(buffer)[done:])
    return TENSORS


def fastst_copy(path: str) -> int:
    import fastst

    return len(fastst.load_file(path, copy=True))


def fastst_copy_one_by_one(path: str) -> int:
    import fastst

    return sum(len(fastst.load_file(shard, copy=True)) for shard in shard_files(path))


def fastst_views(path: str) -> int:
    import fastst

    return len(fastst.load_file(path))


def fastst_torch(path: str) -> int:
    import fastst.torch

    return len(fastst.torch.load_file(path))


def safetensors_numpy_one_by_one(path: str) -> int:
    import safetensors.numpy

    return sum(len(safetensors.numpy.load_file(shard)) for shard in shard_files(path))


def safetensors_torch_one_by_one(path: str) -> int:
    import safetensors.torch

    return sum(len(safetensors.torch.load_file(shard)) for shard in shard_files(path))


JOBS: Dict[str, Callable[[str], int]] = {
    job.__name__: job for job in (raw_readinto, fastst_copy, fastst_copy_one_by_one,
                                  fastst_views, fastst_torch, safetensors_numpy_one_by_one,
                                  safetensors_torch_one_by_one)}


def child(job: str, path: str, warm_path: str) -> None:
    func = JOBS[job]
    func(warm_path)              # imports and first-call setup, not timed
    start = time.perf_counter()
    count = func(path)
    elapsed = time.perf_counter() - start
    print(json.dumps({"time": elapsed, "count": count}))


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def write_inputs(root: str, size_mib: int, shard_counts: Sequence[int]) -> Dict[str, str]:
    """One file and one checkpoint per shard count, all of the same tensors."""
    import numpy as np

    import fastst

    os.makedirs(root, exist_ok=True)
    rows = size_mib * 2**20 // (TENSORS * 4 * 1024)
    rng = np.random.default_rng(0)
    tensors = {f"layers.{k}.weight": rng.standard_normal((rows, 1024), dtype=np.float32)
               for k in range(TENSORS)}
    total = sum(array.nbytes for array in tensors.values())
    paths = {"one file": os.path.join(root, "model.safetensors")}
    fastst.save_file(tensors, paths["one file"])
    for count in shard_counts:
        directory = os.path.join(root, f"shards-{count}")
        fastst.save_file(tensors, directory, max_shard_size=-(-total // count))
        paths[f"{count} shards"] = directory
    for path in paths.values():
        for name in [path] if os.path.isfile(path) else shard_files(path):
            with open(name, "rb") as file:       # page cache hot
                while file.read(1 << 24):
                    pass
    return paths


# ---------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------

def run_child(job: str, path: str, warm_path: str) -> Dict[str, Any]:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", job, path,
                          warm_path], capture_output=True, text=True, timeout=600)
    if out.returncode:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    result: Dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return result


def measure(rows: List[Tuple[str, str, str, str]], repeats: int) -> Dict[str, List[float]]:
    """rows: (label, job, input, warm-up input); times per label, interleaved."""
    times: Dict[str, List[float]] = {label: [] for label, _, _, _ in rows}
    for round_ in range(repeats):
        shift = round_ % len(rows)
        for label, job, path, warm in rows[shift:] + rows[:shift]:
            result = run_child(job, path, warm)
            if "error" in result:
                print(f"{label}: {result['error']}", file=sys.stderr)
                continue
            times[label].append(result["time"])
            print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return times


def available(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def table(args: argparse.Namespace) -> List[str]:
    from run import fmt_time     # the main benchmark's formatting

    data = os.path.join(args.data_dir, f"shards-{args.size_mib}")
    paths = write_inputs(data, args.size_mib, args.shards)
    warm = write_inputs(os.path.join(data, "warm"), 1, args.shards)
    most = f"{max(args.shards)} shards"
    rows = [("raw limit: readinto one file into a fresh np.empty", "raw_readinto",
             "one file"),
            ("fastst load_file(copy=True), one file", "fastst_copy", "one file")]
    rows += [(f"fastst load_file(copy=True), {count} shards", "fastst_copy",
              f"{count} shards") for count in args.shards]
    rows += [(f"fastst load_file(copy=True) shard by shard, {most}",
              "fastst_copy_one_by_one", most),
             ("fastst load_file (mmap views), one file", "fastst_views", "one file"),
             (f"fastst load_file (mmap views), {most}", "fastst_views", most),
             (f"fastst.torch load_file (views), {most}", "fastst_torch", most)]
    if available("safetensors"):
        rows += [(f"safetensors.numpy load_file shard by shard, {most}",
                  "safetensors_numpy_one_by_one", most)]
        if available("torch"):
            rows += [(f"safetensors.torch load_file shard by shard, {most}",
                      "safetensors_torch_one_by_one", most)]
    times = measure([(label, job, paths[key], warm[key]) for label, job, key in rows],
                    args.repeats)
    total = args.size_mib * 2**20
    one_file = statistics.median(times[rows[1][0]]) if times[rows[1][0]] else None
    lines = ["| implementation | median | best | GiB/s (median) | × one file |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for label, _, _ in rows:
        if not times[label]:
            lines.append(f"| {label} | failed | | | |")
            continue
        median = statistics.median(times[label])
        ratio = f"{median / one_file:.2f}×" if one_file else ""
        lines.append(f"| {label} | {fmt_time(median)} | {fmt_time(min(times[label]))} | "
                     f"{total / 2**30 / median:.2f} | {ratio} |")
    if not args.keep_data:
        shutil.rmtree(data, ignore_errors=True)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, metavar="N",
                        help="checkpoint size in MiB (default: 1024)")
    parser.add_argument("--shards", type=int, nargs="+", default=[4, 16], metavar="N",
                        help="shard counts to compare with one file (default: 4 16)")
    parser.add_argument("--repeats", type=int, default=5, metavar="N",
                        help="runs a row (default: 5)")
    parser.add_argument("--data-dir", default=os.path.join(HERE, "_data"), metavar="DIR",
                        help="where the inputs go (default: bench/_data)")
    parser.add_argument("--keep-data", action="store_true", help="keep the inputs")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table there")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    lines = table(args)
    header = (f"{args.size_mib} MiB in {TENSORS} F32 tensors; median of {args.repeats} "
              f"runs; {os.cpu_count()} cores, {platform.machine()}, Python "
              f"{platform.python_version()}")
    print(header + "\n\n" + "\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(header + "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
