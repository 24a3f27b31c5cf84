#!/usr/bin/env python
"""Partial reads: a few random rows of a large tensor, cold and hot.

    python bench/partial.py                        # the tables, as markdown
    python bench/partial.py --data-dir /var/tmp/x  # where the files go (a real disk)

A (4,000,000, 64) float32 array (977 MiB) is saved as safetensors, as HDF5 (contiguous,
with h5py where it is installed) and as .npy. *Cold*: the file's pages are dropped from
the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``, see page_cache.py), then 1,000
random rows are read, each copied out of what the reader gives: one
``get_slice(name)[i]`` each and one ``gather`` on fastst's default backend, the same by
the reference (``safetensors``), a plain ``os.pread`` of each row, h5py (one row a
read, and one read of the rows sorted) and ``np.load(mmap_mode="r")``. Each run is
timed alone and its bytes read from the disk counted (``/proc/self/io`` read_bytes;
0 on tmpfs, which reads no disk: the data folder must be on a real one). The methods
take turns, round after round; each row is the best of ``--repeats``. *Hot*: 1,000
single-row reads of a cached file, opened once.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Dict, List, Tuple

import numpy as np
from page_cache import disk_read_bytes, drop_pages

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS, COLUMNS = 4_000_000, 64
PICKED = 1_000
NAME = "x"


def make_inputs(folder: str) -> Dict[str, str]:
    import fastst

    os.makedirs(folder, exist_ok=True)
    paths = {kind: os.path.join(folder, f"partial.{kind}")
             for kind in ("safetensors", "h5", "npy")}
    if all(os.path.exists(path) for path in paths.values()):
        return paths
    array = np.random.default_rng(0).standard_normal((ROWS, COLUMNS), np.float32)
    fastst.save_file({NAME: array}, paths["safetensors"], fsync=True)
    np.save(paths["npy"], array)
    try:
        import h5py
    except ImportError:
        pass
    else:
        with h5py.File(paths["h5"], "w") as out:
            out.create_dataset(NAME, data=array)      # contiguous: no chunks given
    for path in paths.values():
        if os.path.exists(path):
            drop_pages(path)
    return paths


def cold_methods(paths: Dict[str, str], rows: np.ndarray
                 ) -> List[Tuple[str, str, Callable[[], object]]]:
    """(label, the file it reads, a run that reads the rows and copies them out)."""
    import fastst

    def pread() -> List[bytes]:
        with fastst.safe_open(paths["safetensors"]) as f:
            start, row_bytes = f.data_start + f.info(NAME).data_offsets[0], COLUMNS * 4
        fd = os.open(paths["safetensors"], os.O_RDONLY)
        try:
            return [os.pread(fd, row_bytes, start + int(row) * row_bytes) for row in rows]
        finally:
            os.close(fd)

    def fastst_rows() -> List[np.ndarray]:
        with fastst.safe_open(paths["safetensors"]) as f:
            part = f.get_slice(NAME)
            return [np.array(part[int(row)]) for row in rows]

    def fastst_gather() -> np.ndarray:
        with fastst.safe_open(paths["safetensors"]) as f:
            return f.gather(NAME, rows)

    def numpy_mmap() -> List[np.ndarray]:
        mapped = np.load(paths["npy"], mmap_mode="r")
        return [np.array(mapped[int(row)]) for row in rows]

    methods = [("os.pread, one row a call", "safetensors", pread),
               ("fastst get_slice(name)[i]", "safetensors", fastst_rows),
               ("fastst gather(name, rows)", "safetensors", fastst_gather),
               ('np.load(mmap_mode="r")[i]', "npy", numpy_mmap)]
    try:
        import safetensors
    except ImportError:
        pass
    else:
        def reference_rows() -> List[np.ndarray]:
            with safetensors.safe_open(paths["safetensors"], "np") as f:
                part = f.get_slice(NAME)
                return [np.array(part[int(row)]) for row in rows]
        methods.append(("safetensors get_slice(name)[i] (reference)", "safetensors",
                        reference_rows))
    if os.path.exists(paths["h5"]):
        import h5py

        def h5py_rows() -> List[np.ndarray]:
            with h5py.File(paths["h5"], "r") as f:
                dataset = f[NAME]
                return [dataset[int(row)] for row in rows]

        def h5py_sorted() -> np.ndarray:
            with h5py.File(paths["h5"], "r") as f:
                return f[NAME][np.unique(rows)]
        methods += [("h5py dataset[i]", "h5", h5py_rows),
                    ("h5py dataset[sorted rows]", "h5", h5py_sorted)]
    return methods


def cold_rows(paths: Dict[str, str], rows: np.ndarray, repeats: int
              ) -> List[Tuple[str, float, int]]:
    """(label, best seconds, bytes read from the disk in that run), the methods in
    turns, the file's pages dropped before each run."""
    methods = cold_methods(paths, rows)
    best = {label: (float("inf"), 0) for label, _, _ in methods}
    for _ in range(repeats):
        for label, kind, run in methods:
            drop_pages(paths[kind])
            before, start = disk_read_bytes(), time.perf_counter()
            result = run()
            seconds, read = time.perf_counter() - start, disk_read_bytes() - before
            del result
            best[label] = min(best[label], (seconds, read))
    return [(label,) + best[label] for label, _, _ in methods]


def hot_rows(paths: Dict[str, str], rows: np.ndarray, repeats: int
             ) -> List[Tuple[str, float]]:
    import fastst

    picked = [int(row) for row in rows]
    with fastst.safe_open(paths["safetensors"]) as f:
        f.gather(NAME, rows)
    readers: List[Tuple[str, Callable[[], object]]] = []
    handle = fastst.safe_open(paths["safetensors"])
    part = handle.get_slice(NAME)
    readers.append(("fastst get_slice(name)[i]", lambda: [part[i] for i in picked]))
    readers.append(("fastst get_tensor(name)[i]",
                    lambda: [handle.get_tensor(NAME)[i] for i in picked]))
    mapped = np.load(paths["npy"], mmap_mode="r")
    mapped[np.sort(rows)].sum()
    readers.append(('np.load(mmap_mode="r")[i]', lambda: [mapped[i] for i in picked]))
    try:
        import safetensors
    except ImportError:
        pass
    else:
        reference = safetensors.safe_open(paths["safetensors"], "np")
        reference_part = reference.get_slice(NAME)
        readers.append(("safetensors get_slice(name)[i] (reference)",
                        lambda: [reference_part[i] for i in picked]))
    best = {label: float("inf") for label, _ in readers}
    for _ in range(repeats):
        for label, run in readers:
            start = time.perf_counter()
            run()
            best[label] = min(best[label], time.perf_counter() - start)
    handle.close()
    return [(label, best[label]) for label, _ in readers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=os.path.join(HERE, "_data"))
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    paths = make_inputs(args.data_dir)
    rows = np.random.default_rng(args.seed).integers(0, ROWS, PICKED)
    print(f"load average before: {os.getloadavg()}\n")
    cold = {label: (seconds, read) for label, seconds, read in
            cold_rows(paths, rows, args.repeats)}
    hot = dict(hot_rows(paths, rows, max(args.repeats, 5)))
    pread_seconds, pread_bytes = cold["os.pread, one row a call"]
    hot_fastst = hot["fastst get_slice(name)[i]"]
    print(f"**{PICKED:,} random rows of a ({ROWS:,}, {COLUMNS}) float32 tensor "
          f"({ROWS * COLUMNS * 4 / 2**20:.0f} MiB)**: cold, then hot\n")
    print("| read | cold s | x pread | MiB read from disk | x pread's bytes | hot µs a row "
          "| x fastst get_slice |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label in list(cold) + [label for label in hot if label not in cold]:
        cells = ["", "", "", ""]
        if label in cold:
            seconds, read = cold[label]
            cells = [f"{seconds:.3f}", f"{seconds / pread_seconds:.2f}", f"{read / 2**20:.1f}",
                     f"{read / max(pread_bytes, 1):.1f}"]
        cells += ([f"{hot[label] / PICKED * 1e6:.2f}", f"{hot[label] / hot_fastst:.2f}"]
                  if label in hot else ["", ""])
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
