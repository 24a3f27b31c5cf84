#!/usr/bin/env python
"""Fresh memory: a checkpoint read into new arrays, and saves of many small tensors.

    python bench/fresh.py read                  # Llama-shaped bf16 checkpoint, 3 shards
    python bench/fresh.py save                  # 20,000 NumPy tensors of 1-64 KiB
    python bench/fresh.py read --baseline DIR   # also the fastst found in DIR

*read*: a checkpoint of bf16 tensors shaped as a 1.4B-parameter Llama (2.54 GiB with
28 layers) in 3 shards, page cache hot: `load_file(backend="pread")` and
`load_file(copy=True)` against one `readinto` of each shard into a fresh `np.empty`
(the raw limit for fresh memory) and into buffers faulted in before the clock starts;
then cold (each shard's pages dropped, `fincore` checked to show none cached):
`load_file(copy=True)` against `cat` of the shards. *save*: `save_file` of 20,000
float32 tensors of 1 to 64 KiB against `safetensors.numpy.save_file` (the files are
compared byte for byte), each save to a new path after `os.sync()`. `read --squeeze`
fills free memory with page cache before each hot run (see squeeze()).

Every measurement runs in a fresh process, after a warm-up call; rows are interleaved,
their order rotated each round; the tables show medians of the time, and of the CPU
time (user and system) and system time of the timed call, which a shared machine moves
less.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

from page_cache import drop_pages
from shards import shard_files

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------

def write_checkpoint(folder: str, layers: int) -> str:
    """A Llama-shaped bf16 checkpoint (hidden 2048, MLP 5632, 4 key-value heads,
    vocabulary 32000) in shards of at most 1 GB: 3 shards for 28 layers."""
    import ml_dtypes
    import numpy as np

    import fastst

    if os.path.isdir(folder) and shard_files(folder):
        return folder
    hidden, mlp, vocab, kv = 2048, 5632, 32000, 256
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> Any:
        return rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(ml_dtypes.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden)}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        shapes = {"input_layernorm": (hidden,), "self_attn.q_proj": (hidden, hidden),
                  "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                  "self_attn.o_proj": (hidden, hidden), "post_attention_layernorm": (hidden,),
                  "mlp.gate_proj": (mlp, hidden), "mlp.up_proj": (mlp, hidden),
                  "mlp.down_proj": (hidden, mlp)}
        tensors.update({f"{prefix}{name}.weight": weight(*shape)
                        for name, shape in shapes.items()})
    tensors["model.norm.weight"] = weight(hidden)
    tensors["lm_head.weight"] = weight(vocab, hidden)
    fastst.save_file(tensors, folder, max_shard_size=10**9)
    return folder


def small_tensors() -> Dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = rng.integers(1 << 10, (64 << 10) + 1, 20_000) // 4
    return {f"model.layers.{k}.weight": rng.standard_normal(n).astype(np.float32)
            for k, n in enumerate(sizes)}


# ---------------------------------------------------------------------------
# What is timed (in the child)
# ---------------------------------------------------------------------------

def readinto_each(folder: str, prefaulted: bool) -> float:
    import numpy as np

    sizes = [os.path.getsize(path) for path in shard_files(folder)]
    buffers = [np.ones(size, np.uint8) for size in sizes] if prefaulted else []
    start = time.perf_counter()
    if not prefaulted:
        buffers = [np.empty(size, np.uint8) for size in sizes]
    for path, buffer in zip(shard_files(folder), buffers):
        with open(path, "rb", buffering=0) as file:
            done = 0
            while done < buffer.size:
                done += file.readinto(memoryview(buffer)[done:])
    return time.perf_counter() - start


def fastst_load(folder: str, backend: str) -> float:
    import fastst

    start = time.perf_counter()
    if backend == "pread":
        fastst.load_file(folder, backend="pread")
    else:
        fastst.load_file(folder, copy=True)
    return time.perf_counter() - start


def cat(folder: str) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", *shard_files(folder)], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def saver(writer: str) -> Any:
    if writer == "fastst":
        import fastst
        return fastst.save_file
    import safetensors.numpy
    return safetensors.numpy.save_file


def system_time() -> float:
    """Kernel time of this process and the children it waited for (cat)."""
    return sum(resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def cpu_time() -> float:
    """User and kernel time of this process and the children it waited for."""
    return system_time() + sum(resource.getrusage(who).ru_utime
                               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def child(job: str, argument: str, path: str) -> None:
    before, cpu_before = system_time(), cpu_time()
    # warm-ups touch little memory: what they freed would serve the timed call
    if job in ("readinto", "prefaulted"):
        import numpy  # noqa: F401
        before, cpu_before = system_time(), cpu_time()
        elapsed = readinto_each(path, job == "prefaulted")
    elif job == "fastst":
        import fastst
        backend = "pread" if argument == "pread" else "mmap"
        with fastst.safe_open(shard_files(path)[0], backend=backend) as opened:
            opened.get_tensor(opened.keys()[-1])
        before, cpu_before = system_time(), cpu_time()
        elapsed = fastst_load(path, argument)
    elif job == "cold":
        import fastst  # noqa: F401  (imported before the clock starts)
        for shard in shard_files(path):
            drop_pages(shard)
        cached = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *shard_files(path)],
                                capture_output=True, text=True).stdout.split()
        assert all(value == "0" for value in cached), cached
        before, cpu_before = system_time(), cpu_time()
        elapsed = cat(path) if argument == "cat" else fastst_load(path, "copy")
    else:
        write, tensors = saver(argument), small_tensors()
        write(tensors, path)         # first-call setup
        os.unlink(path)
        os.sync()
        before, cpu_before = system_time(), cpu_time()
        start = time.perf_counter()
        write(tensors, path)
        elapsed = time.perf_counter() - start
    print(json.dumps({"time": elapsed, "sys": system_time() - before,
                      "cpu": cpu_time() - cpu_before}))


# ---------------------------------------------------------------------------
# Running and reporting
# ---------------------------------------------------------------------------

Row = Tuple[str, str, str, str, str]     # label, job, argument, path, fastst folder


def squeeze(folder: str, checkpoint: str, keep_free: int) -> None:
    """Fill the machine's free memory, but `keep_free` bytes, with the page cache of a
    file (preallocated, read once), as on a machine that has read much since it
    started: fresh memory is then found by reclaiming the cache, and a fault that asks
    for 2 MiB may wait for memory to be compacted."""
    with open("/proc/meminfo") as meminfo:
        free = next(int(line.split()[1]) << 10 for line in meminfo
                    if line.startswith("MemFree:"))
    path = os.path.join(folder, "squeeze.bin")
    wanted = max(os.path.getsize(path) if os.path.exists(path) else 0,
                 free - keep_free)
    with open(path, "ab") as file:
        os.posix_fallocate(file.fileno(), 0, wanted)
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    cat(checkpoint)              # hot again, whatever the squeeze evicted


def measure(rows: List[Row], repeats: int, squeezed: str = ""
            ) -> Dict[str, List[Dict[str, float]]]:
    """`squeezed`: a folder for squeeze() to fill the page cache from before each run."""
    results: Dict[str, List[Dict[str, float]]] = {row[0]: [] for row in rows}
    for round_ in range(repeats):
        shift = round_ % len(rows)
        for label, job, argument, path, fastst_dir in rows[shift:] + rows[:shift]:
            if squeezed:
                squeeze(squeezed, path, keep_free=1 << 30)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([fastst_dir, HERE]))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", job,
                                  argument, path], capture_output=True, text=True, env=env,
                                 timeout=600)
            if out.returncode:
                print(f"{label}: {out.stderr.strip()[-300:]}", file=sys.stderr)
                continue
            results[label].append(json.loads(out.stdout.splitlines()[-1]))
    return results


def table(rows: List[Row], results: Dict[str, List[Dict[str, float]]], unit: str) -> str:
    from run import fmt_time

    def median(label: str, key: str) -> float:
        return statistics.median(result[key] for result in results[label])

    lines = [f"| implementation | median | CPU time | system time | × {unit} |",
             "| --- | ---: | ---: | ---: | ---: |"]
    base = median(unit, "time")
    for label, *_ in rows:
        if not results[label]:
            lines.append(f"| {label} | failed | | | |")
            continue
        lines.append(f"| {label} | {fmt_time(median(label, 'time'))} | "
                     f"{fmt_time(median(label, 'cpu'))} | {fmt_time(median(label, 'sys'))} | "
                     f"{median(label, 'time') / base:.2f}× |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=["read", "save"])
    parser.add_argument("--repeats", type=int, default=5, metavar="N")
    parser.add_argument("--layers", type=int, default=28, metavar="N",
                        help="the checkpoint's layers (default 28: 2.54 GiB)")
    parser.add_argument("--baseline", metavar="DIR", help="also the fastst found in DIR")
    parser.add_argument("--data-dir", default=os.path.join(HERE, "_data"), metavar="DIR")
    parser.add_argument("--squeeze", action="store_true",
                        help="read: fill free memory with page cache before each hot run, "
                             "and skip the cold runs")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    trees = [("", os.path.dirname(HERE))]
    if args.baseline:
        trees.append((" (baseline)", os.path.abspath(args.baseline)))
    if args.part == "read":
        folder = write_checkpoint(os.path.join(args.data_dir, f"llama-{args.layers}"),
                                  args.layers)
        hot: List[Row] = [("readinto each shard into a fresh np.empty", "readinto", "",
                           folder, trees[0][1]),
                          ("readinto into buffers faulted in first", "prefaulted", "",
                           folder, trees[0][1])]
        cold: List[Row] = [("cat the shards > /dev/null", "cold", "cat", folder, trees[0][1])]
        for suffix, tree in trees:
            hot += [(f'fastst load_file(backend="pread"){suffix}', "fastst", "pread", folder,
                     tree),
                    (f"fastst load_file(copy=True){suffix}", "fastst", "copy", folder, tree)]
            cold.append((f"fastst load_file(copy=True), cold{suffix}", "cold", "copy",
                         folder, tree))
        squeezed = args.data_dir if args.squeeze else ""
        try:
            print(table(hot, measure(hot, args.repeats, squeezed), hot[0][0]))
        finally:
            if squeezed:
                os.unlink(os.path.join(squeezed, "squeeze.bin"))
        if not args.squeeze:
            print()
            print(table(cold, measure(cold, args.repeats), cold[0][0]))
    else:
        os.makedirs(args.data_dir, exist_ok=True)
        paths = {"safetensors": os.path.join(args.data_dir, "small-ref.safetensors")}
        rows: List[Row] = [("safetensors.numpy save_file", "save", "safetensors",
                            paths["safetensors"], trees[0][1])]
        for k, (suffix, tree) in enumerate(trees):
            paths[suffix] = os.path.join(args.data_dir, f"small-fastst{k}.safetensors")
            rows.append((f"fastst save_file{suffix}", "save", "fastst", paths[suffix], tree))
        print(table(rows, measure(rows, args.repeats), rows[0][0]))
        with open(paths["safetensors"], "rb") as ref, open(paths[""], "rb") as ours:
            print("\nbyte-identical to the reference:", ref.read() == ours.read())
    print(f"\nload average after the run: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
