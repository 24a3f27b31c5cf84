"""Loading a safetensors file onto a CUDA device: fastst, safetensors and the limits.

    python bench/gpu.py                    # 4 GiB file of 64 BF16 tensors, hot and cold
    python bench/gpu.py --size-gib 0.25 --repeats 2 --cold-repeats 1   # smoke run
    python bench/gpu.py --sweep            # also time ring shapes of fastst's loader

Every row loads the same file's tensor bytes onto the device (or, for the limit
rows, moves the same number of bytes) and reports GB/s (10^9 bytes per second) and
the ratio to the pinned host-to-device limit measured in the same run. "Hot" rows
read a file the page cache holds; "cold" rows drop the file's pages first
(``/proc/sys/vm/drop_caches`` where writable, and ``posix_fadvise(DONTNEED)`` on the
file). Peak RSS Δ is measured in a fresh process per row: its peak resident memory
during the load beyond what it held before (CUDA context already made).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

# JAX takes most of the GPU's memory at its first use unless told not to
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import fastst  # noqa: E402
import fastst.torch as ft  # noqa: E402
from fastst._frameworks import cuda as _cuda  # noqa: E402
from page_cache import drop_pages  # noqa: E402

MiB = 1 << 20
DEVICE = torch.device("cuda", 0)


# ---------------------------------------------------------------------------
# The input
# ---------------------------------------------------------------------------

def write_input(path: str, size_bytes: int, count: int) -> None:
    """`count` BF16 tensors of random bits, `size_bytes` in all."""
    rows = size_bytes // count // (8192 * 2)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    tensors = {f"layer{i:03d}": torch.randint(-32768, 32767, (rows, 8192), generator=gen,
                                              dtype=torch.int16, device=DEVICE
                                              ).view(torch.bfloat16) for i in range(count)}
    ft.save_file(tensors, path)
    os.sync()


def data_range(path: str) -> Tuple[int, int]:
    with fastst.safe_open(path) as f:
        total = max(f.info(name).data_offsets[1] for name in f.keys())
        return f.data_start, total


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as file:
        buffer = bytearray(64 * MiB)
        while file.readinto(buffer):
            pass


def drop(path: str) -> str:
    """Drop the file's pages from the page cache; say how."""
    how = "posix_fadvise"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
        how = "drop_caches"
    except OSError:
        pass
    drop_pages(path)
    return how


# ---------------------------------------------------------------------------
# The rows: each loads (or moves) the file's tensor bytes once
# ---------------------------------------------------------------------------

class Pinned:
    """Pinned host buffers made once and reused by the limit rows."""
    whole: Optional[torch.Tensor] = None
    ring: Dict[Tuple[int, int], torch.Tensor] = {}

    @classmethod
    def of_size(cls, nbytes: int) -> torch.Tensor:
        if cls.whole is None or cls.whole.numel() < nbytes:
            cls.whole = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return cls.whole[:nbytes]

    @classmethod
    def ring_of(cls, threads: int, chunk: int) -> List[torch.Tensor]:
        key = (threads, chunk)
        if key not in cls.ring:
            cls.ring[key] = torch.empty(threads * chunk, dtype=torch.uint8, pin_memory=True)
        return list(cls.ring[key].split(chunk))


def h2d_limit(path: str) -> None:
    """Host-to-device copy from pinned memory, no disk: the link's speed."""
    _, total = data_range(path)
    src = Pinned.of_size(min(total, 1 << 30))
    dest = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    for start in range(0, total, src.numel()):
        part = dest[start:start + src.numel()]
        part.copy_(src[:part.numel()], non_blocking=True)
    torch.cuda.synchronize()


def readinto_then_copy(path: str) -> None:
    """One thread reads the whole tensor buffer into pinned memory, then one copy."""
    start, total = data_range(path)
    pinned = Pinned.of_size(total)
    with open(path, "rb", buffering=0) as file:
        file.seek(start)
        view = memoryview(pinned.numpy())
        done = 0
        while done < total:
            done += file.readinto(view[done:])
    dest = torch.empty(total, dtype=torch.uint8, device=DEVICE)
    dest.copy_(pinned)
    torch.cuda.synchronize()


def parallel_read(path: str, threads: int, chunk: int = 16 * MiB, source: str = "pread") -> None:
    """Threads read the tensor buffer into pinned buffers of their own, no GPU:
    the most the file system gives (`source` "pread", or "mmap": copies out of a
    shared map of the file)."""
    start, total = data_range(path)
    buffers = [part.numpy() for part in Pinned.ring_of(threads, chunk)]
    chunks = _cuda.plan_chunks(total, chunk)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, 0, prot=mmap.PROT_READ) if source == "mmap" else None

    def lane(k: int, mapped: Optional[np.ndarray]) -> None:
        for first, stop in chunks[k::threads]:
            view = buffers[k][:stop - first]
            if mapped is None:
                _cuda.read_into(fd, memoryview(view), start + first)
            else:
                np.copyto(view, mapped[start + first:start + stop])

    try:
        mapped = np.frombuffer(mapping, np.uint8) if mapping is not None else None
        workers = [threading.Thread(target=lane, args=(k, mapped)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        del workers, mapped    # the map's buffer is exported until then
    finally:
        if mapping is not None:
            mapping.close()
        os.close(fd)


def safetensors_load(path: str) -> None:
    import safetensors.torch
    tensors = safetensors.torch.load_file(path, device="cuda:0")
    torch.cuda.synchronize()
    del tensors


def fastst_views_to(path: str) -> None:
    """What fastst.torch did before the pinned ring: each view of the file's map
    (BF16 through an int16 view) moved with .to(device)."""
    with fastst.safe_open(path) as f:
        tensors = {name: torch.from_numpy(array.view(np.int16)).to(DEVICE).view(torch.bfloat16)
                   for name, array in f.get_tensors().items()}
    torch.cuda.synchronize()
    del tensors


def fastst_per_tensor(path: str) -> None:
    """safe_open(framework="pt", device="cuda").get_tensors(): one tensor at a time,
    each through the pinned ring."""
    with fastst.safe_open(path, framework="pt", device="cuda") as f:
        tensors = f.get_tensors()
    torch.cuda.synchronize()
    del tensors


def fastst_load(path: str, chunk: Optional[int] = None, buffers: Optional[int] = None) -> None:
    if chunk is None:
        tensors = ft.load_file(path, device="cuda")
    else:
        with fastst.safe_open(path) as opened:
            tensors = _cuda.load_all(opened, DEVICE, chunk_bytes=chunk, buffers=buffers or 1)
    torch.cuda.synchronize()
    del tensors


def jax_gpu() -> Optional[object]:
    """JAX's first GPU, or None where JAX or its CUDA plugin is missing."""
    try:
        import jax
        return jax.devices("gpu")[0]
    except (ImportError, RuntimeError):
        return None


def jax_device_put(path: str) -> None:
    """What fastst.jax does without PyTorch: jax.device_put of each view of the map."""
    from fastst._frameworks.jax import Converter
    put = Converter(jax_gpu())
    with fastst.safe_open(path) as f:
        arrays = [put(array, name, f.info(name)) for name, array in f.get_tensors().items()]
    for array in arrays:
        array.block_until_ready()


def jax_ring(path: str) -> None:
    """fastst.flax.load_file(device="gpu"): the pinned ring, then DLPack."""
    import fastst.flax
    for array in fastst.flax.load_file(path, device="gpu").values():
        array.block_until_ready()


def safetensors_flax(path: str) -> None:
    import jax
    import safetensors.flax
    with jax.default_device(jax_gpu()):
        arrays = safetensors.flax.load_file(path)
    for array in arrays.values():
        array.block_until_ready()


JAX_ROWS: Dict[str, Tuple[str, Callable[[str], None]]] = {
    "safetensors_flax": ("safetensors.flax.load_file, JAX's default device the GPU",
                         safetensors_flax),
    "jax_put": ("fastst.jax without PyTorch: jax.device_put of each view", jax_device_put),
    "jax_ring": ("fastst.flax.load_file(device='gpu') (pinned ring, DLPack)", jax_ring),
}

ROWS: Dict[str, Tuple[str, Callable[[str], None]]] = {
    "h2d": ("H2D copy from pinned memory, no disk (the link)", h2d_limit),
    "readinto": ("one thread readinto pinned, then one H2D copy", readinto_then_copy),
    "safetensors": ("safetensors.torch.load_file(device='cuda:0')", safetensors_load),
    "views_to": ("fastst views of the map, each .to() the device (the old path)",
                 fastst_views_to),
    "per_tensor": ("fastst safe_open(device='cuda').get_tensors() (ring per tensor)",
                   fastst_per_tensor),
    "fastst": ("fastst.torch.load_file(device='cuda') (pinned ring)", fastst_load),
}


# ring shapes of fastst's loader tried by --sweep: (chunk MiB, buffers = threads)
SHAPES = [(8, 8), (8, 16), (16, 8), (16, 16), (32, 8), (32, 16)]
COLD_SHAPES = [(16, 8), (16, 16)]


def timed(fn: Callable[[], None], repeats: int, before: Callable[[], object]) -> List[float]:
    times = []
    for _ in range(repeats):
        before()
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


# ---------------------------------------------------------------------------
# Memory, in a fresh process per row
# ---------------------------------------------------------------------------

def status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_rss_delta(key: str, path: str, small: str) -> int:
    """Run one load of row `key` in this process: peak RSS beyond the start, bytes.
    A first load of the small file `small` keeps the CUDA context, imports and
    first-call setup out of the number."""
    load = {**ROWS, **JAX_ROWS}[key][1]
    load(small)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")              # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    load(path)
    return (status_kib("VmHWM") - before) * 1024


def measure_rss(key: str, path: str, small: str) -> Optional[int]:
    out = subprocess.run([sys.executable, __file__, "--rss-of", key, path, small],
                         capture_output=True, text=True)
    if out.returncode:
        print(f"rss of {key} failed: {out.stderr[-500:]}")
        return None
    return int(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------

def machine() -> Dict[str, str]:
    props = torch.cuda.get_device_properties(DEVICE)
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "?"
    with open("/proc/meminfo") as meminfo:
        ram = int(meminfo.readline().split()[1]) / (1 << 20)
    import safetensors
    return {
        "gpu": f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB, driver {driver}",
        "cpu cores": str(os.cpu_count()), "ram": f"{ram:.0f} GiB",
        "kernel": platform.release(), "python": platform.python_version(),
        "torch": torch.__version__, "safetensors": safetensors.__version__,
        "fastst": f"{fastst.__version__} (chunk {_cuda.CHUNK_BYTES // MiB} MiB x "
                  f"{_cuda.RING_BUFFERS} buffers)",
    }


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cold-repeats", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "_data"))
    parser.add_argument("--sweep", action="store_true", help="time ring shapes too")
    parser.add_argument("--json", help="write every time to this file")
    parser.add_argument("--rss-of", nargs=3, metavar=("ROW", "FILE", "SMALL"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_of:
        print(peak_rss_delta(*args.rss_of))
        return

    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, f"gpu_{args.size_gib:g}gib.safetensors")
    if not os.path.exists(path):
        write_input(path, int(args.size_gib * (1 << 30)), args.tensors)
    small = os.path.join(args.dir, "gpu_small.safetensors")
    if not os.path.exists(small):
        write_input(small, 4 * MiB, 4)
    _, total = data_range(path)
    info = machine()
    for key, value in info.items():
        print(f"{key}: {value}")
    print(f"file: {total / (1 << 30):.2f} GiB of tensors in {args.tensors} BF16 tensors, "
          f"{path}")

    # correctness first: the new path gives the file's bytes
    want = ft.load_file(path)
    got = ft.load_file(path, device="cuda")
    assert all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16).to(DEVICE))
               for n in want), "fastst's CUDA load differs from the file"
    if jax_gpu() is not None:
        import fastst.flax
        arrays = fastst.flax.load_file(path, device="gpu")
        assert all(np.asarray(arrays[n]).view(np.int16).tobytes()
                   == want[n].view(torch.int16).numpy().tobytes() for n in want), \
            "fastst's JAX load differs from the file"
        del arrays
    del got, want

    if jax_gpu() is not None:
        ROWS.update(JAX_ROWS)
    results: Dict[str, Dict[str, List[float]]] = {"hot": {}, "cold": {}}
    threads_tried = (1, 2, 4, 8, 16)
    hot_cases: Dict[str, Callable[[], None]] = {key: (lambda fn=fn: fn(path))
                                                for key, (_, fn) in ROWS.items()}
    for threads in threads_tried:
        hot_cases[f"pread{threads}"] = lambda t=threads: parallel_read(path, t)
        hot_cases[f"mmap{threads}"] = lambda t=threads: parallel_read(path, t, source="mmap")
    cold_cases = {key: case for key, case in hot_cases.items()
                  if key != "h2d" and not key.startswith("mmap")}
    if args.sweep:
        for chunk, count in SHAPES:
            case = lambda c=chunk, n=count: fastst_load(path, c * MiB, n)  # noqa: E731
            hot_cases[f"ring{chunk}x{count}"] = case
            if (chunk, count) in COLD_SHAPES:
                cold_cases[f"ring{chunk}x{count}"] = case

    for case in hot_cases.values():    # first calls: pinned buffers, streams, imports
        case()
    warm(path)
    for key, case in hot_cases.items():
        results["hot"][key] = timed(case, args.repeats, lambda: None)
        print(f"hot  {key:12s} {gbps(total, statistics.median(results['hot'][key])):7.2f} GB/s",
              flush=True)
    how = drop(path)
    for key, case in cold_cases.items():
        results["cold"][key] = timed(case, args.cold_repeats, lambda: drop(path))
        print(f"cold {key:12s} {gbps(total, statistics.median(results['cold'][key])):7.2f} GB/s",
              flush=True)
    rss = {key: measure_rss(key, path, small) for key in ROWS if key != "h2d"}

    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": info, "bytes": total, "cold_by": how, "times": results,
                       "peak_rss_delta": rss}, out, indent=1)
    print_table(results, rss, total, how, threads_tried)


def print_table(results, rss, total, how, threads_tried) -> None:
    def rate(mode: str, key: str) -> Optional[float]:
        times = results[mode].get(key)
        return gbps(total, statistics.median(times)) if times else None

    link = rate("hot", "h2d")
    best = {mode: max(((rate(mode, f"pread{t}") or 0.0), t) for t in threads_tried)
            for mode in ("hot", "cold")}
    best_mmap = max(((rate("hot", f"mmap{t}") or 0.0), t) for t in threads_tried)
    labelled = [(ROWS["h2d"][0], "h2d"), (ROWS["readinto"][0], "readinto"),
                (f"pread into pinned, no GPU (best of {threads_tried} threads: "
                 f"{best['hot'][1]} hot, {best['cold'][1]} cold)", "pread"),
                (f"parallel copy from mmap into pinned, no GPU ({best_mmap[1]} threads)", "mmap"),
                (ROWS["safetensors"][0], "safetensors"), (ROWS["views_to"][0], "views_to"),
                (ROWS["per_tensor"][0], "per_tensor"), (ROWS["fastst"][0], "fastst")]
    labelled += [(label, key) for key, (label, _) in JAX_ROWS.items() if key in results["hot"]]
    labelled += [(f"  fastst ring {key[4:]} (chunk MiB x buffers)", key)
                 for key in results["hot"] if key.startswith("ring")]
    print()
    print(f"Tensor bytes {total / 1e9:.2f} GB; median of runs; cold = page cache dropped "
          f"({how}) before each run; ratio = GB/s over the hot pinned-H2D limit "
          f"({link:.1f} GB/s)")
    print()
    print("| row | hot GB/s | × link | cold GB/s | × best cold pread | peak RSS Δ |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, key in labelled:
        if key == "pread":
            hot, cold = best["hot"][0], best["cold"][0]
        elif key == "mmap":
            hot, cold = best_mmap[0], None
        else:
            hot, cold = rate("hot", key), rate("cold", key)
        memory = rss.get(key)
        cells = [f"{hot:.2f}" if hot else "—", f"{hot / link:.2f}" if hot else "—",
                 f"{cold:.2f}" if cold else "—",
                 f"{cold / best['cold'][0]:.2f}" if cold else "—",
                 f"{memory / MiB:.0f} MiB" if memory is not None else "—"]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
