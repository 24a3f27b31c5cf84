"""MosaicML streaming over local MDS shards, the peer that bench/loader.py --loaders runs.

It runs in the virtual environment that streaming-venv.sh makes, not in the project's
(streaming requires numpy<2.2 and transformers<5), and imports numpy, torch and
streaming only:

    python bench/peers/streaming_mds.py check               # write, read back exactly
    python bench/peers/streaming_mds.py write TABLE.npy DIR  # the table as MDS shards
    python bench/peers/streaming_mds.py rate DIR BATCH ROWS  # prints {"rate": rows/s}

The table is written a row a sample (`ndarray:float32:COLUMNS`, uncompressed, shards
of streaming's default 64 MiB) and read with `StreamingDataset(local=DIR,
shuffle=True, batch_size=BATCH)` (its default shuffle, py1e) in torch's
`DataLoader(batch_size=BATCH, num_workers=2)` with fork, as a user of streaming
writes it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import types
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from clock import timed_rows  # noqa: E402   bench/clock.py: the clock loader.py uses

NAME = "x"
# a sample's array is a read-only view of the bytes read; torch's collate copies it
# into the batch, which is what the benchmark's consumer gets
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def streaming_base() -> types.ModuleType:
    """`streaming.base`, without running `streaming/__init__.py`.

    The package's `__init__` imports its vision datasets, which import torchvision; the
    only torchvision for torch 2.13.0 on PyPI (0.28.0) is a CUDA build whose extension
    needs libc10_cuda.so, and beside the CPU build of torch its import fails
    ("operator torchvision::nms does not exist"). Reading and writing MDS needs none of
    it: the package is entered as a bare namespace and `streaming.base` imported from it.
    """
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError("mosaicml-streaming is not installed in this environment")
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    import streaming.base
    return streaming.base


def write_mds(table: np.ndarray, folder: str) -> None:
    """The rows of a 2-D F32 table as MDS shards in `folder`, a row a sample."""
    base = streaming_base()
    partial = folder + ".part"
    shutil.rmtree(partial, ignore_errors=True)
    columns = {NAME: f"ndarray:float32:{table.shape[1]}"}
    with base.MDSWriter(out=partial, columns=columns, compression=None) as writer:
        for start in range(0, len(table), 1 << 16):
            for row in np.asarray(table[start:start + (1 << 16)]):
                writer.write({NAME: row})
    os.replace(partial, folder)


def shuffled_loader(folder: str, batch: int, workers: int = 2) -> DataLoader:
    base = streaming_base()
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()      # what a killed run of the same folder left
    dataset = base.StreamingDataset(local=folder, shuffle=True, shuffle_seed=0,
                                    batch_size=batch)
    return DataLoader(dataset, batch_size=batch, num_workers=workers,
                      multiprocessing_context="fork", timeout=600, prefetch_factor=2,
                      drop_last=True)


def full_batches(batches: Iterable[Any], batch: int) -> Iterator[Any]:
    """The batches, each checked to hold `batch` rows."""
    for got in batches:
        assert got[NAME].shape[0] == batch, got[NAME].shape
        yield got


def check(rows: int = 3000, columns: int = 16, batch: int = 64) -> None:
    """Write a small table, read it back in order and shuffled: every row exact."""
    table = np.random.default_rng(1).standard_normal((rows, columns), np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        folder = os.path.join(scratch, "mds")
        write_mds(table, folder)
        base = streaming_base()
        in_order = base.StreamingDataset(local=folder, shuffle=False, batch_size=batch)
        read = np.stack([sample[NAME] for sample in in_order])
        if not np.array_equal(read, table):
            raise AssertionError("the rows read in order differ from the rows written")
        seen = np.concatenate([got[NAME].numpy() for got in shuffled_loader(folder, batch)])
        whole = (len(table) // (2 * batch)) * 2 * batch    # drop_last, in each worker
        if len(seen) < whole or len(np.unique(seen, axis=0)) != len(seen):
            raise AssertionError(f"{len(seen)} rows came shuffled, {whole} expected once each")
        found = {row.tobytes() for row in table}
        if not all(row.tobytes() in found for row in seen):
            raise AssertionError("a shuffled row is none of the rows written")
        if np.array_equal(seen, table[:len(seen)]):
            raise AssertionError("shuffle=True gave the rows in order")
    print(f"MDS round trip exact: {rows} rows of {columns} F32 in order, "
          f"{len(seen)} shuffled through 2 workers")


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    command, *args = argv
    if command == "check":
        check()
    elif command == "write":
        table_path, folder = args
        write_mds(np.load(table_path, mmap_mode="r"), folder)
    elif command == "rate":     # folder batch rows [warmup: batches not timed, 4]
        folder, batch, rows = args[0], int(args[1]), int(args[2])
        warmup = int(args[3]) if len(args) > 3 else 4
        batches = full_batches(shuffled_loader(folder, batch), batch)
        print(json.dumps({"rate": timed_rows(batches, batch, rows, warmup)}), flush=True)
    else:
        raise SystemExit(f"unknown command {command!r}: check, write or rate")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
