"""Loading onto many devices (fastst.distributed): the bytes each way reads, and its time.

    python bench/distributed.py [--mib 1024] [--jax-mib 256] [--repeats 3] [--dir DIR]
                                [--markdown FILE]

JAX, on 8 CPU host devices (a subprocess started with
XLA_FLAGS=--xla_force_host_platform_device_count=8): a model of bfloat16 tensors loaded
into meshes of 8, 4x2 and 2x4 devices, split along each mesh axis (first and second
array axis) or replicated. Bytes read (pread backend, counted by the kernel: rchar)
by ``fastst.flax.load_file(path, shardings=...)`` against the file's size, against
each device reading whole arrays, and against ``load_file`` then ``jax.device_put``;
time of the sharded load against ``load_file`` + ``jax.device_put(x, sharding)``, both
backends, page cache hot, median of `--repeats`.

torch.distributed, gloo on 127.0.0.1 (2 and 4 processes): a model of bfloat16 layers,
loaded three ways with the pread backend and the page cache dropped before each run
(``posix_fadvise(DONTNEED)``): every rank reading the whole file
(``fastst.torch.load_file``), ``load_split`` (each rank reads a part, then the ranks
exchange) and ``load_tensor_parallel`` (each rank reads its slices). Bytes read by all
ranks (rchar) against the file's size; wall time from a barrier to the last rank done.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

from page_cache import drop_pages  # noqa: E402  (before bench/ leaves sys.path)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != HERE]

import numpy as np  # noqa: E402

DEVICES = 8
MESHES = [((8,), ("x",)), ((4, 2), ("x", "y")), ((2, 4), ("x", "y"))]


def read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def write_model(path: str, mib: int, hidden: int) -> Dict[str, Any]:
    """Layers of q, k, v, o [hidden, hidden] and a norm [hidden], bfloat16, until the
    file holds about `mib` MiB; the tensor-parallel dimension of each."""
    import ml_dtypes

    import fastst

    layer = 4 * hidden * hidden * 2
    layers = max(1, (mib << 20) // layer)
    rng = np.random.default_rng(0)
    tensors, dims = {}, {}
    for i in range(layers):
        for name, dim in (("q", 0), ("k", 0), ("v", 0), ("o", 1)):
            key = f"layers.{i}.{name}"
            tensors[key] = rng.integers(0, 1 << 14, (hidden, hidden), dtype=np.uint16
                                        ).view(ml_dtypes.bfloat16)
            dims[key] = dim
        tensors[f"layers.{i}.norm"] = np.ones(hidden, ml_dtypes.bfloat16)
    fastst.save_file(tensors, path, fsync=True)
    return dims


# --- JAX, in a process of its own ------------------------------------------------------

def jax_part(path: str, repeats: int) -> List[Dict[str, Any]]:
    import gc

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import fastst.flax

    assert len(jax.devices()) == DEVICES
    size = os.path.getsize(path)
    fastst.flax.load_file(path, backend="pread")      # page cache hot, imports done

    def timed(load: Callable[[], Dict[str, Any]]) -> float:
        times = []
        for _ in range(repeats):
            gc.collect()
            start = time.perf_counter()
            jax.block_until_ready(load())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def counted(load: Callable[[], Any]) -> int:
        before = read_bytes()
        jax.block_until_ready(load())
        return read_bytes() - before

    warm = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())   # first-use imports
    jax.block_until_ready(fastst.flax.load_file(path, backend="pread", shardings=warm))
    jax.block_until_ready([jax.device_put(array, warm) for array in
                           fastst.flax.load_file(path, backend="pread").values()])
    whole_per_device = counted(lambda: [fastst.flax.load_file(path, device=device,
                                                              backend="pread")
                                        for device in jax.devices()])
    rows = []
    for layout, axes in MESHES:
        mesh = Mesh(np.array(jax.devices()).reshape(layout), axes)
        specs = [P()] + [P(axis) for axis in axes] + [P(None, axis) for axis in axes]
        for spec in specs:
            def sharding_of(name: str, shape: Any, dtype: Any, spec: Any = spec) -> Any:
                return NamedSharding(mesh, P(*tuple(spec)[:len(shape)]))

            def sharded(backend: str) -> Dict[str, Any]:
                return fastst.flax.load_file(path, shardings=sharding_of, backend=backend)

            def put(backend: str) -> Dict[str, Any]:
                loaded = fastst.flax.load_file(path, backend=backend)
                return {name: jax.device_put(array, sharding_of(name, array.shape, None))
                        for name, array in loaded.items()}

            rows.append({
                "mesh": "x".join(map(str, layout)), "spec": f"P{tuple(spec)!r}".replace(",)", ")"),
                "size": size, "sharded_bytes": counted(lambda: sharded("pread")),
                "put_bytes": counted(lambda: put("pread")), "whole_bytes": whole_per_device,
                "sharded_mmap": timed(lambda: sharded("mmap")),
                "put_mmap": timed(lambda: put("mmap")),
                "sharded_pread": timed(lambda: sharded("pread")),
                "put_pread": timed(lambda: put("pread"))})
    return rows


def run_jax(path: str, repeats: int) -> List[Dict[str, Any]]:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--jax-part", path, str(repeats)], env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    rows: List[Dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


# --- torch.distributed, one process a rank ----------------------------------------------

MODES = ["whole", "split", "tp"]


def torch_rank(path: str, dims_file: str, repeats: int, out: str) -> None:
    import gc

    import ml_dtypes  # noqa: F401  (what the loads import on first use, imported now)
    import torch
    import torch.distributed as dist

    import fastst._frameworks.cuda  # noqa: F401
    import fastst.distributed as fd
    import fastst.torch

    with open(dims_file) as file:
        dims = json.load(file)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(rows, torch.zeros(1))      # the group's first collective, outside the clock
    loads = {"whole": lambda: fastst.torch.load_file(path, backend="pread"),
             "split": lambda: fd.load_split(path, backend="pread"),
             "tp": lambda: fd.load_tensor_parallel(path, dims, backend="pread")}
    results: Dict[str, Any] = {mode: {"seconds": [], "bytes": []} for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            gc.collect()
            dist.barrier()
            if rank == 0:
                drop_pages(path)
            dist.barrier()
            start, before = time.perf_counter(), read_bytes()
            loaded = loads[mode]()
            read = read_bytes() - before
            dist.barrier()
            seconds = time.perf_counter() - start
            del loaded
            counts = [None] * world
            dist.all_gather_object(counts, read)
            results[mode]["seconds"].append(seconds)
            results[mode]["bytes"].append(sum(counts))
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_torch(path: str, dims: Dict[str, Any], world: int, repeats: int, folder: str
              ) -> Dict[str, Any]:
    dims_file, out = os.path.join(folder, "dims.json"), os.path.join(folder, f"torch{world}.json")
    with open(dims_file, "w") as file:
        json.dump(dims, file)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, __file__, "--torch-rank", path, dims_file,
                               str(repeats), out], env={**env, "RANK": str(rank)})
             for rank in range(world)]
    for process in ranks:
        if process.wait(timeout=3600) != 0:
            raise RuntimeError(f"a rank failed ({process.returncode})")
    with open(out) as file:
        results: Dict[str, Any] = json.load(file)
    return results


# --- tables ------------------------------------------------------------------------------

def jax_tables(rows: List[Dict[str, Any]], mib: float, repeats: int) -> List[str]:
    lines = [f"### JAX on {DEVICES} CPU host devices: bytes read ({mib:.0f} MiB of bfloat16, "
             f"pread)", "",
             "| mesh | spec | sharded load, × the file | each device reads whole arrays, × the "
             "file | `load_file` + `device_put`, × the file |",
             "| --- | --- | ---: | ---: | ---: |"]
    for row in rows:
        size = row["size"]
        lines.append(f"| {row['mesh']} | `{row['spec']}` | {row['sharded_bytes'] / size:.3f}× | "
                     f"{row['whole_bytes'] / size:.2f}× | {row['put_bytes'] / size:.3f}× |")
    lines += ["", f"### JAX on {DEVICES} CPU host devices: time, page cache hot "
              f"(median of {repeats})", "",
              "| mesh | spec | sharded load (mmap) | `load_file` + `device_put` (mmap) | "
              "sharded / the other (mmap) | sharded load (pread) | `load_file` + `device_put` "
              "(pread) | sharded / the other (pread) |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(
            f"| {row['mesh']} | `{row['spec']}` | {row['sharded_mmap'] * 1e3:.0f} ms | "
            f"{row['put_mmap'] * 1e3:.0f} ms | {row['sharded_mmap'] / row['put_mmap']:.2f}× | "
            f"{row['sharded_pread'] * 1e3:.0f} ms | {row['put_pread'] * 1e3:.0f} ms | "
            f"{row['sharded_pread'] / row['put_pread']:.2f}× |")
    return lines


TORCH_NAMES = {"whole": "every rank reads the whole file (`fastst.torch.load_file`)",
               "split": "split reads, then exchange (`load_split`)",
               "tp": "tensor-parallel slices (`load_tensor_parallel`)"}


def torch_table(results: Dict[int, Dict[str, Any]], size: int, repeats: int) -> List[str]:
    lines = [f"### torch.distributed, gloo on 127.0.0.1: {size / 2**20:.0f} MiB, page cache "
             f"cold (median of {repeats})", "",
             "| ranks | load | bytes read by all ranks | × the file | wall time | × every rank "
             "reading the whole file |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for world, modes in results.items():
        whole = statistics.median(modes["whole"]["seconds"])
        for mode in MODES:
            read = statistics.median(modes[mode]["bytes"])
            seconds = statistics.median(modes[mode]["seconds"])
            lines.append(f"| {world} | {TORCH_NAMES[mode]} | {read / 2**20:,.0f} MiB | "
                         f"{read / size:.2f}× | {seconds:.2f} s | {seconds / whole:.2f}× |")
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--jax-part"]:
        print(json.dumps(jax_part(sys.argv[2], int(sys.argv[3]))))
        return
    if sys.argv[1:2] == ["--torch-rank"]:
        torch_rank(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="the torch model's size")
    parser.add_argument("--jax-mib", type=int, default=256, help="the JAX model's size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--markdown", default=None, help="write the tables to this file")
    args = parser.parse_args()

    import jax
    import torch

    import fastst

    folder = tempfile.mkdtemp(prefix="fastst-distributed-", dir=args.dir)
    try:
        jax_path = os.path.join(folder, "jax.safetensors")
        write_model(jax_path, args.jax_mib, 2048)
        jax_rows = run_jax(jax_path, args.repeats)
        os.unlink(jax_path)
        torch_path = os.path.join(folder, "torch.safetensors")
        dims = write_model(torch_path, args.mib, 4096)
        size = os.path.getsize(torch_path)
        torch_results = {world: run_torch(torch_path, dims, world, args.repeats, folder)
                         for world in map(int, args.worlds.split(","))}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = [f"fastst {fastst.__version__}, jax {jax.__version__}, torch {torch.__version__}, "
             f"numpy {np.__version__}; {os.cpu_count()} CPUs", ""]
    lines += jax_tables(jax_rows, jax_rows[0]["size"] / 2**20, args.repeats)
    lines += [""] + torch_table(torch_results, size, args.repeats)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(text)


if __name__ == "__main__":
    main()
