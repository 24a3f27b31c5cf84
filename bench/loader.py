"""Rows per second through torch's DataLoader: random batches of a [N, 128] F32 tensor.

Three datasets answer the same shuffled batches of row numbers (torch's
BatchSampler over a RandomSampler, `batch_size=None`, so each worker fetches a
whole batch in one `dataset[rows]`):

- fastst:       `fastst.data.RowDataset` (one `gather` a batch, mmap backend)
- safetensors:  `safe_open(framework="pt")`, one `get_slice(name)[i:i + 1]` a row
- npy memmap:   `np.load(path, mmap_mode="r")[rows]` on the same data as a .npy

Each worker opens its file on its first batch. Page cache hot. The clock starts once
the first batches are in (worker start-up is not timed) and stops after the last.
`--in-process` adds rows for `dataset[rows]` called in this process: the fetch alone,
without the DataLoader's transfer of each batch from its worker.

    python bench/loader.py                      # 1 GiB, batches of 256 and 4096, fork and spawn
    python bench/loader.py --size-mib 64 --repeats 1     # a quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import fastst
from fastst.data import RowDataset

COLUMNS = 128
NAME = "x"


class SafetensorsRows(Dataset):
    """safetensors, as a user writes a batched fetch with it: a loop over the rows."""

    def __init__(self, path: str, length: int) -> None:
        self.path, self.length, self.handle = path, length, None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, rows: List[int]) -> torch.Tensor:
        if self.handle is None:
            from safetensors import safe_open
            self.handle = safe_open(self.path, framework="pt")
        part = self.handle.get_slice(NAME)
        return torch.cat([part[row:row + 1] for row in rows])

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "handle": None}


class NpyRows(Dataset):
    """A .npy file mapped by NumPy; a batch is one fancy index of the memmap."""

    def __init__(self, path: str) -> None:
        self.path, self.array = path, None
        self.length = np.load(path, mmap_mode="r").shape[0]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, rows: List[int]) -> torch.Tensor:
        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(self.array[rows])

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "array": None}


def write_inputs(folder: str, size_mib: int) -> Dict[str, str]:
    rows = size_mib * (1 << 20) // (COLUMNS * 4)
    paths = {"safetensors": os.path.join(folder, f"loader-{size_mib}.safetensors"),
             "npy": os.path.join(folder, f"loader-{size_mib}.npy")}
    if not all(os.path.exists(path) for path in paths.values()):
        os.makedirs(folder, exist_ok=True)
        data = np.random.default_rng(0).standard_normal((rows, COLUMNS), np.float32)
        fastst.save_file({NAME: data}, paths["safetensors"])
        np.save(paths["npy"], data)
        del data
    for path in paths.values():    # page cache hot
        with open(path, "rb") as source:
            while source.read(64 << 20):
                pass
    return paths


def rows_per_second(dataset: Dataset, batch: int, batches: int, context: str,
                    workers: int, seed: int) -> float:
    """Rows a second, from the end of the first batches to the last."""
    warmup = 2 * workers
    # an epoch of just the batches timed: the workers end with it, none is stopped mid-way
    rows = RandomSampler(dataset, num_samples=(warmup + batches) * batch,
                         generator=torch.Generator().manual_seed(seed))
    sampler = BatchSampler(rows, batch, drop_last=True)
    loader = DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=workers,
                        multiprocessing_context=context, timeout=600,
                        prefetch_factor=2)
    received = 0
    start = end = 0.0
    for k, tensor in enumerate(loader):
        assert tensor.shape == (batch, COLUMNS)
        end = time.perf_counter()    # the workers' shutdown, after the last, is not timed
        if k + 1 == warmup:
            start = end
        elif k >= warmup:
            received += tensor.shape[0]
    return received / (end - start)


def fetch_rate(dataset: Dataset, batch: int, batches: int, seed: int) -> float:
    """Rows a second of `dataset[rows]` called in this process: the fetch alone."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))
    batch_rows = [order[k * batch:(k + 1) * batch].tolist() for k in range(batches + 1)]
    dataset[batch_rows[-1]]     # opens the file
    start = time.perf_counter()
    for rows in batch_rows[:-1]:
        dataset[rows]
    return batches * batch / (time.perf_counter() - start)


def datasets(paths: Dict[str, str], length: int) -> Dict[str, Dataset]:
    found = {"fastst RowDataset (gather)": RowDataset(paths["safetensors"], NAME)}
    try:
        import safetensors  # noqa: F401
        found["safetensors safe_open pt (per-row loop)"] = SafetensorsRows(
            paths["safetensors"], length)
    except ImportError:
        print("safetensors is not installed: its rows are skipped", file=sys.stderr)
    found["np.load(mmap_mode='r') .npy (fancy index)"] = NpyRows(paths["npy"])
    return found


def fmt_rate(rate: float) -> str:
    return f"{rate / 1e6:.2f} M" if rate >= 1e6 else f"{rate / 1e3:.0f} k"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--batch-sizes", default="256,4096")
    parser.add_argument("--rows", type=int, default=400_000,
                        help="rows timed a measurement (at least 8 batches)")
    parser.add_argument("--contexts", default="fork,spawn")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-process", action="store_true",
                        help="also time dataset[rows] in this process, without a DataLoader")
    parser.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "_data"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    paths = write_inputs(args.data_dir, args.size_mib)
    length = args.size_mib * (1 << 20) // (COLUMNS * 4)
    found = datasets(paths, length)
    print(f"| DataLoader(num_workers={args.workers}), {args.size_mib} MiB [{length}, {COLUMNS}] "
          f"F32, random batches | context | batch | rows/s (median of {args.repeats}) "
          f"| × safetensors | × npy memmap |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    contexts = [context for context in args.contexts.split(",") if context]
    for context in contexts + (["in process"] if args.in_process else []):
        for batch in (int(size) for size in args.batch_sizes.split(",")):
            batches = max(8, args.rows // batch)
            if (batches + 2 * args.workers) * batch > length:
                parser.error(f"{batches} batches of {batch} rows, and the first ones, need "
                             f"more rows than the {length} of {args.size_mib} MiB")
            rates: Dict[str, List[float]] = {name: [] for name in found}
            names = list(found)
            for repeat in range(args.repeats):     # interleaved, the order rotated each round
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    dataset = found[name]
                    rates[name].append(
                        fetch_rate(dataset, batch, batches, repeat) if context == "in process"
                        else rows_per_second(dataset, batch, batches, context, args.workers,
                                             repeat))
            medians = {name: statistics.median(values) for name, values in rates.items()}
            peer_st = next((v for k, v in medians.items() if k.startswith("safetensors")), None)
            peer_npy = next(v for k, v in medians.items() if k.startswith("np.load"))
            for name, rate in medians.items():
                vs_st = f"{rate / peer_st:.2f}×" if peer_st else "n/a"
                print(f"| {name} | {context} | {batch} | {fmt_rate(rate)} | {vs_st} "
                      f"| {rate / peer_npy:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
