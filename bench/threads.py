"""Threads reading one file: 1, 2 and 4 Python threads, each reading many small
tensors from the same open handle, or from a handle of its own, on each interpreter
named (a build with the GIL, a free-threaded one). The figure is the tensors read a
second by all threads together, and its ratio to one thread's on the same interpreter.

Every round runs each interpreter once, in turn (a fresh process each: the work of
all thread counts, in an order rotated each round); the table gives medians. Each
thread reads its share of the file's tensors in a shuffled order: ``get_tensor``
(a view of the map), or ``backend="pread"`` copies into fresh memory.

    python bench/threads.py --python python3.13t --python "PYTHON_GIL=1 python3.13t"
    python bench/threads.py --python python3.11 --python python3.13t --rounds 5 \\
        --markdown out.md

An interpreter given as ``VAR=value ... python`` runs with those variables set; each
must import fastst (``--fastst DIR`` puts DIR first on every one's path). The
children run in a temporary folder, so a checkout's fastst is not found by accident.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

THREAD_COUNTS = (1, 2, 4)
BACKENDS = ("mmap", "pread")
HANDLES = ("one", "each")      # one handle shared by the threads, or one handle each

CHILD = r"""
import json, sys, threading, time
import numpy as np, fastst
path, tensors, reads, order = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
names = [f"t{k}" for k in range(tensors)]
results = {}
for backend, handles, threads in json.loads(order):
    shared = fastst.safe_open(path, backend="mmap" if backend in ("python", "numpy") else backend)
    shared_array = np.zeros(64, np.float32)
    start, spans = threading.Barrier(threads), []
    def work(k):
        if backend == "python":                # the machine's share of cores meanwhile
            start.wait()
            began, total = time.perf_counter(), 0
            for i in range(reads):
                total += i & 7
            spans.append((began, time.perf_counter()))
            return
        if backend == "numpy":                 # views, NumPy's own: what any view costs
            array = shared_array if handles == "one" else np.zeros(64, np.float32)
            start.wait()
            began = time.perf_counter()
            for i in range(reads):
                array[1:]
            spans.append((began, time.perf_counter()))
            return
        handle = shared if handles == "one" else fastst.safe_open(path, backend=backend)
        for name in names:                     # the index, first calls: not timed
            handle.get_tensor(name)
        # names of the thread's own: a str shared by threads serialises them as a shared
        # handle does (3.13t counts references to a shared object atomically)
        share = [f"t{i}" for i in np.random.default_rng(k).integers(0, tensors, reads)]
        start.wait()
        began = time.perf_counter()
        for name in share:
            handle.get_tensor(name)
        spans.append((began, time.perf_counter()))
    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = max(end for _, end in spans) - min(began for began, _ in spans)
    results[f"{backend} {handles} {threads}"] = threads * reads / elapsed
gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
print(json.dumps({"results": results, "gil": gil, "version": sys.version.split()[0]}))
"""


def interpreter(spec: str, fastst_dir: str | None) -> tuple:
    """(argv, environment) of an interpreter given as ``[VAR=value ...] python``."""
    words = shlex.split(spec)
    env = dict(os.environ)
    while words and "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if fastst_dir:
        env["PYTHONPATH"] = fastst_dir + os.pathsep + env.get("PYTHONPATH", "")
    return words, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", required=True,
                        help="an interpreter, [VAR=value ...] python (repeat)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=20_000)
    parser.add_argument("--reads", type=int, default=200_000, help="tensors each thread reads")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="mmap,pread")
    parser.add_argument("--fastst", help="import fastst from this folder")
    parser.add_argument("--markdown", help="also append the table to this file")
    args = parser.parse_args()
    pythons = [interpreter(spec, args.fastst) for spec in args.python]
    runs = {spec: [] for spec in args.python}
    seen = {}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "small.safetensors")
        make_file(path, args.tensors, *pythons[0])
        cases = [(backend, handles, threads) for backend, handles in rows(args)
                 for threads in THREAD_COUNTS]
        for round in range(args.rounds):
            order = cases[round % len(cases):] + cases[:round % len(cases)]
            for spec, (argv, env) in zip(args.python, pythons):
                done = subprocess.run([*argv, "-c", CHILD, path, str(args.tensors),
                                       str(args.reads), json.dumps(order)],
                                      env=env, capture_output=True, text=True, check=True,
                                      cwd=folder)     # not a checkout's fastst
                report = json.loads(done.stdout)
                runs[spec].append(report["results"])
                seen[spec] = report
                print(f"round {round + 1} {spec}: " + ", ".join(
                    f"{key} {rate / 1e3:.0f}k/s" for key, rate in report["results"].items()),
                    file=sys.stderr)
    table = render(runs, seen, args)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(table + "\n")


def make_file(path: str, tensors: int, argv: list, env: dict) -> None:
    code = ("import sys, numpy as np, fastst; fastst.save_file({f't{k}': np.full(64, k, "
            "np.float32) for k in range(int(sys.argv[2]))}, sys.argv[1])")
    subprocess.run([*argv, "-c", code, path, str(tensors)], env=env, check=True,
                   cwd=os.path.dirname(path))


def rows(args: argparse.Namespace) -> list:
    """(backend, handles) of each row: a pure Python loop first, the machine's
    parallelism at the time (what the other rows can reach); NumPy's views of one
    array shared by the threads and of an array a thread (what handing out a view
    can reach); then each backend with one shared handle and with one a thread."""
    backends = ["numpy", *args.backends.split(",")]
    return [("python", "-")] + [(backend, handles) for backend in backends
                                for handles in HANDLES]


def render(runs: dict, seen: dict, args: argparse.Namespace) -> str:
    header = ["interpreter", "GIL", "backend", "handles"] + [
        f"{n} thread{'s' * (n > 1)}" for n in THREAD_COUNTS] + [
        f"{n} / 1" for n in THREAD_COUNTS[1:]]
    lines = ["| " + " | ".join(header) + " |",
             "| --- | --- | --- | --- |" + " ---: |" * (len(header) - 4)]
    for spec, reports in runs.items():
        for backend, handles in rows(args):
            rates = [statistics.median(report[f"{backend} {handles} {n}"] for report in reports)
                     for n in THREAD_COUNTS]
            cells = [f"`{spec}` ({seen[spec]['version']})",
                     "on" if seen[spec]["gil"] else "off", backend,
                     {"one": "one, shared", "each": "one a thread"}.get(handles, "")]
            if backend == "numpy":
                cells[-1] = {"one": "an array, shared", "each": "an array a thread"}[handles]
            cells += [f"{rate / 1e3:.0f}k/s" for rate in rates]
            cells += [f"{rate / rates[0]:.2f}x" for rate in rates[1:]]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
