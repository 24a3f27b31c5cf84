"""Two checkouts of fastst side by side: does a change beneath the API (a move of
modules, a split of the core) cost anything measurable?

Each measurement runs in a child process whose ``PYTHONPATH`` puts one checkout first;
the child times its own part and prints it. Every round runs each case once per
checkout, the order of the two alternating from round to round, after a warm-up round
that is not counted (it fills the page cache and a bytecode cache of the bench's own);
the table gives medians and the ratio of the second checkout's to the first's.

Cases: a fresh process's first ``load_file`` of a small file (fastst's imports
included, NumPy's not), its first ``fastst inspect``, its first ``safe_open`` of a file
object; then, hot, a ``load_file`` of a 64 MiB file, 1,000 ``get_slice(name)[i]`` rows,
100 ``get_tensor`` of a file object, and a ``save_file`` of 2,000 small tensors.

    git worktree add ../before REF && (cd ../before && python setup.py build_ext --inplace)
    python bench/trees.py ../before .              # 11 rounds
    python bench/trees.py ../before . --rounds 5 --markdown out.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

import numpy as np
from safetensors.numpy import save_file as reference_save

# NumPy, which both checkouts import, is imported before the clock starts
FIRST = ("import time, numpy\nstarted = time.perf_counter()\n{body}\n"
         "print(time.perf_counter() - started)\n")
HOT = """import time, statistics
{setup}
def once():
{body}
once()
times = []
for _ in range({repeat}):
    started = time.perf_counter()
    once()
    times.append(time.perf_counter() - started)
print(statistics.median(times))
"""

# case -> the child's script, with {small}, {big} and {folder} filled in
CASES = {
    "first load_file (fresh process)": FIRST.format(
        body="import fastst\nfastst.load_file({small!r})"),
    "first fastst inspect (fresh process)": FIRST.format(
        body="import io, contextlib\nfrom fastst.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    main(['inspect', {small!r}])"),
    "first safe_open of a file object (fresh process)": FIRST.format(
        body="import fastst\nwith open({small!r}, 'rb') as file, fastst.safe_open(file) as f:\n"
             "    f.get_tensor('w')"),
    "load_file of 64 MiB, hot": HOT.format(
        setup="import fastst", body="    fastst.load_file({big!r})", repeat=30),
    "get_slice(name)[i], hot": HOT.format(
        setup="import fastst\nf = fastst.safe_open({big!r})",
        body="    for i in range(1000):\n        f.get_slice('w')[i]", repeat=30),
    "get_tensor of a file object, hot": HOT.format(
        setup="import fastst, io\nbuffer = io.BytesIO(open({small!r}, 'rb').read())\n"
              "f = fastst.safe_open(buffer)",
        body="    for _ in range(100):\n        f.get_tensor('w')", repeat=30),
    "save_file of 2,000 small tensors, hot": HOT.format(
        setup="import fastst, numpy as np\n"
              "tensors = {{f't{{i}}': np.full(256, i, np.float32) for i in range(2000)}}",
        body="    fastst.save_file(tensors, {folder!r} + '/many.safetensors')", repeat=15),
}


def make_files(folder: str) -> Dict[str, str]:
    small = os.path.join(folder, "small.safetensors")
    big = os.path.join(folder, "big.safetensors")
    reference_save({"w": np.ones((16, 16), np.float32)}, small)
    reference_save({"w": np.ones((1 << 16, 256), np.float32)}, big)
    return {"small": small, "big": big, "folder": folder}


def run_child(code: str, checkout: str, folder: str) -> float:
    """The seconds a child reports, `checkout` first on its path (and not the current
    folder, which ``python -c`` would put before it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.abspath(checkout), os.environ.get("PYTHONPATH")])))
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "fastst-bench-pycache")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=600, check=True)
    return float(done.stdout.split()[-1])


def measure(checkouts: Sequence[str], rounds: int, files: Dict[str, str]
            ) -> Dict[str, List[List[float]]]:
    scripts = {case: code.format(**files) for case, code in CASES.items()}
    times: Dict[str, List[List[float]]] = {case: [[] for _ in checkouts] for case in CASES}
    for round_ in range(rounds + 1):     # round 0 warms up
        order = list(range(len(checkouts)))[::1 if round_ % 2 else -1]
        for case, code in scripts.items():
            for which in order:
                took = run_child(code, checkouts[which], files["folder"])
                if round_:
                    times[case][which].append(took)
    return times


def table(checkouts: Sequence[str], times: Dict[str, List[List[float]]]) -> List[str]:
    first, second = (os.path.basename(os.path.abspath(path)) or path for path in checkouts)
    lines = [f"| case | {first} | {second} | {second} / {first} |", "| --- | ---: | ---: | ---: |"]
    for case, (before, after) in times.items():
        a, b = statistics.median(before), statistics.median(after)
        lines.append(f"| {case} | {a * 1e3:.2f} ms | {b * 1e3:.2f} ms | {b / a:.3f}x |")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="a checkout with its core built in place")
    parser.add_argument("after", help="another one")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        times = measure([args.before, args.after], args.rounds, make_files(folder))
    lines = [f"Produced by `python bench/trees.py {args.before} {args.after} --rounds "
             f"{args.rounds}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
             f"UTC, load {os.getloadavg()[0]:.1f}:", ""] + table([args.before, args.after], times)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
