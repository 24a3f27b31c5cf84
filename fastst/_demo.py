"""``fastst demo``: save, open, inspect and time a sample checkpoint."""
from __future__ import annotations

import os
import pickle
import tempfile
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, TextIO

import numpy as np

from ._version import __version__
from ._api import safe_open, save_file
from ._inspect import describe, format_table, human_size, render_inspect

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


def run_demo(size_mb: float, directory: Optional[str], out: TextIO, repeat: int = 3) -> int:
    """Save a checkpoint of about `size_mb` MiB to `directory` (kept) or to a temporary
    folder (removed), then report on it to `out`. Returns the exit status."""
    start = time.perf_counter()
    tensors = demo_checkpoint(size_mb)
    nbytes = sum(a.nbytes for a in tensors.values())
    out.write(f"fastst {__version__} demo: a {len(tensors)}-tensor transformer-shaped "
              f"checkpoint, {human_size(nbytes)} of F32, BF16 and F8_E4M3 "
              f"(NumPy + ml_dtypes)\n")
    if directory is not None:
        with tempfile.TemporaryDirectory(prefix=".fastst-demo-", dir=directory) as scratch:
            path = os.path.join(directory, DEMO_FILE)
            _show_steps(tensors, path, scratch, repeat, out)
            where = f"checkpoint kept at {path}"
    else:
        with tempfile.TemporaryDirectory(prefix="fastst-demo-") as scratch:
            _show_steps(tensors, os.path.join(scratch, DEMO_FILE), scratch, repeat, out)
            where = "temporary files removed"
    out.write(f"done in {time.perf_counter() - start:.1f} s; {where}\n")
    return 0


def _show_steps(tensors: Dict[str, np.ndarray], path: str, scratch: str, repeat: int,
                out: TextIO) -> None:
    """Save, then write each section to `out` as soon as it is ready."""
    save_file(tensors, path, metadata=demo_metadata(tensors))
    steps = [lambda: [f"saved with fastst.save_file -> {path}"],
             lambda: _zero_copy_lines(tensors, path, repeat),
             lambda: render_inspect(describe(path)),
             lambda: _timing_lines(tensors, path, scratch, repeat)]
    for step in steps:
        out.write("\n".join(step()) + "\n\n")
        out.flush()


def _zero_copy_lines(tensors: Dict[str, np.ndarray], path: str, repeat: int) -> List[str]:
    names = list(tensors)

    def open_and_get_all() -> None:
        with safe_open(path, framework="np") as f:
            for name in names:
                f.get_tensor(name)

    open_get = best_of(repeat, open_and_get_all)
    with safe_open(path, framework="np") as f:
        first = f.get_tensor("embed_tokens.weight")
        again = f.get_tensor("embed_tokens.weight")
        loaded = {name: f.get_tensor(name) for name in names}
        part = f.get_slice("embed_tokens.weight")[2:4, :3]
    lines = [
        "zero-copy open",
        f"  open + get_tensor() of all {len(names)} tensors: {seconds(open_get)} "
        f"({human_size(sum(a.nbytes for a in loaded.values()))} mapped, nothing copied)",
        f"  two get_tensor() calls share memory (np.shares_memory): "
        f"{np.shares_memory(first, again)}",
        f"  arrays are views of the file's map, not copies: "
        f"{first.base is not None and not first.flags.owndata}",
        f"  dtypes kept: {loaded['layers.0.mlp.up_proj.weight'].dtype} (BF16), "
        f"{loaded['lm_head.weight'].dtype} (F8_E4M3)",
        f"  every tensor round-trips byte for byte: "
        f"{all(_same_bytes(tensors[name], loaded[name]) for name in names)}",
    ]
    first[0, 0] += 1.0     # a private map: the view is writable, the file stays as it was
    with safe_open(path, framework="np") as f:
        unchanged = f.get_tensor("embed_tokens.weight")[0, 0] == tensors["embed_tokens.weight"][0, 0]
    lines += [
        f"  writing to a view leaves the file unchanged (private map): {bool(unchanged)}",
        f"  get_slice('embed_tokens.weight')[2:4, :3] -> shape {list(part.shape)}, "
        f"touches only the pages it reads",
    ]
    return lines


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
