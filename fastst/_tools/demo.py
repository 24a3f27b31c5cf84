"""``fastst demo``: a tour of what fastst does that the reference does not, on a
sample checkpoint saved, opened and timed; one line, with its figure, a step."""
from __future__ import annotations

import importlib
import math
import os
import pickle
import tempfile
import time
import tracemalloc
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, TextIO, Tuple

import numpy as np

from .._api import safe_open, save_file
from .._version import __version__
from .inspect import describe, format_table, human_size

DEMO_LAYERS = 4
DEMO_FILE = "demo.safetensors"


def demo_checkpoint(size_mb: float, seed: int = 0) -> Dict[str, np.ndarray]:
    """A small transformer-shaped checkpoint of about `size_mb` MiB.

    F32 embeddings, attention projections and norms; BF16 MLP weights; an output head
    quantized to F8_E4M3 with an F32 scale per row.
    """
    import ml_dtypes

    # Bytes per layer: 4 d*d F32 attention projections + 2 (4d x d) BF16 MLP weights
    # = 32 d^2; plus a (4d x d) F32 embedding and a (4d x d) F8 head = 20 d^2.
    per_d2 = 32 * DEMO_LAYERS + 20
    d = max(8, int(round((size_mb * 2**20 / per_d2) ** 0.5 / 8)) * 8)
    vocab, ffn = 4 * d, 4 * d
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= 0.02
        return out

    tensors: Dict[str, np.ndarray] = {"embed_tokens.weight": normal(vocab, d)}
    for i in range(DEMO_LAYERS):
        prefix = f"layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{prefix}.self_attn.{proj}.weight"] = normal(d, d)
        tensors[f"{prefix}.mlp.up_proj.weight"] = normal(ffn, d).astype(ml_dtypes.bfloat16)
        tensors[f"{prefix}.mlp.down_proj.weight"] = normal(d, ffn).astype(ml_dtypes.bfloat16)
        tensors[f"{prefix}.input_layernorm.weight"] = np.ones(d, dtype=np.float32)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = np.ones(d, dtype=np.float32)
    tensors["norm.weight"] = np.ones(d, dtype=np.float32)
    head = normal(vocab, d)
    scale = np.abs(head).max(axis=1) / 448.0       # 448: largest finite float8_e4m3fn
    scale[scale == 0] = 1.0
    tensors["lm_head.weight"] = (head / scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    tensors["lm_head.weight_scale"] = scale.astype(np.float32)
    return tensors


def demo_metadata(tensors: Dict[str, np.ndarray]) -> Dict[str, str]:
    d = tensors["norm.weight"].shape[0]
    return {"format": "np", "model_type": "fastst-demo", "hidden_size": str(d),
            "num_layers": str(DEMO_LAYERS), "vocab_size": str(tensors["lm_head.weight"].shape[0])}


def best_of(repeat: int, fn: Callable[[], Any]) -> float:
    """The fastest of `repeat` runs of `fn`, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def seconds(value: float) -> str:
    """A duration for a table cell: ``"850 us"``, ``"12.5 ms"``, ``"1.25 s"``."""
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def ratio(value: float, base: float) -> str:
    """`value` as a multiple of `base`: ``"3.0x"``; ``"-"`` when `base` is not positive."""
    return f"{value / base:.1f}x" if base > 0 else "-"


class Timing(NamedTuple):
    """One format's row of the timing table."""
    label: str
    save_s: float
    load_s: float
    read_s: float
    lost_dtypes: Sequence[str]       # dtypes the format did not give back, empty if none


TIMING_HEADERS = ["format", "save", "ratio", "load", "ratio", "load+read all", "ratio",
                  "bf16/fp8 dtypes kept"]


def timing_rows(timings: Sequence[Timing]) -> List[List[str]]:
    """The cells of the timing table; each ratio is relative to the first row."""
    base = timings[0]
    return [[t.label, seconds(t.save_s), ratio(t.save_s, base.save_s),
             seconds(t.load_s), ratio(t.load_s, base.load_s),
             seconds(t.read_s), ratio(t.read_s, base.read_s),
             "no (" + ", ".join(t.lost_dtypes) + ")" if t.lost_dtypes else "yes"]
            for t in timings]


def _read_every_byte(arrays: Dict[str, np.ndarray]) -> int:
    """Read every byte of every array (pages in lazy views); returns a checksum."""
    return sum(int(a.reshape(-1).view(np.uint8).max(initial=0)) for a in arrays.values())


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


class Tour(NamedTuple):
    """What each step of the tour works on."""
    tensors: Dict[str, np.ndarray]
    path: str          # the checkpoint, saved by save_file
    scratch: str       # a folder for the other files, removed afterwards
    repeat: int


class Step(NamedTuple):
    """One line of the tour: what a step showed, and whether it held."""
    label: str
    text: str
    ok: bool = True


def run_demo(size_mb: float, directory: Optional[str], out: TextIO, repeat: int = 3) -> int:
    """Save a checkpoint of about `size_mb` MiB to `directory` (kept) or to a temporary
    folder (removed), then tour what fastst does with it, a line a step, to `out`.
    Returns the exit status: 1 when a step did not hold."""
    start = time.perf_counter()
    tensors = demo_checkpoint(size_mb)
    nbytes = sum(a.nbytes for a in tensors.values())
    out.write(f"fastst {__version__} demo: a {len(tensors)}-tensor transformer-shaped "
              f"checkpoint, {human_size(nbytes)} of F32, BF16 and F8_E4M3 "
              f"(NumPy + ml_dtypes)\n")
    if directory is not None:
        with tempfile.TemporaryDirectory(prefix=".fastst-demo-", dir=directory) as scratch:
            path = os.path.join(directory, DEMO_FILE)
            held = _tour(Tour(tensors, path, scratch, repeat), out)
            where = f"checkpoint kept at {path}"
    else:
        with tempfile.TemporaryDirectory(prefix="fastst-demo-") as scratch:
            held = _tour(Tour(tensors, os.path.join(scratch, DEMO_FILE), scratch, repeat), out)
            where = "temporary files removed"
    out.write(f"done in {time.perf_counter() - start:.1f} s; {where}\n")
    return 0 if held else 1


def _tour(tour: Tour, out: TextIO) -> bool:
    """Save, then write each step's line to `out` as soon as it is ready; whether
    every step held."""
    save_file(tour.tensors, tour.path, metadata=demo_metadata(tour.tensors))
    out.write(f"saved with fastst.save_file -> {tour.path}\n\n"
              f"what fastst does that the reference (huggingface safetensors) does not:\n")
    failed = []
    for step in STEPS:
        shown = step(tour)
        out.write(f"  {shown.label + ':':<18}{shown.text}\n")
        out.flush()
        if not shown.ok:
            failed.append(shown.label)
    out.write("\n" + "\n".join(_timing_lines(tour.tensors, tour.path, tour.scratch,
                                             tour.repeat)) + "\n\n")
    if failed:
        out.write(f"did not hold: {', '.join(failed)}\n")
    return not failed


def _installed(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _zero_copy(tour: Tour) -> Step:
    def open_and_get_all() -> Dict[str, np.ndarray]:
        with safe_open(tour.path, framework="np") as f:
            return {name: f.get_tensor(name) for name in tour.tensors}

    took = best_of(tour.repeat, open_and_get_all)
    with safe_open(tour.path, framework="np") as f:
        loaded = {name: f.get_tensor(name) for name in tour.tensors}
        # a copy would be fresh memory at each call; views of the map share it
        copies = [name for name, array in loaded.items()
                  if array.nbytes and not np.shares_memory(array, f.get_tensor(name))]
    differ = [name for name in tour.tensors if not _same_bytes(tour.tensors[name], loaded[name])]
    text = (f"{len(loaded)} tensors opened in {seconds(took)}: "
            f"{human_size(sum(a.nbytes for a in loaded.values()))} mapped, ")
    text += f"{len(copies)} tensors copied" if copies else "nothing copied"
    text += f", {len(differ)} not as saved" if differ else \
        ", BF16 and F8_E4M3 kept, byte for byte"
    return Step("zero-copy open", text, not copies and not differ)


class _Interrupted(Exception):
    """What stops the demo's interrupted save."""


def _interrupted_save(tour: Tour) -> Step:
    """A save of new tensors over the checkpoint, stopped after a few: the old
    file must stay as it was, and no temporary file may be left."""
    from ..writer import save_file_from

    folder = os.path.dirname(tour.path)
    before, listing = _identity(tour.path), sorted(os.listdir(folder))
    names = list(tour.tensors)
    stop_at = min(3, len(names) - 1)

    def produced() -> Any:
        for count, name in enumerate(names):
            if count == stop_at:
                raise _Interrupted
            yield name, tour.tensors[name] * 0
    try:
        save_file_from({name: (_code(a), a.shape) for name, a in tour.tensors.items()},
                       produced(), tour.path)
    except _Interrupted:
        pass
    kept = _identity(tour.path) == before and sorted(os.listdir(folder)) == listing
    with safe_open(tour.path) as f:
        kept = kept and _same_bytes(f.get_tensor(names[0]), tour.tensors[names[0]])
    text = (f"a save over the file stopped after {stop_at} of {len(names)} tensors: "
            + ("the old file intact, no temporary file left" if kept else
               "the old file changed, or a temporary file left"))
    return Step("atomic save", text, kept)


def _identity(path: str) -> Tuple[int, int, int]:
    stat = os.stat(path)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _code(array: np.ndarray) -> str:
    from ..writer import spec_of_array
    return spec_of_array("a", array).dtype


def _sharded(tour: Tour) -> Step:
    folder = os.path.join(tour.scratch, "sharded")
    os.mkdir(folder)
    nbytes = sum(a.nbytes for a in tour.tensors.values())
    took = best_of(1, lambda: save_file(tour.tensors, folder, max_shard_size=nbytes // 4 + 1))
    shards = [name for name in os.listdir(folder) if name.endswith(".safetensors")]

    def open_and_get_all() -> Dict[str, np.ndarray]:
        with safe_open(folder) as checkpoint:
            return {name: checkpoint.get_tensor(name) for name in checkpoint.keys()}

    opened = best_of(tour.repeat, open_and_get_all)
    loaded = open_and_get_all()
    same = sorted(loaded) == sorted(tour.tensors) and all(
        _same_bytes(tour.tensors[name], array) for name, array in loaded.items())
    text = (f"{len(shards)} shards + index in {seconds(took)}, the index last (a killed save "
            f"leaves the old checkpoint); opened as one handle: {len(loaded)} tensors in "
            f"{seconds(opened)}"
            + ("" if same else ", NOT as saved"))
    return Step("sharded save", text, same)


def _checksums(tour: Tour) -> Step:
    if not _installed("xxhash"):
        return Step("checksums", "skipped: xxhash is not installed (the checksum extra)")
    from ..integrity import verify_file

    path = os.path.join(tour.scratch, "checked.safetensors")
    save_file(tour.tensors, path, checksum="xxh3_64")
    names = list(tour.tensors)
    victim = names[len(names) // 2]
    _flip_a_byte(path, victim)
    start = time.perf_counter()
    report = verify_file(path)
    took = time.perf_counter() - start
    found = [error["tensor"] for error in report["errors"]]
    text = (f"verify found the {len(found)} corrupt tensor of {report['tensors']} ("
            f"{', '.join(map(str, found))}); {human_size(report['bytes'])} hashed in "
            f"{seconds(took)}")
    return Step("checksums", text, found == [victim])


def _flip_a_byte(path: str, name: str) -> None:
    """Change the byte in the middle of tensor `name` of file `path`."""
    with safe_open(path) as f:
        begin, end = f.info(name).data_offsets
        position = f.data_start + (begin + end) // 2
    with open(path, "r+b") as fh:
        fh.seek(position)
        byte = fh.read(1)
        fh.seek(position)
        fh.write(bytes([byte[0] ^ 0xFF]))


def _convert_npz(tour: Tour) -> Step:
    from ..convert import numpy_to_safetensors

    arrays = {name: a for name, a in tour.tensors.items() if a.dtype == np.float32}
    npz = os.path.join(tour.scratch, "arrays.npz")
    np.savez(npz, **arrays)
    report = numpy_to_safetensors(npz, os.path.join(tour.scratch, "arrays.safetensors"))
    held = report.verified and report.tensors == len(arrays)
    text = (f"{report.tensors} arrays ({human_size(report.bytes)}) to safetensors in "
            f"{seconds(report.seconds)}, without pickle, each read back and compared")
    return Step("convert a .npz", text, held)


STORE_PROTOCOL = "fastst-demo"


def _object_store(tour: Tour) -> Step:
    if not _installed("fsspec"):
        return Step("object store", "skipped: fsspec is not installed (the remote extra)")
    store = _counting_memory_store()
    url = f"{STORE_PROTOCOL}://demo/{DEMO_FILE}"
    name = "embed_tokens.weight"
    try:
        save_file(tour.tensors, url)
        store.reset()
        with safe_open(url) as f:
            got = f.get_tensor(name)
        read, requests = store.bytes_read, store.requests
    finally:
        if store.exists("/demo"):
            store.rm("/demo", recursive=True)
    same = _same_bytes(got, tour.tensors[name])
    text = (f"saved to fsspec's memory store; one {human_size(got.nbytes)} tensor of the "
            f"{human_size(sum(a.nbytes for a in tour.tensors.values()))} file read with "
            f"{read / got.nbytes:.2f}x its bytes, {requests} request{'s' * (requests != 1)}"
            + ("" if same else ", NOT as saved"))
    return Step("object store", text, same)


def _counting_memory_store() -> Any:
    """fsspec's in-memory file system under its own protocol, counting the bytes
    read from it and the requests."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class CountingMemoryFileSystem(MemoryFileSystem):  # type: ignore[misc]
        protocol = (STORE_PROTOCOL,)
        store: Dict[str, Any] = {}
        pseudo_dirs = [""]
        bytes_read = requests = 0

        @classmethod
        def _strip_protocol(cls, path: Any) -> Any:
            if isinstance(path, str) and path.startswith(STORE_PROTOCOL + "://"):
                path = path[len(STORE_PROTOCOL) + 3:]
            return super()._strip_protocol(path)

        def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> Any:
            data = super().cat_file(path, start, end, **kwargs)
            self.bytes_read += len(data)
            self.requests += 1
            return data

        def reset(self) -> None:
            self.bytes_read = self.requests = 0

    fsspec.register_implementation(STORE_PROTOCOL, CountingMemoryFileSystem, clobber=True)
    return fsspec.filesystem(STORE_PROTOCOL)


STREAM_PIECES = 64
STREAM_MAX_BYTES = 1 << 30
STREAM_WIDTH = 1024        # float32 columns: rows of 4 KiB


def _streaming_writer(tour: Tour) -> Step:
    """A file four times the checkpoint's size (at most 1 GiB), written a piece at
    a time: the memory held is a piece's, whatever the file's size."""
    from ..writer import StreamWriter

    nbytes = sum(a.nbytes for a in tour.tensors.values())
    rows = min(4 * nbytes, STREAM_MAX_BYTES) / (4 * STREAM_WIDTH * STREAM_PIECES)
    piece_rows = 2 ** max(0, round(math.log2(rows)))      # 64 MiB -> 256 MiB in 4 MiB pieces
    shape = (piece_rows * STREAM_PIECES, STREAM_WIDTH)
    path = os.path.join(tour.scratch, "streamed.safetensors")
    start = time.perf_counter()
    with _traced_peak() as peak:
        with StreamWriter(path, {"rows": ("F32", shape)}) as writer:
            for piece in range(STREAM_PIECES):
                writer.write("rows", np.full((piece_rows, STREAM_WIDTH), piece, np.float32),
                             start_row=piece * piece_rows)
    took = time.perf_counter() - start
    with safe_open(path) as f:
        rows = f.get_slice("rows")[::piece_rows, 0]
        held = rows.tolist() == list(range(STREAM_PIECES))
    os.remove(path)
    total = shape[0] * shape[1] * 4
    text = (f"{human_size(total)} written in {STREAM_PIECES} pieces of "
            f"{human_size(total // STREAM_PIECES)} in {seconds(took)}; peak memory traced "
            f"{human_size(peak[0])}")
    return Step("streaming writer", text, held)


class _traced_peak:
    """The peak of the memory Python and NumPy allocate in the block (tracemalloc),
    in `peak[0]` once the block ends."""

    def __enter__(self) -> List[int]:
        self.peak = [0]
        self.started = not tracemalloc.is_tracing()
        if self.started:
            tracemalloc.start()
        self.base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        return self.peak

    def __exit__(self, *exc_info: object) -> None:
        self.peak[0] = max(0, tracemalloc.get_traced_memory()[1] - self.base)
        if self.started:
            tracemalloc.stop()


GATHER_ROWS = 4096


def _row_gather(tour: Tour) -> Step:
    from ..data import Rows

    name = "embed_tokens.weight"
    table = tour.tensors[name]
    rows = np.random.default_rng(1).integers(0, len(table), GATHER_ROWS)
    with Rows(tour.path, name) as data:
        took = best_of(tour.repeat, lambda: data.gather(rows))
        held = np.array_equal(data.gather(rows), table[rows])
    text = (f"{GATHER_ROWS} random rows of {name} in one call: {seconds(took)}, "
            f"{GATHER_ROWS / took:,.0f} rows/s")
    return Step("row gather", text, held)


def _inspect(tour: Tour) -> Step:
    info = describe(tour.path)
    text = (f"`fastst inspect {DEMO_FILE}`: {info['tensor_count']} tensors and "
            f"{len(info['metadata'] or {})} metadata entries, from the "
            f"{human_size(info['header_size'])} header alone")
    return Step("inspect", text, info["tensor_count"] == len(tour.tensors))


STEPS: List[Callable[[Tour], Step]] = [
    _zero_copy, _interrupted_save, _sharded, _checksums, _convert_npz, _object_store,
    _streaming_writer, _row_gather, _inspect]


def _timing_lines(tensors: Dict[str, np.ndarray], path: str, scratch: str,
                  repeat: int) -> List[str]:
    """fastst against pickle and np.savez: save, load, and load then read every byte."""
    pickle_path = os.path.join(scratch, "demo.pkl")
    npz_path = os.path.join(scratch, "demo.npz")
    metadata = demo_metadata(tensors)

    def pickle_dump() -> None:
        with open(pickle_path, "wb") as fh:
            pickle.dump(tensors, fh, protocol=pickle.HIGHEST_PROTOCOL)

    def pickle_load() -> Dict[str, np.ndarray]:
        with open(pickle_path, "rb") as fh:
            loaded: Dict[str, np.ndarray] = pickle.load(fh)
        return loaded

    def npz_load() -> Dict[str, np.ndarray]:
        with np.load(npz_path) as archive:
            return {name: archive[name] for name in archive.files}

    def fastst_load() -> Dict[str, np.ndarray]:
        with safe_open(path, framework="np") as f:
            return f.get_tensors()

    methods = [
        ("fastst", lambda: save_file(tensors, path, metadata=metadata), fastst_load),
        ("pickle", pickle_dump, pickle_load),
        ("np.savez", lambda: np.savez(npz_path, **tensors), npz_load),
    ]
    timings = []
    for label, save, load in methods:
        save_s = best_of(repeat, save)
        load_s = best_of(repeat, load)
        read_s = best_of(repeat, lambda: _read_every_byte(load()))
        back = load()
        lost = sorted({back[n].dtype.str.lstrip("<>|=") for n in tensors
                       if back[n].dtype != tensors[n].dtype})
        timings.append(Timing(label, save_s, load_s, read_s, lost))
    right = [False, True, True, True, True, True, True, False]
    return ([f"timings, best of {repeat} (ratios: time / fastst's time, higher is slower)"]
            + format_table(TIMING_HEADERS, timing_rows(timings), right)
            + ["  load: a dict of every array, ready to use (fastst: zero-copy views; pickle and",
               "        np.load: every array read into fresh memory)",
               "  load+read all: the same, then every byte of every array read once"])
