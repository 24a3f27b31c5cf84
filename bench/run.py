#!/usr/bin/env python
"""Side-by-side benchmarks of fastst against huggingface safetensors, NumPy, torch,
pickle and the raw I/O limit. See bench/README.md.

    python bench/run.py                      # full run (about 10-15 minutes)
    python bench/run.py --quick              # smoke run, small sizes, one repeat
    python bench/run.py --markdown out.md    # also write the tables as markdown
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _git_description(folder: str) -> Optional[str]:
    """'git <commit>[ + uncommitted changes]' for the fastst package under `folder`."""
    try:
        commit = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "--", "fastst"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode:
        return None
    return f"git {commit.stdout.strip()}" + (" + uncommitted changes" if dirty.stdout.strip()
                                            else "")


def _choose_fastst(argv: Sequence[str]) -> Optional[str]:
    """Honour --fastst DIR and --freeze before anything imports fastst: make the chosen
    fastst importable here, in the measurement children and in the import timings
    (through PYTHONPATH). Returns a description of where it came from, or None."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--fastst")
    early.add_argument("--freeze", action="store_true")
    known, _ = early.parse_known_args(argv)
    folder = os.path.abspath(known.fastst) if known.fastst else None
    if folder is None and not known.freeze:
        return None
    if folder:
        sys.path.insert(0, folder)
    described = None
    if known.freeze:
        import importlib.util
        import tempfile
        spec = importlib.util.find_spec("fastst")
        if spec is None or not spec.origin:
            raise SystemExit("--freeze: fastst is not importable")
        package = os.path.dirname(spec.origin)
        origin = os.path.dirname(package)
        frozen = tempfile.mkdtemp(prefix="fastst-bench-frozen-")
        shutil.copytree(package, os.path.join(frozen, "fastst"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.c", "*.pyx", "*.pxi"))
        FROZEN.append(frozen)
        git = _git_description(origin)
        described = "frozen copy of the checkout" + (f", {git}" if git else "")
        folder = frozen
        sys.path.insert(0, folder)
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = folder + (os.pathsep + saved if saved else "")
    return described


FROZEN: List[str] = []     # temporary copies made by --freeze, removed at the end
FASTST_ORIGIN = _choose_fastst(sys.argv[1:]) if __name__ == "__main__" else None

import inputs  # noqa: E402
import peers  # noqa: E402
from peers import Peer  # noqa: E402

# A fork server imports peers (numpy, fastst, safetensors, torch) once; each
# measurement child is then a cheap fork of it, with its own memory high-water mark.
CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["peers"])


def start_fork_server() -> None:
    """Start the fork server with this folder importable: it does not inherit our
    sys.path, only the environment, so PYTHONPATH carries the folder for its start."""
    from multiprocessing import forkserver
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = HERE + (os.pathsep + saved if saved else "")
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved

# ---------------------------------------------------------------------------
# Running one measurement in a child
# ---------------------------------------------------------------------------


SETTINGS: Dict[str, Any] = {}   # passed to every child: {"torch_threads": n}


def in_child(func: str, *args: Any, timeout: float = 600) -> Dict[str, Any]:
    """Run peers.<func>(*args) in a fresh child forked from the preloaded server."""
    start_fork_server()
    receive, send = CTX.Pipe(duplex=False)
    process = CTX.Process(target=peers.child_main, args=(send, func, args, SETTINGS))
    process.start()
    send.close()
    result: Optional[Dict[str, Any]] = None
    try:
        if receive.poll(timeout):
            result = receive.recv()
        else:
            result = {"error": f"timed out after {timeout:.0f} s"}
    except EOFError:
        pass
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        result = {"error": f"child died (exit code {process.exitcode})"}
    return result


def progress(text: str) -> None:
    print(text, end="", file=sys.stderr, flush=True)


SLOW_S = 5.0      # a measurement slower than this on every run so far ...
SLOW_RUNS = 3     # ... stops after this many runs


def interleaved(jobs: Sequence[Tuple[str, str, tuple]], repeats: int,
                timeout: float) -> Dict[str, List[Dict[str, Any]]]:
    """jobs: (row key, peers function, args). Each round runs every job once, the
    order rotated by one per round, so slow drifts of a noisy machine spread evenly.
    A job that failed, or took over SLOW_S seconds every time, stops early."""
    results: Dict[str, List[Dict[str, Any]]] = {key: [] for key, _, _ in jobs}
    for round_ in range(repeats):
        shift = round_ % len(jobs) if jobs else 0
        for key, func, args in list(jobs[shift:]) + list(jobs[:shift]):
            done = results[key]
            if any("error" in r for r in done) or (
                    len(done) >= SLOW_RUNS and all(r.get("time", 0) > SLOW_S for r in done)):
                continue
            progress(".")
            done.append(in_child(func, *args, timeout=timeout))
    progress("\n")
    return results


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def fmt_ratio(ratio: Optional[float]) -> str:
    if ratio is None:
        return "—"
    if ratio >= 100:
        return f"{ratio:.0f}×"
    if ratio >= 10:
        return f"{ratio:.1f}×"
    if ratio >= 0.1:
        return f"{ratio:.2f}×"
    return f"{ratio:.2g}×"


def fmt_bytes(count: Optional[float]) -> str:
    if count is None:
        return "—"
    mib = count / 2**20
    if abs(mib) < 1:
        return f"{count / 1024:.0f} KiB"
    if abs(mib) < 10:
        return f"{mib:.1f} MiB"
    return f"{mib:.0f} MiB"


class Row:
    def __init__(self, peer: Peer, time_s: Optional[float] = None, peak: Optional[float] = None,
                 private: Optional[float] = None, note: str = "", error: str = "",
                 runs: int = 0) -> None:
        self.peer, self.time, self.peak, self.private = peer, time_s, peak, private
        self.note, self.error, self.runs = note, error, runs
        self.extra: Dict[str, Any] = {}   # the first good result's other fields


class Table:
    def __init__(self, ident: str, title: str, what: str, time_header: str = "median",
                 memory: bool = True) -> None:
        self.ident, self.title, self.what = ident, title, what
        self.time_header, self.memory = time_header, memory
        self.rows: List[Row] = []
        self.notes: List[str] = []
        self.repeats = 0     # runs each row should have had (0: not tracked)

    def baseline(self, role: str) -> Optional[float]:
        for row in self.rows:
            if row.peer.role == role and row.time:
                return row.time
        return None

    def cells(self) -> Tuple[List[str], List[List[str]]]:
        base, raw = self.baseline("fastst"), self.baseline("raw")
        header = ["implementation", self.time_header, "× fastst"]
        if raw is not None:
            header.append("× raw")
        if self.memory:
            header += ["peak RSS Δ", "private Δ"]
        has_notes = any(row.note or row.error for row in self.rows)
        if has_notes:
            header.append("notes")
        lines = []
        for row in self.rows:
            ok = row.time is not None and not row.error
            cells = [row.peer.label, fmt_time(row.time if ok else None),
                     fmt_ratio(row.time / base if ok and base else None)]
            if raw is not None:
                cells.append(fmt_ratio(row.time / raw if ok else None))
            if self.memory:
                cells += [fmt_bytes(row.peak if ok else None),
                          fmt_bytes(row.private if ok else None)]
            if has_notes:
                cells.append("; ".join(x for x in (row.error, row.note) if x))
            lines.append(cells)
        return header, lines

    def text(self) -> str:
        header, lines = self.cells()
        widths = [max(len(r[i]) for r in [header] + lines) for i in range(len(header))]

        notes = header[-1] == "notes"

        def render(cells: List[str]) -> str:
            fixed = cells[:-1] if notes else cells
            parts = [fixed[0].ljust(widths[0])]
            parts += [c.rjust(w) for c, w in zip(fixed[1:], widths[1:])]
            if notes:
                parts.append(cells[-1])
            return "  ".join(parts).rstrip()
        out = [f"{self.ident}. {self.title}", f"   {self.what}", render(header),
               "  ".join("-" * w for w in widths)]
        out += [render(cells) for cells in lines]
        out += [f"   * {note}" for note in self.notes]
        return "\n".join(out)

    def markdown(self) -> str:
        header, lines = self.cells()
        align = ["---"] + ["---:"] * (len(header) - 1)
        if header[-1] == "notes":
            align[-1] = "---"
        out = [f"### {self.ident}. {self.title}", "", self.what, "",
               "| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
        for cells in lines:
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        if self.notes:
            out.append("")
            out += [f"- {note}" for note in self.notes]
        return "\n".join(out)


def summarise(table: Table, peer: Peer, results: List[Dict[str, Any]]) -> None:
    errors = [r["error"] for r in results if "error" in r]
    good = [r for r in results if "error" not in r]
    row = Row(peer, runs=len(good))
    if errors:
        row.error = errors[0]
    if good:
        row.time = statistics.median(r["time"] for r in good)
        row.extra = good[0]
        peaks = [r["peak"] for r in good if r.get("peak") is not None]
        privates = [r["private"] for r in good if r.get("private") is not None]
        row.peak = statistics.median(peaks) if peaks else None
        row.private = statistics.median(privates) if privates else None
        notes = sorted({r["note"] for r in good if r.get("note")})
        if table.repeats and 0 < len(good) < table.repeats:
            notes.append(runs(len(good)))
        row.note = "; ".join(notes)
    table.rows.append(row)


def skipped_row(table: Table, peer: Peer, disabled: Tuple[str, ...]) -> None:
    reasons = [f"{need} disabled" if need in disabled
               else f"{need} not installed" if need in ("safetensors", "torch")
               else f"this fastst has no {need.split(' ', 1)[1]}"
               for need in peer.needs if need in disabled or not peers.AVAILABLE[need]]
    table.rows.append(Row(peer, note="skipped: " + ", ".join(reasons)))


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = args.data_dir
        self.out_dir = os.path.join(self.root, "out")
        self.disabled = tuple(args.disable)
        self.tables: List[Table] = []

    def emit(self, table: Table) -> None:
        self.tables.append(table)
        print(table.text() + "\n", flush=True)

    def usable(self, group: List[Peer]) -> List[Peer]:
        """The peers that can run here (fill() gives the others a 'skipped' row)."""
        return [peer for peer in group if peers.available(peer, self.disabled)]

    def fill(self, table: Table, group: List[Peer], results: Dict[str, List[Dict[str, Any]]]):
        for peer in group:
            if peer.key in results:
                summarise(table, peer, results[peer.key])
            else:
                skipped_row(table, peer, self.disabled)

    # (1) open + get every tensor of a big file --------------------------------
    def w1_read(self) -> None:
        a = self.args
        data = inputs.big(self.root, a.size_mib)
        warm = inputs.big(self.root, a.size_mib, warm=True)
        inputs.warm_page_cache(data, warm)
        size = f"{a.size_mib} MiB in 64 F32 tensors"
        lazy = Table("1a", f"Open + get every tensor ({size}), each library's default",
                     f"Median of {runs(a.repeats)}, each in a fresh process after a warm-up "
                     "call on a small file of the same format. Page cache hot. Lazy peers "
                     "hand out views of a memory map (nothing read yet); the others copy.")
        private = Table("1b", f"Open + get every tensor into private memory ({size})",
                        "Every peer ends holding its own copy of all the data (lazy peers: "
                        f"views + .copy()/.clone()). Median of {runs(a.repeats)} as in 1a.")
        self.measure_reads(f"[1] read {a.size_mib} MiB",
                           ((lazy, peers.READ_LAZY, "read_lazy"),
                            (private, peers.READ_PRIVATE, "read_private")), data, warm)
        private.notes.append(".npy folder: one np.save file per tensor; .npz: np.savez "
                             "(uncompressed), read member by member.")
        self.emit(lazy)
        self.emit(private)

    def measure_reads(self, label: str, groups: Any, data: Any, warm: Any) -> None:
        """Time every usable peer of each (table, peers, tag) group, all groups'
        measurements interleaved in one run, and fill the tables."""
        a = self.args
        jobs = [(f"{tag}/{peer.key}", "measure_read", (tag, peer.key, data, warm))
                for _, group, tag in groups for peer in self.usable(group)]
        progress(f"{label}: {len(jobs)} peers x {a.repeats} ")
        results = interleaved(jobs, a.repeats, a.timeout)
        for table, group, tag in groups:
            table.repeats = a.repeats
            self.fill(table, group, {k.split("/", 1)[1]: v for k, v in results.items()
                                     if k.startswith(tag + "/")})

    # (2) save_file of the big dict -------------------------------------------
    def w2_save(self) -> None:
        a = self.args
        rows = a.size_mib * 1024 * 1024 // (64 * 4096)
        table = Table("2", f"save_file of {a.size_mib} MiB (64 F32 tensors)",
                      f"Median of {runs(a.repeats)} in one process, writers interleaved, "
                      "os.sync() before every run (untimed). The file lands in the page "
                      "cache; writeback is not timed.", memory=False)
        usable = self.usable(peers.SAVE_FILE)
        os.makedirs(self.out_dir, exist_ok=True)
        progress(f"[2] save {a.size_mib} MiB: {len(usable)} writers x {a.repeats} ... ")
        got = in_child("measure_save_time", [p.key for p in usable], 64, rows, a.repeats,
                       self.out_dir, timeout=max(600, 60 * a.repeats * len(usable)))
        progress("done\n")
        results: Dict[str, List[Dict[str, Any]]] = {}
        for peer in usable:
            if "error" in got:
                results[peer.key] = [{"error": got["error"]}]
            elif peer.key in got["errors"]:
                results[peer.key] = [{"error": got["errors"][peer.key]}]
            else:
                results[peer.key] = [{"time": t} for t in got["times"][peer.key]]
        self.fill(table, peers.SAVE_FILE, results)
        table.notes.append(".npy folder: one np.save file per tensor. The raw limit writes "
                           "only the tensor bytes (no header).")
        self.emit(table)

    # (3) many tiny tensors ------------------------------------------------------
    def w3_tiny(self) -> None:
        a = self.args
        data = inputs.tiny(self.root, a.tiny_count)
        warm = inputs.tiny(self.root, a.tiny_count, warm=True)
        inputs.warm_page_cache(data, warm)
        size = os.path.getsize(data["st"])
        what = (f"{a.tiny_count:,} tensors of shape [2] F32 (safetensors file "
                f"{fmt_bytes(size)}, mostly header). Median of {runs(a.repeats)}, each in a "
                f"fresh process after a warm-up on a small file. Page cache hot.")
        keys = Table("3a", f"Open + keys() of a file of {a.tiny_count:,} tiny tensors", what)
        load = Table("3b", f"load_file of a file of {a.tiny_count:,} tiny tensors", what)
        self.measure_reads(f"[3] {a.tiny_count:,} tiny tensors",
                           ((keys, peers.TINY_KEYS, "tiny_keys"),
                            (load, peers.TINY_LOAD, "tiny_load")), data, warm)
        keys.notes.append("torch.load and pickle cannot list names without loading "
                          "everything: see 3b.")
        load.notes.append(".npz: np.savez (uncompressed); a folder of 100k .npy files "
                          "was not considered.")
        self.emit(keys)
        self.emit(load)

    # (4) get_tensor per call -------------------------------------------------------
    def w4_per_call(self) -> None:
        a = self.args
        data = inputs.tiny(self.root, a.tiny_count)
        inputs.warm_page_cache(data)
        table = Table("4", "get_tensor of one tiny tensor on an open handle",
                      f"timeit on a handle to the {a.tiny_count:,}-tensor file of (3), one "
                      f"[2] F32 tensor; median of {a.call_repeats} timeit repeats.",
                      time_header="per call", memory=False)
        usable = self.usable(peers.PER_CALL)
        jobs = [(p.key, "measure_per_call", (p.key, data, a.call_repeats, a.call_min_time))
                for p in usable]
        progress(f"[4] per-call get_tensor: {len(jobs)} peers ")
        self.fill(table, peers.PER_CALL, interleaved(jobs, 1, a.timeout))
        self.emit(table)

    # (5) save peak memory ---------------------------------------------------------
    def w5_save_memory(self) -> None:
        a = self.args
        rows = a.size_mib * 1024 * 1024 // (64 * 4096)
        os.makedirs(self.out_dir, exist_ok=True)
        repeats = min(a.repeats, 2)   # memory barely varies; time is workload 2's job
        for order, ident, name in (("C", "5a", "C-order"), ("F", "5b", "Fortran-order")):
            table = Table(ident, f"save / save_file peak memory, {name} input "
                                 f"({a.size_mib} MiB, 64 F32 tensors)",
                          "Peak RSS beyond the input tensors (they exist before the probe "
                          "starts), one child process per measurement; '-> bytes' rows "
                          "include their output. Time: median of "
                          f"{runs(repeats)}, no os.sync() (workload 2 times saves properly).")
            usable = self.usable(peers.SAVE_MEMORY)
            jobs = [(p.key, "measure_save_memory",
                     (p.key, 64, rows, order, os.path.join(self.out_dir, f"mem_{p.key}")))
                    for p in usable]
            progress(f"[{ident}] save memory, {name}: {len(jobs)} writers x {repeats} ")
            table.repeats = repeats
            self.fill(table, peers.SAVE_MEMORY, interleaved(jobs, repeats, a.timeout))
            if order == "F":
                table.notes.append("Fortran-order input: writers that need C order must "
                                   "reorder; the raw limit writes the memory as it lies.")
            self.emit(table)

    # (6) import time -------------------------------------------------------------
    def w6_import(self) -> None:
        a = self.args
        os.makedirs(self.root, exist_ok=True)   # the children run there
        targets = [
            (Peer("fastst", "import fastst", "fastst", (), None), "numpy", "fastst"),
            (Peer("st", "import safetensors", "peer", ("safetensors",), None), "numpy",
             "safetensors"),
            (Peer("st_np", "import safetensors.numpy", "peer", ("safetensors",), None),
             "numpy", "safetensors.numpy"),
            (Peer("st_pt", "import safetensors.torch (imports torch)", "peer",
                  ("safetensors", "torch"), None), "numpy", "safetensors.torch"),
            (Peer("torch", "import torch", "peer", ("torch",), None), "numpy", "torch"),
            (Peer("numpy", "ref: import numpy itself (from a bare interpreter)", "ref", (),
                  None), "", "numpy"),
        ]
        table = Table("6", "Import time beyond `import numpy`",
                      f"Wall clock of `import X` in a fresh interpreter that has already "
                      f"imported numpy; median of {runs(a.import_repeats)}, interleaved" +
                      (" (no bytecode warm-up)." if a.quick else
                       " after one that fills a bytecode cache for every module."),
                      memory=False)
        usable = [t for t in targets if peers.available(t[0], self.disabled)]
        times: Dict[str, List[float]] = {t[0].key: [] for t in usable}
        errors: Dict[str, str] = {}
        progress(f"[6] import time: {len(usable)} modules x {a.import_repeats} ")
        # A full run times imports with every module's bytecode cached (round 0 fills a
        # private cache); --quick skips that costly round and times imports as they come.
        env = dict(os.environ) if a.quick else import_env(self.root)
        first = 1 if a.quick else 0
        for round_ in range(first, a.import_repeats + 1):
            for peer, before, module in usable:
                code = (f"import time{', ' + before if before else ''}\n"
                        f"t = time.perf_counter()\nimport {module}\n"
                        f"print(time.perf_counter() - t)")
                # from the data folder: `python -c` puts the working directory first
                # on sys.path, where a checkout's fastst would shadow --fastst DIR
                done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, env=env, cwd=self.root)
                if done.returncode:
                    errors[peer.key] = done.stderr.strip().splitlines()[-1][:160]
                elif round_:
                    times[peer.key].append(float(done.stdout))
            progress(".")
        progress("\n")
        results = {peer.key: ([{"error": errors[peer.key]}] if peer.key in errors else
                              [{"time": t} for t in times[peer.key]]) for peer, _, _ in usable}
        for peer, _, _ in targets:
            if peer.key in results:
                summarise(table, peer, results[peer.key])
            else:
                skipped_row(table, peer, self.disabled)
        heavy = import_breakdown("fastst", "numpy", env, self.root)
        if heavy:
            table.notes.append("Largest parts of `import fastst` after numpy (-X importtime, "
                               "cumulative): " + ", ".join(heavy))
        self.emit(table)

    # (7) data-loader gathers -------------------------------------------------------
    def w7_loader(self) -> None:
        a = self.args
        data = inputs.loader(self.root, a.size_mib)
        warm = inputs.loader(self.root, a.size_mib, warm=True)
        inputs.warm_page_cache(data, warm)
        table = Table("7", f"Data loader: random batches of {a.batch} rows from a "
                           f"[{data['rows']}, 1024] F32 tensor ({a.size_mib} MiB)",
                      f"Per-batch median over {a.batches} batches of random rows (no "
                      f"repeats within a batch, the same batches for everyone), page cache "
                      f"hot, mappings fresh. Peak RSS Δ over the whole loop.",
                      time_header="per batch")
        usable = self.usable(peers.LOADER)
        jobs = [(p.key, "measure_loader", (p.key, data, warm, a.batches, a.batch, a.seed))
                for p in usable]
        progress(f"[7] loader: {len(jobs)} peers ")
        self.fill(table, peers.LOADER, interleaved(jobs, 1, a.timeout))
        payload = a.batch * 4096
        for row in table.rows:
            if row.time is None or row.error:
                continue
            read = row.extra.get("read_per_batch", 0)
            notes = [row.note] if row.note else []
            if read > 4 * payload:
                notes.append(f"reads {fmt_bytes(read)} per batch for {fmt_bytes(payload)} "
                             f"of rows")
            if row.extra.get("batches", a.batches) < a.batches:
                notes.append(f"{row.extra['batches']} batches")
            row.note = "; ".join(notes)
        table.notes.append("safetensors' get_slice accepts only slices, so its rows gather "
                           "one slice per row. NumPy in memory excludes the time to load "
                           "the array (the limit a loader could reach).")
        self.emit(table)

    # (8) an error path: a hostile header ---------------------------------------------
    def w8_reject(self) -> None:
        a = self.args
        keys = 1_000_000
        path = inputs.repeated_metadata_key(self.root, keys)
        table = Table("8", f"A header of {keys:,} __metadata__ keys whose last key repeats",
                      f"load() of the {fmt_bytes(os.path.getsize(path))} file's bytes; "
                      f"median of {runs(a.repeats)}, each in a fresh process.")
        jobs = [(p.key, "measure_reject", (p.key, path)) for p in self.usable(peers.REJECT)]
        progress(f"[8] hostile header: {len(jobs)} peers ")
        self.fill(table, peers.REJECT, interleaved(jobs, a.repeats, a.timeout))
        self.emit(table)


def import_env(root: str) -> Dict[str, str]:
    """Environment for import timings: bytecode caching on for every module alike,
    in a private cache tree (PYTHONPYCACHEPREFIX), so no run pays for compiling."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(os.path.abspath(root), "pycache")
    return env


def import_breakdown(module: str, before: str, env: Dict[str, str], cwd: str,
                     top: int = 5) -> List[str]:
    """What `import module` spends its time on after `before` (-X importtime), run in
    `cwd`: the package's own modules by self time, and the outside modules it pulls
    in by cumulative time."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                           f"import {before}; import {module}"], capture_output=True, text=True,
                          env=env, cwd=cwd)
    if done.returncode:
        return []
    # importtime prints each module after its children; rebuild the tree from depths
    pending: List[List[Any]] = []   # [self_us, cumulative_us, depth, name, children]
    root = None
    for line in done.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)", line)
        if not match:
            continue
        depth = len(match.group(3)) // 2
        children: List[Any] = []
        while pending and pending[-1][2] > depth:
            children.insert(0, pending.pop())
        node = [int(match.group(1)), int(match.group(2)), depth, match.group(4), children]
        pending.append(node)
        if depth == 0 and node[3] == module:
            root = node
    if root is None:
        return []
    parts: List[Tuple[int, str]] = []

    def walk(node: List[Any]) -> None:
        if node[3] == module or node[3].startswith(module + "."):
            parts.append((node[0], f"{node[3]} (own code)"))
            for child in node[4]:
                walk(child)
        else:
            parts.append((node[1], node[3]))
    walk(root)
    parts.sort(reverse=True)
    return [f"{name} {us / 1000:.1f} ms" for us, name in parts[:top]]


# ---------------------------------------------------------------------------
# Environment and output
# ---------------------------------------------------------------------------


def environment(torch_threads: int) -> Dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = "unknown"
    try:
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        ram = f"{kib / 2**20:.1f} GiB"
    except (OSError, StopIteration):
        pass
    info = {
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": ram,
        "os": platform.platform(),
        "python": platform.python_version(),
    }
    for name, version in peers.versions().items():
        info[name] = version or "not installed"
    info["fastst"] += f" ({fastst_source()})"
    if peers.torch is not None:
        info["torch threads"] = str(torch_threads or peers.torch.get_num_threads())
    return info


def fastst_source() -> str:
    """Where the fastst under test comes from."""
    if FASTST_ORIGIN:
        return FASTST_ORIGIN
    folder = os.path.dirname(os.path.dirname(os.path.abspath(peers.fastst.__file__)))
    git = _git_description(folder)
    return folder + (f", {git}" if git else "")


def markdown(bench: Bench, env: Dict[str, str], command: str) -> str:
    lines = ["# fastst benchmark results", "",
             f"Produced by `{command}` on {env['date']}.", "",
             "| machine | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in env.items() if k != "date"]
    lines += ["", "Ratios: `× fastst` is time / the first fastst row's time (above 1: slower "
              "than fastst); `× raw` is time / the raw limit's time. See README.md.", ""]
    for table in bench.tables:
        lines += [table.markdown(), ""]
    return "\n".join(lines)


WORKLOADS: Dict[str, Callable[[Bench], None]] = {
    "1": Bench.w1_read, "2": Bench.w2_save, "3": Bench.w3_tiny, "4": Bench.w4_per_call,
    "5": Bench.w5_save_memory, "6": Bench.w6_import, "7": Bench.w7_loader,
    "8": Bench.w8_reject,
}

QUICK = {"size_mib": 32, "tiny_count": 2000, "repeats": 1, "batches": 10,
         "import_repeats": 1, "call_repeats": 3, "call_min_time": 0.01}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small sizes, one repeat (under a minute)")
    parser.add_argument("--markdown", metavar="PATH", help="also write the tables as markdown")
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8",
                        help="comma-separated workloads to run (default: all)")
    parser.add_argument("--size-mib", type=int, help="size of the big file (default 1024; "
                        "env FASTST_BENCH_SIZE_MIB)")
    parser.add_argument("--tiny-count", type=int, help="tensors in the many-tiny-tensors file "
                        "(default 100000; env FASTST_BENCH_TINY_COUNT)")
    parser.add_argument("--repeats", type=int, help="runs per measurement (default 5)")
    parser.add_argument("--batches", type=int, help="batches in the loader workload "
                        "(default 200)")
    parser.add_argument("--batch", type=int, default=256, help="rows per batch (default 256)")
    parser.add_argument("--import-repeats", type=int, help="runs per import (default 10)")
    parser.add_argument("--call-repeats", type=int, help="timeit repeats per call (default 7)")
    parser.add_argument("--call-min-time", type=float, help="seconds per timeit repeat "
                        "(default 0.2)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads in the measurements (default 1, as "
                        "every other peer is single-threaded; 0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds before one measurement is abandoned")
    parser.add_argument("--disable", action="append", default=[],
                        choices=["safetensors", "torch"],
                        help="treat a peer as not installed (repeatable)")
    parser.add_argument("--fastst", metavar="DIR",
                        help="import fastst from DIR (the folder holding the fastst package) "
                        "instead of the installed one, e.g. a frozen copy of a tree that "
                        "is being edited")
    parser.add_argument("--freeze", action="store_true",
                        help="benchmark a private copy of fastst taken at start, so edits "
                        "to the tree during the run cannot mix versions")
    parser.add_argument("--data-dir", default=os.path.join(HERE, "_data"),
                        help="where the input files go (default bench/_data)")
    parser.add_argument("--keep-data", action="store_true",
                        help="keep the input files for the next run")
    args = parser.parse_args(argv)
    defaults = {"size_mib": int(os.environ.get("FASTST_BENCH_SIZE_MIB", 1024)),
                "tiny_count": int(os.environ.get("FASTST_BENCH_TINY_COUNT", 100_000)),
                "repeats": 5, "batches": 200, "import_repeats": 10, "call_repeats": 7,
                "call_min_time": 0.2}
    if args.quick:
        defaults.update(QUICK)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.size_mib < 1:
        parser.error("--size-mib must be at least 1")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def cleanup(root: str) -> None:
    for name in ("big", "big_warm", "tiny", "tiny_warm", "loader", "loader_warm", "out",
                 "pycache"):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    try:
        os.rmdir(root)
    except OSError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    env = environment(args.torch_threads)
    print("fastst benchmarks — " + ", ".join(f"{k}: {v}" for k, v in env.items()) + "\n",
          flush=True)
    missing = [name for name, ok in peers.AVAILABLE.items() if not ok]
    if missing:
        print(f"(not installed, skipped: {', '.join(missing)})\n", flush=True)
    os.makedirs(args.data_dir, exist_ok=True)
    SETTINGS["torch_threads"] = args.torch_threads
    bench = Bench(args)
    started = time.perf_counter()
    try:
        for key in args.workloads.split(","):
            begun = time.perf_counter()
            WORKLOADS[key](bench)
            progress(f"[{key}] took {time.perf_counter() - begun:.0f} s\n\n")
    finally:
        if not args.keep_data:
            cleanup(args.data_dir)
        for folder in FROZEN:
            shutil.rmtree(folder, ignore_errors=True)
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s", flush=True)
    if args.markdown:
        command = "python bench/run.py" + "".join(
            f" {a}" for a in (argv if argv is not None else sys.argv[1:])
            if not a.startswith("--markdown") and a != args.markdown)
        with open(args.markdown, "w") as f:
            f.write(markdown(bench, env, command))
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
