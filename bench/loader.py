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

`--loaders` compares fastst's thread `Loader` with the data loaders of other
libraries instead (see `LOADERS_DOC`); `--cold` adds runs from a cold page cache:

    python bench/loader.py --loaders --cold     # 1 GiB tables [N, 128] and [N, 1024] F32

MosaicML streaming runs in a virtual environment of its own (it requires numpy<2.2):
`bash bench/peers/streaming-venv.sh` makes it where `--streaming-python` looks first.
`--url` times the Loader over HTTP instead, against the link:

    python bench/loader.py --url --size-mib 256

`--shards` times the Loader over the 1 GiB [N, 128] table split into many files
(hot), against the same table in one file, with the checks of files' lengths made;
`--cold-epochs N` times whole cold epochs alone, N rounds of `cat` and an epoch of
each shuffle, each from dropped pages:

    python bench/loader.py --shards 16,256
    python bench/loader.py --cold-epochs 5 --columns 128,1024

`--epoch-starts N` times hot epochs from their start, N rounds: the permutation of the
rows (NumPy's and fastst's), and the Loader's first batch and whole epoch (unshuffled
and both shuffles), with the epoch's CPU time and context switches;
`--cold-limits N` what bounds a cold block shuffle: `cat`, the shuffle's reads alone
and beside two busy processes, and the Loader's cold epochs:

    python bench/loader.py --epoch-starts 5 --columns 128,1024
    python bench/loader.py --cold-limits 4 --columns 128,1024
"""
from __future__ import annotations

import argparse
import glob
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler

import fastst
from clock import timed_rows
from page_cache import drop_pages
from fastst.data import Loader, RowDataset
from fastst._core import read_counters

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
    if rate < 1e4:
        return f"{rate:.0f}"
    return f"{rate / 1e6:.2f} M" if rate >= 1e6 else f"{rate / 1e3:.0f} k"


# ---------------------------------------------------------------------------
# --loaders: fastst's thread Loader against the data loaders of other libraries
# ---------------------------------------------------------------------------

LOADERS_DOC = """Shuffled batches from a table, each loader with two threads or two workers:

- fastst Loader:        `fastst.data.Loader(threads=2)`, NumPy batches (ring reused)
- fastst RowDataset:    `RowDataset` in torch's DataLoader (2 workers, fork)
- npy memmap:           `np.load(mmap_mode="r")[rows]` in torch's DataLoader (2 workers, fork)
- HF datasets:          an Arrow file, `Dataset.from_file(...).with_format("numpy")`,
                        `ds[rows]` a batch, in torch's DataLoader (2 workers, fork)
- grain:                an ArrayRecord file (a row a record), `grain.DataLoader`
                        (2 workers), a MapTransform that views each record, Batch
- MosaicML streaming:   local MDS shards (a row a sample, uncompressed),
                        `StreamingDataset(local=..., shuffle=True)` in torch's
                        DataLoader (2 workers, fork), in its own environment
                        (bench/peers/streaming_mds.py)
- in-process gather:    `f.gather(name, rows, out=buffer)` in a loop (no loader)
- memcpy:               `np.copyto` of as many adjacent rows into a buffer

Hot runs are timed from the end of the first batches (start-up is not timed; for the
Loader, the first fill of its ring of 8 buffers, whose pages the first batches fault
in), over a page cache that holds the files in large folios (`warm_cache`). Cold
runs (`--cold`: the file's pages dropped first) are timed from the start, start-up
included, since the first batches are where the reading starts; `cat` of the file,
cold, is timed just before each batch size's cold runs; `--cold-rows` sets their rows
(a whole epoch at most). After each cold run of the Loader, the same Loader is timed
from the start of its next epoch ("as left"): over the page cache as the cold epoch
left it (the pages it read, in the folios it read them in).
"""


PEERS = ("loader", "rowdataset", "datasets", "grain", "streaming")
STREAMING_VENV = os.path.join(  # where bench/peers/streaming-venv.sh makes it
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastst-bench",
    "streaming-venv", "bin", "python")
STREAMING_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers",
                               "streaming_mds.py")
STREAMING_NAME = "MosaicML streaming MDS in DataLoader (2 workers)"


def table_files(folder: str, size_mib: int, columns: int,
                streaming_python: Optional[str] = None,
                kinds: Tuple[str, ...] = ("safetensors", "npy", "arrow", "array_record")
                ) -> Dict[str, str]:
    """The table [N, columns] F32 as safetensors, .npy, Arrow and ArrayRecord files
    (those of `kinds`), and as a folder of MDS shards where `streaming_python` is
    given."""
    rows = size_mib * (1 << 20) // (columns * 4)
    stem = os.path.join(folder, f"table-{size_mib}-{columns}")
    paths = {kind: stem + "." + kind for kind in kinds}
    os.makedirs(folder, exist_ok=True)
    data = None
    for kind, path in paths.items():
        if os.path.exists(path):
            continue
        if data is None:
            data = np.random.default_rng(0).standard_normal((rows, columns), np.float32)
        writer = {"safetensors": lambda p: fastst.save_file({NAME: data}, p),
                  "npy": lambda p: np.save(p, data), "arrow": write_arrow,
                  "array_record": write_array_record}[kind]
        try:
            writer(path) if kind in ("safetensors", "npy") else writer(path, data)
        except ImportError as error:
            print(f"{kind}: {error}", file=sys.stderr)
    if streaming_python:
        paths["mds"] = stem + ".mds"
        if not os.path.exists(paths["mds"]):
            subprocess.run([streaming_python, STREAMING_CHILD, "write", paths["npy"],
                            paths["mds"]], check=True)
    return {kind: path for kind, path in paths.items() if os.path.exists(path)}


def write_arrow(path: str, data: np.ndarray) -> None:
    import pyarrow as pa
    column = pa.FixedSizeListArray.from_arrays(pa.array(data.ravel()), data.shape[1])
    table = pa.table({NAME: column})
    with pa.OSFile(path + ".part", "wb") as sink, pa.ipc.new_stream(sink, table.schema) as out:
        out.write_table(table, max_chunksize=1 << 16)
    os.replace(path + ".part", path)


def write_array_record(path: str, data: np.ndarray) -> None:
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(path + ".part", "group_size:1")
    for row in data:
        writer.write(row.tobytes())
    writer.close()
    os.replace(path + ".part", path)


def files_in(paths: Tuple[str, ...]) -> List[str]:
    """The paths, each folder among them replaced by the files in it."""
    found: List[str] = []
    for path in paths:
        if os.path.isdir(path):
            found.extend(os.path.join(path, name) for name in sorted(os.listdir(path)))
        else:
            found.append(path)
    return found


def drop_cache(*paths: str) -> None:
    """posix_fadvise(DONTNEED): the files' pages out of the page cache (a folder's
    files for a folder). Pages that a process still maps stay: every map of the
    benchmark is gone by then."""
    import gc
    gc.collect()
    for path in files_in(paths):
        drop_pages(path)
        resident = subprocess.run(["fincore", "-nb", "-o", "RES", path], capture_output=True,
                                  text=True).stdout.strip()
        print(f"{os.path.basename(path)}: {resident or '?'} bytes still cached after "
              f"DONTNEED", file=sys.stderr)


def warm_cache(*paths: str) -> None:
    """The files read into the page cache afresh: their pages dropped, then read in
    order, so that the cache holds them in large folios, as after any sequential read,
    whatever the runs before left there. Random reads and read-ahead hints (a cold
    run's) leave 4 KiB pages, which a map then maps one by one: rows gathered from
    them miss the TLB, and gathers and copies ran 2-3x slower over them."""
    drop_cache(*paths)
    for path in files_in(paths):
        with open(path, "rb") as source:
            while source.read(64 << 20):
                pass


def rate_fastst_loader(paths: Dict[str, str], batch: int, rows: int, shuffle: Any = True,
                       warmup: int = 8) -> float:
    """Rows a second of the Loader, hot from the end of its ring's first fill (8
    buffers, 2 x prefetch, each faulted in by its first batch: start-up)."""
    with Loader(paths["safetensors"], NAME, batch, shuffle=shuffle, seed=0, threads=2,
                drop_last=True) as loader:
        return timed_rows(loader, batch, rows, warmup)


def rates_cold_then_next_epoch(paths: Dict[str, str], batch: int, rows: int,
                               shuffle: Any) -> Tuple[float, float]:
    """The Loader's rate over `rows` rows from the start, the file's pages dropped
    first, then over as many rows of the next epoch (the rest of the first taken
    untimed): over the page cache as the cold epoch left it."""
    drop_cache(paths["safetensors"])
    with Loader(paths["safetensors"], NAME, batch, shuffle=shuffle, seed=0, threads=2,
                drop_last=True) as loader:
        cold = timed_rows(loader, batch, rows, warmup=0)
        for _ in loader:
            pass
        return cold, timed_rows(loader, batch, rows, warmup=0)


def rate_row_dataset(paths: Dict[str, str], batch: int, rows: int) -> float:
    with RowDataset(paths["safetensors"], NAME) as dataset:   # closed: no map left behind
        return rate_in_data_loader(dataset, batch, rows)


def rate_in_data_loader(dataset: Dataset, batch: int, rows: int, warmup: int = 4) -> float:
    sampler = BatchSampler(RandomSampler(dataset, generator=torch.Generator().manual_seed(0)),
                           batch, drop_last=True)
    loader = DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=2,
                        multiprocessing_context="fork", timeout=600, prefetch_factor=2)
    return timed_rows(loader, batch, rows, warmup)


class ArrowRows(Dataset):
    """A Hugging Face datasets Arrow file, NumPy format; a batch is one ds[rows]."""

    def __init__(self, path: str) -> None:
        import datasets
        self.path, self.rows = path, None
        self.length = len(datasets.Dataset.from_file(path))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, rows: List[int]) -> Any:
        if self.rows is None:
            import datasets
            self.rows = datasets.Dataset.from_file(self.path).with_format("numpy")
        return self.rows[rows][NAME]

    def __getstate__(self) -> Dict[str, Any]:
        return {**self.__dict__, "rows": None}


try:     # grain's workers unpickle the transform: it is defined at the top level
    import grain.python as grain

    class ViewRow(grain.MapTransform):  # type: ignore[misc]
        """A record (a row's bytes) as its F32 row."""

        def map(self, record: bytes) -> np.ndarray:
            return np.frombuffer(record, np.float32)
except ImportError:
    grain = None


def rate_grain(paths: Dict[str, str], batch: int, rows: int, columns: int) -> float:
    """grain's rate, measured in a child process in a session of its own: grain's
    worker processes outlive its iterator (spinning, they would take the cores from
    the rows measured after it, and keep the child from exiting); the whole session
    is killed once the child has sent the rate."""
    import multiprocessing
    import signal

    context = multiprocessing.get_context("spawn")
    theirs, ours = context.Pipe(duplex=False)
    child = context.Process(target=grain_in_a_session,
                            args=(ours, paths, batch, rows, columns))
    child.start()
    try:
        rate = theirs.recv()
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:     # it died before it made its session
            child.kill()
        child.join()
    if isinstance(rate, BaseException):
        raise rate
    return rate


def grain_in_a_session(out: Any, paths: Dict[str, str], batch: int, rows: int,
                       columns: int) -> None:
    os.setsid()
    try:
        out.send(rate_grain_here(paths, batch, rows, columns))
    except BaseException as error:    # the parent raises it
        out.send(error)


def rate_grain_here(paths: Dict[str, str], batch: int, rows: int, columns: int) -> float:
    from absl import flags
    flags.FLAGS.mark_as_parsed()     # grain reads its flags; a script need not parse them
    source = grain.ArrayRecordDataSource([paths["array_record"]])
    sampler = grain.IndexSampler(num_records=len(source), shard_options=grain.NoSharding(),
                                 shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(data_source=source, sampler=sampler, worker_count=2,
                              operations=[ViewRow(), grain.Batch(batch, drop_remainder=True)])
    batches = iter(loader)
    rate = timed_rows(batches, batch, rows, warmup=4)
    del batches, loader      # its worker processes end with the iterator, not before
    import gc
    gc.collect()
    return rate


def rate_streaming(python: str, folder: str, batch: int, rows: int, warmup: int = 4) -> float:
    """MosaicML streaming's rate, measured by bench/peers/streaming_mds.py run by the
    Python of its own environment, in a session of its own that is killed after (as
    grain's: no worker is left to take the cores from the rows measured next)."""
    import json
    import signal

    child = subprocess.Popen([python, STREAMING_CHILD, "rate", folder, str(batch), str(rows),
                              str(warmup)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=900)
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
    if child.returncode != 0:
        raise RuntimeError(f"streaming_mds.py rate exited {child.returncode}: "
                           f"{err.strip()[-2000:]}")
    return float(json.loads(out.strip().splitlines()[-1])["rate"])


def rate_gather(paths: Dict[str, str], batch: int, rows: int) -> float:
    with fastst.safe_open(paths["safetensors"]) as f:
        length = f.info(NAME).shape[0]
        order = np.random.default_rng(0).permutation(length)
        out = np.empty((batch, *f.info(NAME).shape[1:]), np.float32)
        batches = [order[k * batch:(k + 1) * batch] for k in range(min(length // batch,
                                                                        rows // batch + 2))]
        return timed_rows((f.gather(NAME, rows_of, out=out) for rows_of in batches),
                          batch, rows)


def rate_memcpy(paths: Dict[str, str], batch: int, rows: int) -> float:
    table = np.load(paths["npy"], mmap_mode="r")
    out = np.empty((batch, table.shape[1]), table.dtype)
    starts = np.random.default_rng(0).integers(0, max(1, len(table) - batch), rows // batch + 2)
    rate = timed_rows((np.copyto(out, table[s:s + batch]) for s in starts), batch, rows)
    return rate


def free_page_reporting() -> str:
    """Whether this machine hands freed memory back to its host (a virtio balloon's
    free page reporting): a cold run's page cache is then partly memory the host must
    give again on its first touch, a cost of the machine that varies from run to run
    (what was freed, and whether it has been reported yet)."""
    try:
        with open("/sys/module/page_reporting/parameters/page_reporting_order") as order:
            blocks = (4096 << int(order.read())) >> 20     # MiB
    except (OSError, ValueError):
        return "no free page reporting"
    for features in glob.glob("/sys/bus/virtio/devices/*/features"):
        with open(features) as bits, open(os.path.join(os.path.dirname(features),
                                                       "device")) as device:
            if device.read().strip() == "0x0005" and bits.read()[5:6] == "1":
                return f"free page reporting to the host (free blocks of {blocks} MiB and more)"
    return "no free page reporting"


def cat_rate(path: str) -> float:
    """Bytes a second of reading the file whole, cold, as cat does."""
    drop_cache(path)
    start = time.perf_counter()
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return os.path.getsize(path) / (time.perf_counter() - start)


def loader_memory(paths: Dict[str, str], batch: int) -> Tuple[int, int]:
    """(peak RSS, anonymous RSS at the end) in KiB of a process that runs a Loader
    through an epoch: the mapped file's pages count in the first, not the second."""
    code = (f"from fastst.data import Loader\n"
            f"for b in Loader({paths['safetensors']!r}, {NAME!r}, {batch}, shuffle=True, "
            f"seed=0, threads=2): pass\n"
            f"status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
            f"print(status['VmHWM'].split()[0], status['RssAnon'].split()[0])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    peak, anonymous = done.stdout.split()
    return int(peak), int(anonymous)


def compare_loaders(args: argparse.Namespace) -> int:
    peers = set(args.peers.split(","))
    if not peers <= set(PEERS):
        raise SystemExit(f"--peers: {', '.join(sorted(peers - set(PEERS)))} is none of "
                         f"{', '.join(PEERS)}")
    print(f"load before: {os.getloadavg()}; {free_page_reporting()}", file=sys.stderr)
    print("| loader | table | batch | cache | rows/s | × npy memmap DataLoader "
          "| × in-process gather | × memcpy |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    streaming_python = args.streaming_python if "streaming" in peers else None
    if streaming_python and not os.path.exists(streaming_python):
        print(f"{streaming_python} does not exist: MosaicML streaming's rows are skipped "
              f"(bash bench/peers/streaming-venv.sh makes its environment)", file=sys.stderr)
        streaming_python = None
    for columns in (int(c) for c in args.columns.split(",")):
        paths = table_files(args.data_dir, args.size_mib, columns, streaming_python)
        length = args.size_mib * (1 << 20) // (columns * 4)
        shape = f"[{length}, {columns}] F32"
        for batch in (int(size) for size in args.batch_sizes.split(",")):
            rows = min(args.rows, (length // batch - 8) * batch)
            warm_cache(*paths.values())
            rates = {"in-process gather": rate_gather(paths, batch, rows),
                     "memcpy of the same bytes": rate_memcpy(paths, batch, rows)}
            if "loader" in peers:
                rates["fastst Loader (2 threads)"] = rate_fastst_loader(paths, batch, rows)
            if "rowdataset" in peers:
                rates["fastst RowDataset in DataLoader (2 workers)"] = rate_row_dataset(
                    paths, batch, rows)
            rates["npy memmap in DataLoader (2 workers)"] = rate_in_data_loader(
                NpyRows(paths["npy"]), batch, rows)
            if "arrow" in paths and "datasets" in peers:
                rates["HF datasets Arrow in DataLoader (2 workers)"] = rate_in_data_loader(
                    ArrowRows(paths["arrow"]), batch, rows)
            if "array_record" in paths and grain is not None and "grain" in peers:
                rates["grain ArrayRecord DataLoader (2 workers)"] = rate_grain(
                    paths, batch, min(rows, args.grain_rows), columns)
            if "mds" in paths:
                rates[STREAMING_NAME] = rate_streaming(streaming_python, paths["mds"],
                                                       batch, rows)
            for name, rate in rates.items():
                print_rate(name, shape, batch, "hot", rate, rates)
            if args.cold:
                cold_rates(paths, shape, batch, columns, peers, rates, streaming_python,
                           min(args.cold_rows or args.rows, length // batch * batch))
        if "loader" in peers:
            peak, anonymous = loader_memory(paths, 4096)
            print(f"\nLoader over {shape}, batches of 4096: peak RSS {peak / 1024:.0f} MiB "
                  f"(the map's pages included), anonymous RSS {anonymous / 1024:.0f} MiB\n",
                  flush=True)
    print(f"load after: {os.getloadavg()}", file=sys.stderr)
    return 0


def cold_rates(paths: Dict[str, str], shape: str, batch: int, columns: int, peers: Set[str],
               rates: Dict[str, float], streaming_python: Optional[str], rows: int) -> None:
    """Print cat's rate of the file and, just after it, the cold runs: each timed from
    the start once the file's pages are dropped."""
    rate = cat_rate(paths["safetensors"])
    print(f"| cat (sequential, cold) | {shape} | {batch} | cold | "
          f"{fmt_rate(rate / (columns * 4))} rows ({rate / 2 ** 20:.0f} MiB/s) | | | |",
          flush=True)
    for shuffle in (True, "blocks") if "loader" in peers else ():
        cold, next_epoch = rates_cold_then_next_epoch(paths, batch, rows, shuffle)
        name = f"fastst Loader (2 threads), shuffle={shuffle!r}"
        print_rate(name, shape, batch, "cold", cold, rates)
        print_rate(f"{name}, the next epoch", shape, batch, "as left", next_epoch, rates)
    drop_cache(paths["npy"])
    print_rate("npy memmap in DataLoader (2 workers)", shape, batch, "cold",
               rate_in_data_loader(NpyRows(paths["npy"]), batch, rows, warmup=0), rates)
    if "mds" in paths:
        drop_cache(paths["mds"])
        print_rate(STREAMING_NAME, shape, batch, "cold", rate_streaming(
            streaming_python, paths["mds"], batch, rows, warmup=0), rates)


def loader_over_url(args: argparse.Namespace) -> int:
    """The Loader over HTTP: shuffled batches of a [N, 128] F32 table (512 B rows) served
    by tests/servers.py's server in a process of its own, each way against the link (one
    GET of the whole file, in rows a second). A full shuffle asks for each row apart; a
    block shuffle fetches whole blocks a window ahead (fastst's HTTP client, and fsspec's
    aiohttp transport)."""
    from remote import http_server_process, single_get

    length = args.size_mib * (1 << 20) // (COLUMNS * 4)
    table = np.random.default_rng(0).standard_normal((length, COLUMNS), np.float32)
    data = fastst.save({NAME: table})
    url, stop, process = http_server_process(data, None, 0.0)
    try:
        single_get(url)
        started = time.perf_counter()
        single_get(url)
        link = length / (time.perf_counter() - started)
        print(f"Produced by `python bench/loader.py --url --size-mib {args.size_mib}` on "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
              f"{os.getloadavg()[0]:.2f}: [{length}, {COLUMNS}] F32 over HTTP on "
              f"127.0.0.1, 2 threads.\n")
        print("| loader | batch | rows timed | rows/s | × the link |")
        print("| --- | ---: | ---: | ---: | ---: |")
        print(f"| one GET of the whole file (the link) | | {length} | {fmt_rate(link)} | 1.00× |")
        for batch in (int(size) for size in args.batch_sizes.split(",")):
            for shuffle, transport, rows in [(True, "http", 20_000), (True, "fsspec", 20_000),
                                             ("blocks", "http", length),
                                             ("blocks", "fsspec", length)]:
                rows = min(rows, (length // batch - 2) * batch)
                with Loader(url, NAME, batch, shuffle=shuffle, seed=0, threads=2,
                            drop_last=True, storage_options={"transport": transport}) as loader:
                    rate = timed_rows(loader, batch, rows, warmup=0)
                print(f"| fastst Loader, shuffle={shuffle!r}, {transport} transport | {batch} | "
                      f"{rows} | {fmt_rate(rate)} | {rate / link:.2f}× |", flush=True)
    finally:
        stop.set()
        process.join(10)
    return 0


def shard_files(path: str, count: int) -> List[str]:
    """The rows of the table at `path` in `count` files of as many rows (the last
    takes what is left), in a folder beside it; written once."""
    folder = f"{os.path.splitext(path)[0]}-in-{count}"
    paths = [os.path.join(folder, f"part-{k:05d}.safetensors") for k in range(count)]
    if all(os.path.exists(shard) for shard in paths):
        return paths
    os.makedirs(folder, exist_ok=True)
    with fastst.safe_open(path) as table:
        rows = table.info(NAME).shape[0]
        for k, shard in enumerate(paths):
            first, stop = k * (rows // count), rows if k == count - 1 else (k + 1) * (rows // count)
            fastst.save_file({NAME: table.get_slice(NAME)[first:stop]}, shard)
    return paths


def loader_over_shards(args: argparse.Namespace) -> int:
    """The Loader (full shuffle, 2 threads, hot) over the [N, 128] F32 table in one
    file and split into shards, alternated `--repeats` times (the median), with the
    checks of the files' lengths (fstat) the gathers made a batch."""
    table = table_files(args.data_dir, args.size_mib, COLUMNS)["safetensors"]
    sources: Dict[str, List[str]] = {"1 file": [table]}
    for count in (int(c) for c in args.shards.split(",")):
        sources[f"{count} files"] = shard_files(table, count)
    print(f"Produced by `python bench/loader.py --shards {args.shards}` on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}: [{args.size_mib << 20 >> 9}, {COLUMNS}] F32, page cache "
          f"hot (each source dropped and read in order first), full shuffle, 2 threads, "
          f"median of {args.repeats}.\n")
    print("| source | batch | rows/s | × 1 file | length checks (batches) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for paths in sources.values():
        warm_cache(*paths)
    for batch in (int(size) for size in args.batch_sizes.split(",")):
        rates: Dict[str, List[float]] = {name: [] for name in sources}
        checks: Dict[str, str] = {}
        for repeat in range(args.repeats):
            for name, paths in (list(sources.items())[::1 if repeat % 2 == 0 else -1]):
                before = read_counters().get("files_checked")    # None: not counted
                with Loader(paths, NAME, batch, shuffle=True, seed=repeat, threads=2,
                            drop_last=True) as loader:
                    rates[name].append(timed_rows(loader, batch, args.rows, warmup=8))
                made = (f"{read_counters()['files_checked'] - before}"
                        if before is not None else "not counted")
                checks[name] = f"{made} ({-(-args.rows // batch) + 8})"
        one = statistics.median(rates["1 file"])
        for name in sources:
            rate = statistics.median(rates[name])
            print(f"| {name} | {batch} | {fmt_rate(rate)} | {rate / one:.2f}× "
                  f"| {checks[name]} |", flush=True)
    return 0


def cold_epochs(args: argparse.Namespace) -> int:
    """Whole epochs from a cold page cache, nothing else timed between them: for each
    table, `--cold-epochs` rounds of `cat` of the file and an epoch of each shuffle
    (batches of `--batch-sizes`' first), each after its pages are dropped; the
    medians, and each epoch's rate over the `cat` of its round."""
    batch = int(args.batch_sizes.split(",")[0])
    print(f"Produced by `python bench/loader.py --cold-epochs {args.cold_epochs} --columns "
          f"{args.columns}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"average {os.getloadavg()[0]:.2f}: batches of {batch}, 2 threads, medians of "
          f"{args.cold_epochs} rounds; {free_page_reporting()}.\n")
    print("| table | `cat`, MiB/s | epoch | seconds | of `cat`'s rate (range) |")
    print("| --- | ---: | --- | ---: | ---: |")
    for columns in (int(c) for c in args.columns.split(",")):
        path = table_files(args.data_dir, args.size_mib, columns)["safetensors"]
        size = os.path.getsize(path)
        cats: List[float] = []
        epochs: Dict[str, List[float]] = {"full shuffle": [], "block shuffle": []}
        for _ in range(args.cold_epochs):
            cats.append(size / cat_rate(path))
            for name, shuffle in (("full shuffle", True), ("block shuffle", "blocks")):
                drop_cache(path)
                epochs[name].append(seconds(lambda: whole_epoch(path, batch, shuffle)))
        print_over_cat(f"[{size // (columns * 4)}, {columns}] F32", size, cats, epochs)
    return 0


def print_over_cat(shape: str, size: int, cats: List[float],
                   times: Dict[str, List[float]]) -> None:
    """A row for each of `times` (seconds of each round): its median, and its rate
    over that of `cat` in the same round (`cats`, seconds), median and range."""
    for name, taken in times.items():
        ratios = sorted(cat / took for cat, took in zip(cats, taken))
        print(f"| {shape} | {size / statistics.median(cats) / 2 ** 20:.0f} | {name} "
              f"| {statistics.median(taken):.3f} | {statistics.median(ratios):.2f} "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |", flush=True)


def cold_limits(args: argparse.Namespace) -> int:
    """What bounds a cold block shuffle: `--cold-limits` rounds of `cat`; the
    shuffle's own reads alone (`Reader.cache_rows` of each block of epoch 0, in the
    order the Loader reads them, on as many threads as it reads with), and the same
    beside two busy processes that any other thread goes before (SCHED_IDLE, a
    Python loop each: no memory traffic); and the Loader's cold epochs, each after
    its pages are dropped. Medians, and the rate of each over `cat`'s of its round."""
    batch = int(args.batch_sizes.split(",")[0])
    print(f"Produced by `python bench/loader.py --cold-limits {args.cold_limits} --columns "
          f"{args.columns}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"average {os.getloadavg()[0]:.2f}: batches of {batch}, 2 threads, medians of "
          f"{args.cold_limits} rounds; {free_page_reporting()}.\n")
    print("| table | `cat`, MiB/s | reading | seconds | of `cat`'s rate (range) |")
    print("| --- | ---: | --- | ---: | ---: |")
    for columns in (int(c) for c in args.columns.split(",")):
        path = table_files(args.data_dir, args.size_mib, columns,
                           kinds=("safetensors",))["safetensors"]
        size = os.path.getsize(path)
        cats: List[float] = []
        times: Dict[str, List[float]] = {
            "the block shuffle's reads alone": [],
            "the same, beside two busy processes": [],
            "block shuffle, the Loader's epoch": [], "full shuffle, the Loader's epoch": []}
        for _ in range(args.cold_limits):
            cats.append(size / cat_rate(path))
            for name in times:
                drop_cache(path)
                if name.endswith("alone"):
                    took = seconds(lambda: read_blocks_of_an_epoch(path))
                elif name.endswith("processes"):
                    with busy_processes(2):
                        took = seconds(lambda: read_blocks_of_an_epoch(path))
                else:
                    shuffle = "blocks" if name.startswith("block") else True
                    took = seconds(lambda: whole_epoch(path, batch, shuffle))
                times[name].append(took)
        print_over_cat(f"[{size // (columns * 4)}, {columns}] F32", size, cats, times)
    return 0


def read_blocks_of_an_epoch(path: str) -> None:
    """Read a block shuffle's blocks (epoch 0, the Loader's defaults) into the page
    cache as its reading threads do (`CachedBlocks`, over a reader of the file): in its
    reading order, with no gather beside them."""
    from fastst._core import Reader
    from fastst._data.order import epoch_blocks
    from fastst._data.rowblocks import CachedBlocks
    reader = Reader()
    reader.open_file(path)
    _, blocks, edges = epoch_blocks(reader.info(NAME).shape[0], 0, 0, 4096, 16)
    reading = CachedBlocks(lambda first, stop: reader.cache_rows(NAME, first, stop), edges)
    try:
        reading.want(edges.in_reading_order(blocks).tolist())
        reading.wait(len(blocks))
    finally:
        reading.stop()
        reader.close()


def whole_epoch(path: str, batch: int, shuffle: Any) -> None:
    with Loader(path, NAME, batch, shuffle=shuffle, seed=0, threads=2,
                drop_last=True) as loader:
        for _ in loader:
            pass


class busy_processes:
    """`count` processes that keep a CPU busy each, scheduled SCHED_IDLE (any other
    thread runs before them), from entry to exit."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: List[subprocess.Popen[bytes]] = []

    def __enter__(self) -> None:
        idle = ("import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
                "while True: pass")
        self.processes = [subprocess.Popen([sys.executable, "-c", idle])
                          for _ in range(self.count)]
        time.sleep(0.3)          # started, and busy

    def __exit__(self, *exc_info: object) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def epoch_starts(args: argparse.Namespace) -> int:
    """Hot epochs from their start: the permutation of the table's rows drawn by NumPy
    and by fastst, then the Loader's first batch and whole epoch (page cache hot, the
    maps filled by an epoch before), with the process's CPU time and context switches
    in the epoch, medians of `--epoch-starts` rounds."""
    from fastst._data.order import permutation
    batch = int(args.batch_sizes.split(",")[0])
    print(f"Produced by `python bench/loader.py --epoch-starts {args.epoch_starts} --columns "
          f"{args.columns}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
          f"average {os.getloadavg()[0]:.2f}: batches of {batch}, 2 threads, medians; "
          f"{free_page_reporting()}.\n")
    paths = {int(columns): table_files(args.data_dir, args.size_mib, int(columns),
                                       kinds=("safetensors",))["safetensors"]
             for columns in args.columns.split(",")}
    shapes = {columns: f"[{os.path.getsize(path) // (columns * 4)}, {columns}] F32"
              for columns, path in paths.items()}
    print("| table | permutation of the rows | time | × fastst |")
    print("| --- | --- | ---: | ---: |")
    for columns, path in paths.items():
        rows = os.path.getsize(path) // (columns * 4)
        numpy_took: List[float] = []
        fastst_took: List[float] = []
        for epoch in range(args.epoch_starts):
            numpy_took.append(
                seconds(lambda: np.random.default_rng([0, epoch]).permutation(rows)))
            fastst_took.append(seconds(lambda: permutation(rows, 0, epoch)))
        ours = statistics.median(fastst_took)
        took = {"NumPy `Generator.permutation`": numpy_took,
                "fastst (`deal_rows`, `shuffle_rows`)": fastst_took}
        for name, times in took.items():
            print(f"| {shapes[columns]} | {name} | {statistics.median(times) * 1e3:.1f} ms "
                  f"| {statistics.median(times) / ours:.2f}× |", flush=True)
    print("\n| table | shuffle | the Loader's first batch | its epoch | the epoch's CPU "
          "| its context switches |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for columns, path in paths.items():
        warm_cache(path)
        for name, shuffle in (("none", False), ("full", True), ("blocks", "blocks")):
            firsts, epochs, cpus, switches = [], [], [], []
            with Loader(path, NAME, batch, shuffle=shuffle, seed=0, threads=2,
                        drop_last=True) as loader:
                for _ in loader:
                    pass
                for _ in range(args.epoch_starts):
                    before = resource.getrusage(resource.RUSAGE_SELF)
                    start = time.perf_counter()
                    batches = iter(loader)
                    next(batches)
                    firsts.append(time.perf_counter() - start)
                    for _ in batches:
                        pass
                    epochs.append(time.perf_counter() - start)
                    after = resource.getrusage(resource.RUSAGE_SELF)
                    cpus.append(after.ru_utime + after.ru_stime
                                - before.ru_utime - before.ru_stime)
                    switches.append(after.ru_nvcsw + after.ru_nivcsw
                                    - before.ru_nvcsw - before.ru_nivcsw)
            print(f"| {shapes[columns]} | {name} | {statistics.median(firsts) * 1e3:.1f} ms "
                  f"| {statistics.median(epochs):.3f} s | {statistics.median(cpus):.3f} s "
                  f"| {statistics.median(switches):,.0f} |", flush=True)
    return 0


def seconds(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def print_rate(name: str, shape: str, batch: int, cache: str, rate: float,
               rates: Dict[str, float]) -> None:
    npy = rates["npy memmap in DataLoader (2 workers)"] if cache == "hot" else None
    versus = [f"{rate / npy:.2f}×" if npy else "",
              f"{rate / rates['in-process gather']:.2f}×",
              f"{rate / rates['memcpy of the same bytes']:.2f}×"]
    print(f"| {name} | {shape} | {batch} | {cache} | {fmt_rate(rate)} | "
          + " | ".join(versus) + " |", flush=True)


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
    parser.add_argument("--loaders", action="store_true",
                        help="compare fastst's Loader with other libraries' loaders")
    parser.add_argument("--columns", default="128,1024", help="--loaders: the tables' widths")
    parser.add_argument("--cold", action="store_true", help="--loaders: cold runs too")
    parser.add_argument("--grain-rows", type=int, default=100_000,
                        help="--loaders: rows timed for grain (slower)")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="--loaders: the loaders measured beside the in-process gather, "
                             "memcpy and the .npy memmap in DataLoader (which always run)")
    parser.add_argument("--cold-rows", type=int, default=0,
                        help="--loaders --cold: rows of each cold run (default --rows; "
                             "at most an epoch)")
    parser.add_argument("--streaming-python", default=STREAMING_VENV,
                        help="--loaders: the Python of MosaicML streaming's environment "
                             "(bench/peers/streaming-venv.sh)")
    parser.add_argument("--url", action="store_true",
                        help="the Loader over HTTP (--size-mib 256 is enough), shuffled "
                             "rows and blocks, against the link")
    parser.add_argument("--shards", default="",
                        help="the Loader over the [N, 128] table split into these numbers "
                             "of files, against one file (e.g. 16,256)")
    parser.add_argument("--cold-epochs", type=int, default=0,
                        help="whole cold epochs alone, this many rounds (with --columns)")
    parser.add_argument("--cold-limits", type=int, default=0,
                        help="what bounds a cold block shuffle, this many rounds: cat, its "
                             "reads alone and beside busy processes, the Loader's epochs")
    parser.add_argument("--epoch-starts", type=int, default=0,
                        help="hot epochs from their start, this many rounds: the "
                             "permutation, the first batch, the epoch, its CPU (with "
                             "--columns)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.loaders:
        return compare_loaders(args)
    if args.url:
        return loader_over_url(args)
    if args.shards:
        return loader_over_shards(args)
    if args.cold_epochs:
        return cold_epochs(args)
    if args.epoch_starts:
        return epoch_starts(args)
    if args.cold_limits:
        return cold_limits(args)
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
