"""Converting a torch checkpoint to safetensors: fastst.convert against
``torch.load(weights_only=True)`` + ``safetensors.torch.save_file``.

Each conversion runs in a fresh process, which reports its wall time and its peak
resident memory (VmHWM); the conversions take turns, after a round of warm-up that
puts the checkpoint in the page cache, and each starts after ``os.sync()`` with no
output file present. fastst's process cannot import torch.

    python bench/convert.py                  # 1 GiB checkpoint, 3 runs each
    python bench/convert.py --size-mib 256 --repeats 1 --markdown out.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PEAK = textwrap.dedent("""
    def peak_mib():
        with open("/proc/self/status") as status:
            line = [line for line in status if line.startswith("VmHWM:")][0]
        return int(line.split()[1]) / 1024
""")

RUNNERS = {
    "fastst.convert (verify on)": """
        import sys, time
        sys.modules["torch"] = None
        from fastst.convert import torch_to_safetensors
        start = time.perf_counter()
        torch_to_safetensors(SRC, DST)
    """,
    "fastst.convert (verify off)": """
        import sys, time
        sys.modules["torch"] = None
        from fastst.convert import torch_to_safetensors
        start = time.perf_counter()
        torch_to_safetensors(SRC, DST, verify=False)
    """,
    "torch.load(weights_only) + safetensors.torch.save_file": """
        import time
        import torch
        from safetensors.torch import save_file
        torch.set_num_threads(1)
        start = time.perf_counter()
        state = torch.load(SRC, weights_only=True)
        seen = set()
        for name in sorted(state):      # tied weights kept once, as the hub's converter does
            tensor = state[name]
            layout = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride())
            if layout in seen:
                del state[name]
            seen.add(layout)
        save_file(state, DST, metadata={"format": "pt"})
    """,
}


def make_checkpoint(path: str, size_mib: int) -> Tuple[int, int]:
    """A transformer-shaped state dict of about `size_mib` MiB: F32 and BF16
    matrices, their biases, and a tied embedding."""
    import torch

    torch.manual_seed(0)
    state: Dict[str, "torch.Tensor"] = {}
    width = 1024
    layers = max(size_mib // 14, 1)            # ~14 MiB a layer
    state["embed.weight"] = torch.randn(4096, width)
    state["lm_head.weight"] = state["embed.weight"]
    for k in range(layers):
        state[f"layers.{k}.attn.weight"] = torch.randn(3 * width, width)
        state[f"layers.{k}.attn.bias"] = torch.randn(3 * width)
        state[f"layers.{k}.mlp.weight"] = torch.randn(2 * width, width).to(torch.bfloat16)
    torch.save(state, path)
    return len(state), os.path.getsize(path)


def run_one(code: str, src: str, dst: str) -> Tuple[float, float]:
    script = PEAK + f"SRC, DST = {src!r}, {dst!r}\n" + textwrap.dedent(code) + \
        "print(time.perf_counter() - start, peak_mib())\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    seconds, peak = map(float, result.stdout.split())
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fastst-bench-convert-") as folder:
        src = os.path.join(folder, "pytorch_model.bin")
        count, size = make_checkpoint(src, args.size_mib)
        rows: List[List[str]] = []
        dst = os.path.join(folder, "model.safetensors")
        runs: Dict[str, List[Tuple[float, float]]] = {label: [] for label in RUNNERS}
        for repeat in range(args.repeats + 1):          # round robin; the first is a warm-up
            for label, code in RUNNERS.items():
                if os.path.exists(dst):
                    os.unlink(dst)
                os.sync()       # no run pays for the write-back of the one before
                result = run_one(code, src, dst)
                if repeat:
                    runs[label].append(result)
        for label, timed in runs.items():
            seconds = statistics.median(s for s, _ in timed)
            peak = max(p for _, p in timed)
            rows.append([label, f"{seconds * 1000:.0f} ms", f"{size / seconds / 2**30:.2f} GiB/s",
                         f"{peak:.0f} MiB"])
        reference = float(rows[-1][1].split()[0])
        for row in rows:
            row.append(f"{reference / float(row[1].split()[0]):.2f}x")
    header = ["conversion", "time (median)", "throughput", "peak RSS", "speed vs peer"]
    lines = [f"Checkpoint: {count} tensors, {size / 2**20:.0f} MiB (torch zip format), "
             f"{args.repeats} runs each, taking turns, after a warm-up round.", "",
             "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
