"""The ``fastst`` command line: ``fastst inspect FILE`` and ``fastst demo``."""
from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

import numpy as np

from . import __version__
from ._api import safe_open, save_file
from ._core import SafetensorError

PROG = "fastst"


class CLIError(Exception):
    """A problem to report as one line on stderr, with exit status 1."""


# ---------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------

def human_size(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; sizes under 1 KiB stay in bytes."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def _shown(text: str) -> str:
    """Text as one printable table cell: names with control characters are quoted."""
    return text if text.isprintable() else repr(text)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool]) -> List[str]:
    """Align `rows` under `headers`: columns flagged in `right` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows]


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------

def describe(path: str) -> Dict[str, Any]:
    """Everything `fastst inspect` reports about the file at `path`, as plain data.

    Raises SafetensorError for a malformed file and OSError when it cannot be read.
    """
    with safe_open(path, framework="np") as reader:
        tensors = []
        for name in reader.offset_keys():
            view = reader.get_slice(name)
            _, _, (begin, end), _ = reader.info(name)
            tensors.append({
                "name": name,
                "dtype": view.get_dtype(),
                "shape": view.get_shape(),
                "nbytes": end - begin,
                "data_offsets": [begin, end],
            })
        data_start = reader.data_start
        metadata = reader.metadata()
        file_size = os.stat(path).st_size
    return {
        "file": os.fsdecode(path),
        "tensors": tensors,
        "tensor_count": len(tensors),
        "total_bytes": sum(t["nbytes"] for t in tensors),
        "header_size": data_start - 8,
        "data_start": data_start,
        "file_size": file_size,
        "metadata": metadata,
    }


def render_inspect(info: Dict[str, Any]) -> List[str]:
    """The human-readable report of `describe()`, one string per line."""
    lines = [f"file: {_shown(info['file'])}", ""]
    headers = ["name", "dtype", "shape", "bytes", "size", "begin", "end"]
    right = [False, False, False, True, True, True, True]
    rows = [[_shown(t["name"]), t["dtype"], _shape_text(t["shape"]), str(t["nbytes"]),
             human_size(t["nbytes"]), str(t["data_offsets"][0]), str(t["data_offsets"][1])]
            for t in info["tensors"]]
    if rows:
        lines += format_table(headers, rows, right)
    else:
        lines.append("(no tensors)")
    total = info["total_bytes"]
    lines += [
        "",
        f"tensors      {info['tensor_count']}",
        f"total bytes  {total} ({human_size(total)})",
        f"header       {info['header_size']} bytes (tensor data starts at byte "
        f"{info['data_start']})",
        f"file size    {info['file_size']} ({human_size(info['file_size'])})",
    ]
    metadata = info["metadata"]
    if metadata:
        lines += ["", f"metadata     {len(metadata)} {'entry' if len(metadata) == 1 else 'entries'}"]
        width = max(len(_shown(key)) for key in metadata)
        for key, value in metadata.items():
            lines.append(f"  {_shown(key).ljust(width)}  {_shown(value)}".rstrip())
    elif metadata is not None:
        lines += ["", "metadata     0 entries"]
    return lines


def to_json(info: Dict[str, Any]) -> str:
    """`describe()` as JSON: indented, one line per tensor."""
    lines = ["{"]
    for key, value in info.items():
        if key == "tensors" and value:
            lines.append('  "tensors": [')
            lines += [f"    {json.dumps(t)}," for t in value]
            lines[-1] = lines[-1][:-1]
            lines.append("  ],")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")
    lines[-1] = lines[-1][:-1]
    lines.append("}")
    return "\n".join(lines)


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    info = describe(args.file)
    if args.json:
        out.write(to_json(info) + "\n")
    else:
        out.write("\n".join(render_inspect(info)) + "\n")
    return 0


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------

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
    d = int(round((size_mb * 2**20 / per_d2) ** 0.5 / 8)) * 8
    d = max(d, 8)
    vocab, ffn = 4 * d, 4 * d
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 0.02) -> np.ndarray:
        out = rng.standard_normal(shape, dtype=np.float32)
        out *= scale
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


def _touch_all(arrays: Dict[str, np.ndarray]) -> int:
    """Read every byte of every array (pages in lazy views); returns a checksum."""
    total = 0
    for array in arrays.values():
        total += int(array.reshape(-1).view(np.uint8).max(initial=0))
    return total


def _seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.0f} us"
    if value < 1.0:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.1f}x" if base > 0 else "-"


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)))


def run_demo(size_mb: float, directory: Optional[str], out: TextIO, repeat: int = 3) -> int:
    def say(text: str = "") -> None:
        out.write(text + "\n")

    if directory is not None and not os.path.isdir(directory):
        raise CLIError(f"--dir {directory}: not a directory")
    start_all = time.perf_counter()
    tensors = demo_checkpoint(size_mb)
    metadata = demo_metadata(tensors)
    nbytes = sum(a.nbytes for a in tensors.values())
    say(f"fastst {__version__} demo: a {len(tensors)}-tensor transformer-shaped checkpoint, "
        f"{human_size(nbytes)} of F32, BF16 and F8_E4M3 (NumPy + ml_dtypes)")

    if directory is not None:
        with tempfile.TemporaryDirectory(prefix=".fastst-demo-", dir=directory) as scratch:
            return _demo_in(tensors, metadata, os.path.join(directory, DEMO_FILE),
                            scratch, say, repeat, start_all, keep=True)
    with tempfile.TemporaryDirectory(prefix="fastst-demo-") as scratch:
        return _demo_in(tensors, metadata, os.path.join(scratch, DEMO_FILE),
                        scratch, say, repeat, start_all, keep=False)


def _demo_in(tensors: Dict[str, np.ndarray], metadata: Dict[str, str], path: str,
             scratch: str, say: Callable[..., None], repeat: int, start_all: float,
             keep: bool) -> int:
    names = list(tensors)

    # 1. Save, then open zero-copy.
    save_file(tensors, path, metadata=metadata)
    say(f"saved with fastst.save_file -> {path}")
    say()

    def open_and_get_all() -> None:
        with safe_open(path, framework="np") as f:
            for name in names:
                f.get_tensor(name)

    open_get = best_of(repeat, open_and_get_all)
    with safe_open(path, framework="np") as f:
        first = f.get_tensor("embed_tokens.weight")
        again = f.get_tensor("embed_tokens.weight")
        loaded = {name: f.get_tensor(name) for name in names}
    identical = all(_same_bytes(tensors[name], loaded[name]) for name in names)
    say("zero-copy open")
    say(f"  open + get_tensor() of all {len(names)} tensors: {_seconds(open_get)} "
        f"({human_size(sum(a.nbytes for a in loaded.values()))} mapped, nothing copied)")
    say(f"  two get_tensor() calls share memory (np.shares_memory): "
        f"{np.shares_memory(first, again)}")
    say(f"  arrays are views of the file's map, not copies: "
        f"{first.base is not None and not first.flags.owndata}")
    say(f"  dtypes kept: {loaded['layers.0.mlp.up_proj.weight'].dtype} (BF16), "
        f"{loaded['lm_head.weight'].dtype} (F8_E4M3)")
    say(f"  every tensor round-trips byte for byte: {identical}")
    first[0, 0] += 1.0     # a private map: the view is writable, the file stays as it was
    with safe_open(path, framework="np") as f:
        unchanged = bool(f.get_tensor("embed_tokens.weight")[0, 0] == tensors["embed_tokens.weight"][0, 0])
    say(f"  writing to a view leaves the file unchanged (private map): {unchanged}")
    with safe_open(path, framework="np") as f:
        part = f.get_slice("embed_tokens.weight")[2:4, :3]
    say(f"  get_slice('embed_tokens.weight')[2:4, :3] -> shape {list(part.shape)}, "
        f"touches only the pages it reads")
    del first, again, loaded, part
    say()

    # 2. What is in the file.
    for line in render_inspect(describe(path)):
        say(line)
    say()

    # 3. Timings against pickle and np.savez.
    pickle_path = os.path.join(scratch, "demo.pkl")
    npz_path = os.path.join(scratch, "demo.npz")

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

    as_kwargs: Dict[str, Any] = dict(tensors)
    methods = [
        ("fastst", lambda: save_file(tensors, path, metadata=metadata), fastst_load),
        ("pickle", pickle_dump, pickle_load),
        ("np.savez", lambda: np.savez(npz_path, **as_kwargs), npz_load),
    ]
    results = []
    for label, save, load in methods:
        save_s = best_of(repeat, save)
        load_s = best_of(repeat, load)
        read_s = best_of(repeat, lambda: _touch_all(load()))
        back = load()
        kept = all(back[n].dtype == tensors[n].dtype for n in names)
        bad = sorted({back[n].dtype.str.lstrip("<>|=") for n in names
                      if back[n].dtype != tensors[n].dtype})
        del back
        results.append((label, save_s, load_s, read_s, kept, bad))

    base_save, base_load, base_read = results[0][1:4]
    rows = []
    for label, save_s, load_s, read_s, kept, bad in results:
        rows.append([label, _seconds(save_s), _ratio(save_s, base_save), _seconds(load_s),
                     _ratio(load_s, base_load), _seconds(read_s), _ratio(read_s, base_read),
                     "yes" if kept else "no (" + ", ".join(bad) + ")"])
    say(f"timings, best of {repeat} (ratios: time / fastst's time, higher is slower)")
    headers = ["format", "save", "ratio", "load", "ratio", "load+read all", "ratio",
               "bf16/fp8 dtypes kept"]
    for line in format_table(headers, rows, [False, True, True, True, True, True, True, False]):
        say(line)
    say("  load: a dict of every array, ready to use (fastst: zero-copy views; pickle and")
    say("        np.load: every array read into fresh memory)")
    say("  load+read all: the same, then every byte of every array read once")
    say()
    where = (f"checkpoint kept at {path}" if keep
             else "temporary files removed")
    say(f"done in {time.perf_counter() - start_all:.1f} s; {where}")
    return 0


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def _positive_size(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value <= 16384):
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 16384, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fast, strict, zero-copy safetensors for NumPy.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect", help="list the tensors, offsets and metadata of a .safetensors file",
        description="List every tensor of a safetensors file in buffer order, with its "
                    "dtype, shape, size and data offsets, then totals and metadata.")
    inspect.add_argument("file", metavar="FILE", help="a .safetensors file")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")

    demo = commands.add_parser(
        "demo", help="save, open and time a sample checkpoint against pickle and np.savez",
        description="Build a sample transformer-shaped checkpoint in NumPy, save it with "
                    "fastst, open it zero-copy, show what is in it and time fastst "
                    "against pickle and np.savez.")
    demo.add_argument("--size-mb", type=_positive_size, default=64.0, metavar="N",
                      help="approximate checkpoint size in MiB (default: 64)")
    demo.add_argument("--dir", metavar="DIR", default=None,
                      help="write the checkpoint to DIR/demo.safetensors and keep it "
                           "(default: a temporary folder, removed afterwards)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``fastst`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:     # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    out = sys.stdout
    try:
        if args.command == "inspect":
            return _cmd_inspect(args, out)
        return run_demo(args.size_mb, args.dir, out)
    except (SafetensorError, CLIError) as error:
        return _fail(str(error))
    except OSError as error:
        if isinstance(error, BrokenPipeError):
            # The reader of our output went away (`fastst inspect f | head`).
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 1
        if error.filename is not None and error.strerror:
            return _fail(f"{os.fsdecode(error.filename)}: {error.strerror}")
        return _fail(str(error))


def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
