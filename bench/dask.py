"""Dask arrays over one 1 GiB [N, 128] F32 tensor: fastst against zarr, a stack of
.npy files and the raw limit, reading (a sum) and writing.

    python bench/dask.py [--mib 1024] [--repeats 3] [--dir DIR] [--markdown FILE]

Every format holds the same values in the same row chunks (`--chunk-mib`, 128 MiB
by default, dask's own chunk size). Each measurement runs on dask's threaded
scheduler (in this process) and on a LocalCluster of two worker processes of one
thread each; rounds are interleaved (each round runs every row once), the table
gives the median. Reads run with the page cache hot (every file is read once
first); before each write the previous output is deleted and ``os.sync()`` run,
outside the clock; writeback is not timed.

Also: what the per-process cache of open files saves, against reopening the file
for every chunk, for 4096 chunks of 64 KiB of a file with one tensor and of one
with 10,000 more tensors (a long header).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

# This file is bench/dask.py: keep its folder off the path, so that `import dask`
# finds the library.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != HERE]

import numpy as np  # noqa: E402

COLUMNS = 128


def timed(operation: Callable[[], Any]) -> float:
    start = time.perf_counter()
    operation()
    return time.perf_counter() - start


def write_inputs(directory: str, rows: int, chunk_rows: int) -> Dict[str, str]:
    """The same values as a safetensors file, zarr stores (uncompressed and with
    zarr's default compressor) and an .npy stack."""
    import dask.array as da
    import zarr

    import fastst

    paths = {"safetensors": os.path.join(directory, "x.safetensors"),
             "zarr": os.path.join(directory, "raw.zarr"),
             "zarr-default": os.path.join(directory, "default.zarr"),
             "npy": os.path.join(directory, "npy")}
    with fastst.StreamWriter(paths["safetensors"], {"x": ("F32", (rows, COLUMNS))}) as writer:
        for first in range(0, rows, chunk_rows):
            last = min(rows, first + chunk_rows)
            values = np.arange(first * COLUMNS, last * COLUMNS, dtype=np.int64) % 251
            writer.write("x", values.astype(np.float32).reshape(-1, COLUMNS), first)
    source = da.from_array(np.memmap(paths["safetensors"], np.float32, "r",
                                     data_start(paths["safetensors"]), (rows, COLUMNS)),
                           chunks=(chunk_rows, COLUMNS))
    for key, compressors in (("zarr", None), ("zarr-default", "auto")):
        store = zarr.create_array(paths[key], shape=(rows, COLUMNS), dtype="float32",
                                  chunks=(chunk_rows, COLUMNS), compressors=compressors)
        da.store(source, store, lock=False)
    da.to_npy_stack(paths["npy"], source, axis=0)
    return paths


def data_start(path: str) -> int:
    import fastst

    with fastst.safe_open(path) as f:
        return int(f.data_start)


def read_all(paths: Dict[str, str]) -> None:
    for root in paths.values():
        for folder, _, names in os.walk(root) if os.path.isdir(root) else [("", [], [root])]:
            for name in names:
                with open(os.path.join(folder, name), "rb") as file:
                    while file.read(64 << 20):
                        pass


def sums(paths: Dict[str, str], rows: int, chunk_rows: int) -> Dict[str, Callable[[], Any]]:
    """Each row of the read table: a function that returns the dask array to sum
    (or, for the raw limits, the sum itself)."""
    import dask.array as da

    from fastst.dask import from_safetensors

    start = data_start(paths["safetensors"])

    def raw_readinto() -> Any:
        array = np.empty((rows, COLUMNS), np.float32)
        with open(paths["safetensors"], "rb", buffering=0) as file:
            file.seek(start)
            file.readinto(memoryview(array).cast("B"))
        return array.sum()

    def raw_memmap() -> Any:
        return np.memmap(paths["safetensors"], np.float32, "r", start, (rows, COLUMNS)).sum()

    return {
        "raw: readinto of the bytes + NumPy sum (one thread)": raw_readinto,
        "raw: NumPy sum of a memmap (one thread)": raw_memmap,
        "fastst from_safetensors (pread)": lambda: from_safetensors(
            paths["safetensors"], "x", chunks=chunk_rows),
        "fastst from_safetensors (mmap)": lambda: from_safetensors(
            paths["safetensors"], "x", chunks=chunk_rows, backend="mmap"),
        "da.from_zarr, uncompressed": lambda: da.from_zarr(paths["zarr"]),
        "da.from_zarr, zarr's default compressor (zstd)": lambda: da.from_zarr(
            paths["zarr-default"]),
        "da.from_npy_stack (mmap_mode='r')": lambda: da.from_npy_stack(paths["npy"]),
        "da.from_npy_stack (mmap_mode=None: np.load)": lambda: da.from_npy_stack(
            paths["npy"], mmap_mode=None),
    }


def writes(directory: str, rows: int, chunk_rows: int) -> Dict[str, Callable[[Any], Any]]:
    """Each row of the write table: a function of the scheduler that writes the
    same dask array (ones, made in each chunk's task) and returns when done."""
    import dask.array as da
    import zarr

    from fastst.dask import to_safetensors

    def source() -> Any:
        return da.ones((rows, COLUMNS), dtype=np.float32, chunks=(chunk_rows, COLUMNS))

    def target(name: str) -> str:
        return os.path.join(directory, "written", name)

    def to_zarr(scheduler: Any, compressors: Any) -> None:
        store = zarr.create_array(target("out.zarr"), shape=(rows, COLUMNS),
                                  dtype="float32", chunks=(chunk_rows, COLUMNS),
                                  compressors=compressors)
        da.store(source(), store, lock=False, scheduler=scheduler)

    def to_npy_stack(scheduler: Any) -> None:
        import dask

        with dask.config.set(scheduler=scheduler):    # it takes no scheduler= itself
            da.to_npy_stack(target("out-npy"), source(), axis=0)

    ones = np.ones((rows, COLUMNS), np.float32)

    def raw_write(scheduler: Any) -> None:
        array = ones
        with open(target("raw.bin"), "wb", buffering=0) as file:
            file.write(memoryview(array).cast("B"))

    return {
        "raw: write() of the bytes of one array in memory (one thread)": raw_write,
        "fastst to_safetensors": lambda scheduler: to_safetensors(
            source(), target("out.safetensors"), name="x", scheduler=scheduler),
        "da.to_zarr, uncompressed": lambda scheduler: to_zarr(scheduler, None),
        "da.to_zarr, zarr's default compressor (zstd)": lambda scheduler: to_zarr(
            scheduler, "auto"),
        "da.to_npy_stack": lambda scheduler: to_npy_stack(scheduler),
    }


def measure_reads(rows_of: Dict[str, Callable[[], Any]], schedulers: Dict[str, Any],
                  repeats: int) -> Dict[Tuple[str, str], List[float]]:
    times: Dict[Tuple[str, str], List[float]] = {}
    expected = None
    for round_ in range(-1, repeats):     # round -1 warms up (imports, workers' first calls)
        for label, make in rows_of.items():
            for where, scheduler in schedulers.items():
                if label.startswith("raw") and where != "threads":
                    continue
                if label.startswith("raw"):
                    result: List[Any] = []
                    elapsed = timed(lambda: result.append(make()))
                else:
                    result = []
                    elapsed = timed(lambda: result.append(
                        make().sum().compute(scheduler=scheduler)))
                value = float(result[0])
                expected = value if expected is None else expected
                if abs(value - expected) > 1e-6 * abs(expected):
                    raise SystemExit(f"{label} on {where} summed {value}, not {expected}")
                if round_ >= 0:
                    times.setdefault((label, where), []).append(elapsed)
        print(f"read round {round_ + 1}/{repeats} done", file=sys.stderr)
    return times


def measure_writes(rows_of: Dict[str, Callable[[Any], Any]], schedulers: Dict[str, Any],
                   repeats: int, directory: str) -> Dict[Tuple[str, str], List[float]]:
    times: Dict[Tuple[str, str], List[float]] = {}
    for round_ in range(-1, repeats):     # round -1 warms up
        for label, write in rows_of.items():
            for where, scheduler in schedulers.items():
                if label.startswith("raw") and where != "threads":
                    continue
                # the last output is deleted, and everything flushed, before the clock starts
                shutil.rmtree(os.path.join(directory, "written"), ignore_errors=True)
                os.makedirs(os.path.join(directory, "written"))
                os.sync()
                elapsed = timed(lambda: write(scheduler))
                if round_ >= 0:
                    times.setdefault((label, where), []).append(elapsed)
        print(f"write round {round_ + 1}/{repeats} done", file=sys.stderr)
    return times


def open_cost(directory: str, chunks: int = 4096, chunk_bytes: int = 64 << 10
              ) -> List[Tuple[str, float, float]]:
    """Seconds a chunk read takes with the per-process cache of open files and
    with it off (a reopen, header parse included, for every chunk)."""
    import fastst
    import fastst.dask as fastst_dask

    rows = chunks * chunk_bytes // (COLUMNS * 4)
    rows_a_chunk = rows // chunks
    results = []
    for extra in (0, 10_000):
        path = os.path.join(directory, f"header-{extra}.safetensors")
        tensors = {"x": np.zeros((rows, COLUMNS), np.float32)}
        tensors.update({f"t{i:05d}": np.zeros(2, np.float32) for i in range(extra)})
        fastst.save_file(tensors, path)
        x = fastst_dask.from_safetensors(path, "x", chunks=rows_a_chunk)
        per_chunk = []
        kept_before = fastst_dask.OPEN_FILES_KEPT
        # none kept first: this file is not in the cache yet, so every chunk reopens it
        for kept in (0, kept_before):
            fastst_dask.OPEN_FILES_KEPT = kept
            x.compute(scheduler="sync")    # warm: the page cache, and the cache when kept
            best = min(timed(lambda: x.compute(scheduler="sync")) for _ in range(3))
            per_chunk.append(best / chunks)
        header = data_start(path)
        results.append((f"{extra + 1} tensors, header {header / 1024:.0f} KiB",
                        per_chunk[1], per_chunk[0]))
    return results


def table(times: Dict[Tuple[str, str], List[float]], gib: float, reference: str) -> List[str]:
    medians = {key: statistics.median(values) for key, values in times.items()}
    lines = ["| implementation | scheduler | median | GiB/s | × fastst |",
             "| --- | --- | ---: | ---: | ---: |"]
    for (label, where), median in medians.items():
        base = medians.get((reference, where), medians[(reference, "threads")])
        lines.append(f"| {label} | {where if not label.startswith('raw') else '-'} | "
                     f"{median:.3f} s | {gib / median:.2f} | {median / base:.2f}× |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--chunk-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--markdown", default=None, help="write the tables to this file")
    args = parser.parse_args()

    import dask
    import distributed
    import zarr

    import fastst

    rows = (args.mib << 20) // (COLUMNS * 4)
    chunk_rows = (args.chunk_mib << 20) // (COLUMNS * 4)
    gib = args.mib / 1024
    directory = tempfile.mkdtemp(prefix="fastst-dask-", dir=args.dir)
    try:
        paths = write_inputs(directory, rows, chunk_rows)
        read_all(paths)
        with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                      dashboard_address="127.0.0.1:0", host="127.0.0.1") as cluster, \
                distributed.Client(cluster, set_as_default=False) as client:
            schedulers = {"threads": "threads", "2 workers": client}
            read_times = measure_reads(sums(paths, rows, chunk_rows), schedulers, args.repeats)
            write_times = measure_writes(writes(directory, rows, chunk_rows), schedulers,
                                         args.repeats, directory)
        cache = open_cost(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    lines = [f"fastst {fastst.__version__}, dask {dask.__version__}, distributed "
             f"{distributed.__version__}, zarr {zarr.__version__}, numpy {np.__version__}; "
             f"{args.mib} MiB [{rows}, {COLUMNS}] F32 in chunks of {args.chunk_mib} MiB; "
             f"median of {args.repeats}", "",
             "### Sum of the tensor (`.sum().compute()`)", ""]
    lines += table(read_times, gib, "fastst from_safetensors (pread)")
    lines += ["", "### Writing it (`to_safetensors`, `da.store` into zarr, `da.to_npy_stack`)", ""]
    lines += table(write_times, gib, "fastst to_safetensors")
    lines += ["", "### A chunk read: the per-process cache of open files against a reopen "
              "per chunk (4096 chunks of 64 KiB, sync scheduler)", "",
              "| file | cached | reopened each chunk | reopened / cached |",
              "| --- | ---: | ---: | ---: |"]
    for label, cached, reopened in cache:
        lines.append(f"| {label} | {cached * 1e6:.1f} µs | {reopened * 1e6:.1f} µs | "
                     f"{reopened / cached:.1f}× |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
