#!/usr/bin/env python
"""Cold reads and read-ahead: local files whose pages are not in the page cache.

    python bench/cold.py                       # the tables, as markdown
    python bench/cold.py --sweep               # also fastst's threads x request sizes
    python bench/cold.py --only readahead      # one part: cold | readahead

Before every cold run the file's pages are dropped from the page cache with
``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed; the file is written and synced
first, so none of its pages is dirty). Each row is the best of ``--repeats`` runs.

*Cold reads*: a 1 GiB file of 64 tensors and a file of 10,000 small tensors, each read
whole by ``cat file > /dev/null`` (the disk's speed through the page cache), by the
best parallel pread of the same bytes into one fresh buffer (a sweep of threads and
request sizes, Python threads on ``os.preadv``), by fastst (``load_file(copy=True)``,
``backend="pread"``, O_DIRECT on a copy of the file saved with ``align=4096``, and
``fastst.torch.load_file`` touching one byte of every page of every tensor) and by the
reference (``safetensors``).

*Read-ahead*: the 1 GiB file walked tensor by tensor, each tensor followed by a work
step as long as reading it took (measured first, cold; a sleep, so that the work and
the reads do not share the CPU), on demand (``get_tensor(name, out=...)``) and with
``iter_tensors(prefetch_bytes=...)``. The goal is a walk of at most 1.15 x
max(read, work); on demand it is read + work. Peak RSS is measured in a child process
per run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

import numpy as np
from page_cache import drop_pages

HERE = os.path.dirname(os.path.abspath(__file__))
BIG_TENSORS = 64
SMALL_TENSORS = 10_000


def make_inputs(folder: str, size_mib: int) -> Dict[str, str]:
    import fastst

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    big = {f"layer.{i:02d}": rng.integers(0, 255, (size_mib << 20) // BIG_TENSORS, np.uint8)
           for i in range(BIG_TENSORS)}
    small = {f"small.{i:05d}": rng.standard_normal(2560).astype(np.float32)
             for i in range(SMALL_TENSORS)}
    paths = {"big": os.path.join(folder, f"cold-{size_mib}mib.safetensors"),
             "big_aligned": os.path.join(folder, f"cold-{size_mib}mib-align4096.safetensors"),
             "small": os.path.join(folder, "cold-10000.safetensors")}
    for key, tensors, align in (("big", big, None), ("big_aligned", big, 4096),
                                ("small", small, None)):
        if not os.path.exists(paths[key]):
            fastst.save_file(tensors, paths[key], align=align, fsync=True)
    return paths


def best_cold(path: str, run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        drop_pages(path)
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
        del result      # freeing what was read is not reading it
    return best


def cat(path: str) -> None:
    subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True)


def parallel_pread(path: str, threads: int, request: int) -> np.ndarray:
    """Every byte of the file into one fresh buffer: `threads` threads, each
    reading every threads-th request of `request` bytes."""
    size = os.path.getsize(path)
    out = np.empty(size, np.uint8)
    view = memoryview(out)
    starts = list(range(0, size, request))
    fd = os.open(path, os.O_RDONLY)

    def lane(k: int) -> None:
        for start in starts[k::threads]:
            os.preadv(fd, [view[start:start + request]], start)

    lanes = [threading.Thread(target=lane, args=(k,)) for k in range(threads)]
    try:
        for one in lanes:
            one.start()
        for one in lanes:
            one.join()
    finally:
        os.close(fd)
    return out


SWEEP_THREADS = (1, 2, 4, 8, 16)
SWEEP_REQUESTS = (1 << 20, 4 << 20, 16 << 20)


def best_pread(path: str, repeats: int) -> Tuple[float, str]:
    results = {}
    for threads in SWEEP_THREADS:
        for request in SWEEP_REQUESTS:
            results[(threads, request)] = best_cold(
                path, lambda: parallel_pread(path, threads, request), repeats)
    (threads, request), seconds = min(results.items(), key=lambda item: item[1])
    return seconds, f"{threads} threads x {request >> 20} MiB"


def touch_pages(tensors: Dict[str, object]) -> Dict[str, object]:
    for tensor in tensors.values():
        flat = np.asarray(tensor).reshape(-1).view(np.uint8)
        flat[::4096].sum()
    return tensors


def cold_rows(path: str, aligned: str, repeats: int) -> List[Tuple[str, float]]:
    import fastst
    import fastst.torch

    rows = [("cat file > /dev/null", best_cold(path, lambda: cat(path), repeats))]
    seconds, shape = best_pread(path, repeats)
    rows.append((f"best parallel pread ({shape})", seconds))
    rows.append(("fastst load_file(copy=True)",
                 best_cold(path, lambda: fastst.load_file(path, copy=True), repeats)))
    rows.append(('fastst load_file(backend="pread")',
                 best_cold(path, lambda: fastst.load_file(path, backend="pread"), repeats)))
    if aligned and hasattr(fastst, "read_options"):     # not in a fastst from before it
        before = fastst.read_options(direct=True)
        try:
            rows.append(("fastst load_file(copy=True), direct=True, align=4096 file",
                         best_cold(aligned, lambda: fastst.load_file(aligned, copy=True),
                                   repeats)))
        finally:
            fastst.read_options(**before._asdict())
    rows.append(("fastst.torch.load_file, every page touched",
                 best_cold(path, lambda: touch_pages(fastst.torch.load_file(path)), repeats)))
    try:
        import safetensors.numpy
        import safetensors.torch
    except ImportError:
        return rows
    rows.append(("safetensors.numpy.load_file (reference)",
                 best_cold(path, lambda: safetensors.numpy.load_file(path), repeats)))
    rows.append(("safetensors.torch.load_file, every page touched (reference)",
                 best_cold(path, lambda: touch_pages(safetensors.torch.load_file(path)),
                           repeats)))
    return rows


def sweep_rows(path: str, aligned: str, repeats: int) -> List[Tuple[str, float]]:
    import fastst

    rows = []
    before = fastst.read_options()
    try:
        for direct, target in ((False, path), (True, aligned)):
            for threads in SWEEP_THREADS:
                for request in SWEEP_REQUESTS:
                    fastst.read_options(threads=threads, request_bytes=request, direct=direct)
                    rows.append((f"{'direct' if direct else 'buffered'}, {threads} threads x "
                                 f"{request >> 20} MiB",
                                 best_cold(target, lambda: fastst.load_file(target, copy=True),
                                           repeats)))
    finally:
        fastst.read_options(**before._asdict())
    return rows


def table(title: str, rows: List[Tuple[str, float]]) -> str:
    cat_seconds = rows[0][1]
    pread = [seconds for label, seconds in rows if label.startswith("best parallel pread")]
    lines = [f"**{title}**", "", "| read | seconds | x cat | x best pread |",
             "| --- | ---: | ---: | ---: |"]
    for label, seconds in rows:
        versus = f"{seconds / pread[0]:.2f}" if pread else "-"
        lines.append(f"| {label} | {seconds:.3f} | {seconds / cat_seconds:.2f} | {versus} |")
    return "\n".join(lines)


# --- read-ahead ------------------------------------------------------------------------

WALK_CHILD = r"""
import json, os, sys, time
import numpy as np
import fastst
path, mode, work, budget = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) << 10
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) << 10
with fastst.safe_open(path, "np") as f:
    names = f.offset_keys()
    base = rss()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    start = time.perf_counter()
    if mode == "demand":
        for name in names:
            info = f.info(name)
            tensor = f.get_tensor(name, out=np.empty(info.array_shape, np.uint8))
            time.sleep(work)
            del tensor
    else:
        for name, tensor in f.iter_tensors(prefetch_bytes=budget):
            time.sleep(work)
            del tensor
    seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_delta": peak() - base}))
"""


def fastst_file() -> str:
    import fastst

    return fastst.__file__


def walk(path: str, mode: str, work: float, budget: int) -> Dict[str, float]:
    import json

    drop_pages(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        fastst_file())), env.get("PYTHONPATH", "")]))
    # run outside the checkout, so that PYTHONPATH (or the installed fastst) is what it imports
    done = subprocess.run([sys.executable, "-c", WALK_CHILD, path, mode, str(work), str(budget)],
                          check=True, capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(path))
    return json.loads(done.stdout)


def readahead_rows(path: str, repeats: int) -> Tuple[List[List[str]], Dict[str, float]]:
    import fastst

    with fastst.safe_open(path, "np") as f:
        tensor_bytes = max(f.info(name).data_offsets[1] - f.info(name).data_offsets[0]
                           for name in f.offset_keys())
    read = min(walk(path, "demand", 0.0, 0)["seconds"] for _ in range(repeats))
    work = read / BIG_TENSORS
    rows = []
    demand = min((walk(path, "demand", work, 0) for _ in range(repeats)),
                 key=lambda got: got["seconds"])
    total_work = work * BIG_TENSORS
    rows.append(["on demand (get_tensor(out=...), then work)", demand])
    for budget in (4 * tensor_bytes, 16 * tensor_bytes):
        ahead = min((walk(path, "ahead", work, budget) for _ in range(repeats)),
                    key=lambda got: got["seconds"])
        rows.append([f"iter_tensors(prefetch_bytes={budget >> 20} MiB)", ahead, budget])
    lines = []
    for row in rows:
        label, got = row[0], row[1]
        budget = row[2] if len(row) > 2 else 0
        lines.append([label, f"{got['seconds']:.3f}",
                      f"{got['seconds'] / max(read, total_work):.2f}",
                      f"{got['peak_delta'] / 2**20:.0f}",
                      f"{(budget + tensor_bytes) / 2**20:.0f}" if budget else "-"])
    return lines, {"read": read, "work": total_work, "tensor_mib": tensor_bytes / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=os.path.join(HERE, "_data"))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--only", choices=("cold", "readahead"))
    args = parser.parse_args()
    paths = make_inputs(args.data_dir, args.size_mib)
    print(f"load average before: {os.getloadavg()}\n")
    if args.only in (None, "cold"):
        print(table(f"Cold reads: {args.size_mib} MiB, {BIG_TENSORS} tensors",
                    cold_rows(paths["big"], paths["big_aligned"], args.repeats)))
        print()
        print(table(f"Cold reads: {SMALL_TENSORS} small tensors "
                    f"({os.path.getsize(paths['small']) / 2**20:.0f} MiB)",
                    cold_rows(paths["small"], "", args.repeats)))
        print()
    if args.sweep:
        print(table("fastst load_file(copy=True), cold: threads x request size",
                    [("cat file > /dev/null", best_cold(paths["big"], lambda: cat(paths["big"]),
                                                        args.repeats))]
                    + sweep_rows(paths["big"], paths["big_aligned"], args.repeats)))
        print()
    if args.only in (None, "readahead"):
        lines, walked = readahead_rows(paths["big"], args.repeats)
        print(f"**Read-ahead: a cold {args.size_mib} MiB file walked tensor by tensor** "
              f"(read alone {walked['read']:.3f} s, work alone {walked['work']:.3f} s, "
              f"tensors of {walked['tensor_mib']:.0f} MiB)\n")
        print("| walk | seconds | x max(read, work) | peak RSS Δ MiB | budget + tensor MiB |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for line in lines:
            print("| " + " | ".join(line) + " |")
        print()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
