"""Cold start: a fresh process's first call, fastst against the reference
(huggingface ``safetensors``), with ``python -c pass`` as the floor.

Each measurement is a whole child process: the interpreter starting, its imports, the
call and the exit; wall clock, and CPU time (user + system, from the kernel's
accounting of the child); and the child's own part, timed inside it: the library's
imports and its first call, after the imports both sides share (NumPy, torch), which
is what a whole process's noise hides (the from_pretrained row has none: transformers
imports the library itself). Every round runs each row's processes and the floor once, in
an order rotated each round, after a warm-up round that is not counted (it fills the
page cache, and a bytecode cache of the bench's own for every module imported, so that
no run compiles); the tables give medians.

Rows:

- ``load_file`` of a small F32 file (``fastst.load_file`` against
  ``safetensors.numpy.load_file``);
- ``fastst inspect`` of a small file of F32, BF16 and F8_E4M3 tensors, against the
  reference's nearest equivalent: ``safe_open`` printing each tensor's name, dtype
  and shape, and the metadata;
- ``fastst.torch.load_file`` of a BF16 file against ``safetensors.torch.load_file``;
- transformers' ``from_pretrained`` of a Llama-shaped BF16 model built from a config
  (no download; saved once with ``save_pretrained``), with ``safetensors`` pointed at
  fastst before transformers is imported (``--switch``), against the reference.

    python bench/coldstart.py                     # 7 rounds, a 440 MiB model
    python bench/coldstart.py --rounds 3 --model-mib 60 --markdown out.md
    python bench/coldstart.py --switch env        # FASTST_PATCH_SAFETENSORS=1 instead

``--switch env`` needs a Python that reads ``fastst-safetensors.pth`` as it starts: one
where fastst is installed, or a virtual environment with the file in its
site-packages (and a ``.pth`` line naming the site-packages that hold numpy, torch and
transformers), the checkout being found through ``--fastst``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# How from_pretrained is pointed at fastst: the modules put in place by hand, or the
# environment variable of the package's own switch.
SWITCHES = {
    "modules": ("import fastst, fastst.torch, sys; sys.modules['safetensors'] = fastst; "
                "sys.modules['safetensors.torch'] = fastst.torch\n", {}),
    "env": ("", {"FASTST_PATCH_SAFETENSORS": "1"}),
}

INSPECT_REFERENCE = """
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "np") as f:
    for name in f.keys():
        piece = f.get_slice(name)
        print(name, piece.get_dtype(), piece.get_shape())
    print(f.metadata())
"""
FROM_PRETRAINED = """
import sys, torch
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
"""


class Child(NamedTuple):
    """One process to time: its code (for ``python -c``), arguments and environment;
    `shared`, imports both sides pay, run before the child's own part is timed."""
    code: str
    args: Tuple[str, ...] = ()
    env: Dict[str, str] = {}
    shared: str = ""


# What a child reports of its own part (the library's imports and its first call),
# timed inside the process after the imports both sides share.
OWN = "coldstart-own-seconds"


def script(child: Child) -> str:
    """The child's code for ``python -c``: with `shared` imported first, its own part
    timed and reported on stderr."""
    if not child.shared:
        return child.code
    return (f"import sys, time\n{child.shared}\n__start = time.perf_counter()\n{child.code}\n"
            f"sys.stderr.write(f'{OWN} {{time.perf_counter() - __start}}\\n')\n")


class Row(NamedTuple):
    label: str
    fastst: Child
    reference: Child


def rows_for(files: Dict[str, str], switch: str) -> List[Row]:
    preamble, switch_env = SWITCHES[switch]
    return [
        Row("`load_file` of a small F32 file",
            Child("import fastst; fastst.load_file(sys.argv[1])", (files["f32"],),
                  shared="import numpy"),
            Child("from safetensors.numpy import load_file; load_file(sys.argv[1])",
                  (files["f32"],), shared="import numpy")),
        Row("`fastst inspect` of a small F32/BF16/F8 file",
            Child("from fastst.cli import main\nif main(): raise SystemExit(1)",
                  ("inspect", files["mixed"]),
                  shared="import numpy"),
            Child(INSPECT_REFERENCE, (files["mixed"],), shared="import numpy")),
        Row("`torch` `load_file` of a BF16 file",
            Child("import fastst.torch; fastst.torch.load_file(sys.argv[1])",
                  (files["bf16"],), shared="import numpy, torch"),
            Child("from safetensors.torch import load_file; load_file(sys.argv[1])",
                  (files["bf16"],), shared="import numpy, torch")),
        Row("`from_pretrained` of a Llama-shaped BF16 model",
            Child(preamble + FROM_PRETRAINED, (files["model"],), {**OFFLINE, **switch_env}),
            Child(FROM_PRETRAINED, (files["model"],), OFFLINE)),
    ]


FLOOR = Child("pass")


class Run(NamedTuple):
    """One run of a child: seconds of wall clock and of CPU from its start to its exit,
    and of its own part (None where it has none)."""
    wall: float
    cpu: float
    own: Optional[float]


def run_child(child: Child, fastst_dir: str, folder: str) -> Run:
    """One run of `child`, from its start to its exit,
    in `folder` (``python -c`` imports from its working directory first). Bytecode goes
    to a cache of the bench's own in `folder`, as an installed package's would be
    compiled once: the warm-up round fills it for every module, both sides'. Every
    child, the reference's too, imports from `fastst_dir` first: an entry of sys.path
    costs each module found after it a lookup (about 2 ms for numpy's here), which
    neither side should pay alone."""
    env = {**os.environ, **child.env, "PYTHONPYCACHEPREFIX": os.path.join(folder, "pycache")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [fastst_dir, env.get("PYTHONPATH")]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script(child), *child.args], env=env, cwd=folder,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{child.code!r} {child.args} failed:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    own = [float(line.split()[1]) for line in done.stderr.splitlines() if line.startswith(OWN)]
    return Run(wall, cpu, own[0] if own else None)


def measure(children: Sequence[Child], rounds: int, fastst_dir: str, folder: str
            ) -> List[List[Run]]:
    """Each child's runs, `rounds` of them, interleaved: every round runs each child
    once, the order rotated by one each round, after an uncounted warm-up round."""
    runs: List[List[Run]] = [[] for _ in children]
    order = list(range(len(children)))
    for round_ in range(rounds + 1):
        for k in order:
            result = run_child(children[k], fastst_dir, folder)
            if round_:
                runs[k].append(result)
        order = order[1:] + order[:1]
    return runs


def make_files(folder: str, model_mib: int) -> Dict[str, str]:
    """The inputs, written once into `folder` (by the reference's writers, so that
    both sides read the same bytes)."""
    import numpy as np
    import torch
    from safetensors.numpy import save_file as save_numpy
    from safetensors.torch import save_file as save_torch

    os.makedirs(folder, exist_ok=True)
    files = {name: os.path.join(folder, f"{name}.safetensors")
             for name in ("f32", "mixed", "bf16")}
    files["model"] = os.path.join(folder, f"llama-{model_mib}mib")
    if not os.path.exists(files["f32"]):
        save_numpy({"x": np.arange(16, dtype=np.float32)}, files["f32"])
    if not os.path.exists(files["mixed"]):
        save_torch({"embed": torch.ones(8, 4), "norm": torch.ones(4, dtype=torch.bfloat16),
                    "proj": torch.ones(4, 4).to(torch.float8_e4m3fn)}, files["mixed"],
                   metadata={"format": "pt"})
    if not os.path.exists(files["bf16"]):
        save_torch({f"layer{k}.weight": torch.randn(512, 512).to(torch.bfloat16)
                    for k in range(8)}, files["bf16"])
    if not os.path.exists(os.path.join(files["model"], "config.json")):
        save_llama(files["model"], model_mib)
    return files


def save_llama(folder: str, model_mib: int) -> None:
    """A Llama-shaped model of about `model_mib` MiB of BF16 weights, random, built from
    a config (width 1024, vocabulary 32000, untied head) and saved by transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    width, ffn, vocab = 1024, 2816, 32000
    per_layer = 4 * width * width + 3 * width * ffn + 2 * width
    layers = max(1, (model_mib * 2**20 // 2 - 2 * vocab * width - width) // per_layer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (5 min: {five:.1f})"


def table(rows: Sequence[Row], runs: List[List[Run]]) -> List[str]:
    lines = ["| first call, fresh process | fastst | reference | fastst / reference "
             "| CPU ratio | own part: fastst | reference | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k, row in enumerate(rows):
        ours, theirs = runs[2 * k], runs[2 * k + 1]
        wall, cpu = _medians(ours, theirs, "wall"), _medians(ours, theirs, "cpu")
        own = (_medians(ours, theirs, "own") if ours[0].own is not None
               else None)
        own_cells = (f"{own[0] * 1000:.2f} ms | {own[1] * 1000:.2f} ms | {own[0] / own[1]:.2f}x"
                     if own else " | | ")
        lines.append(f"| {row.label} | {_ms(wall[0])} | {_ms(wall[1])} | "
                     f"{wall[0] / wall[1]:.2f}x | {cpu[0] / cpu[1]:.2f}x | {own_cells} |")
    floor = statistics.median(run.wall for run in runs[-1])
    lines.append(f"| `python -c pass` (the floor) | {_ms(floor)} | | | | | | |")
    return lines


def _medians(ours: Sequence[Run], theirs: Sequence[Run], field: str) -> Tuple[float, float]:
    return (statistics.median(getattr(run, field) for run in ours),
            statistics.median(getattr(run, field) for run in theirs))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model-mib", type=int, default=440,
                        help="size of the model's BF16 weights (default 440)")
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="modules",
                        help="how from_pretrained is pointed at fastst: 'modules' puts "
                             "fastst in sys.modules in the child's first line; 'env' sets "
                             "FASTST_PATCH_SAFETENSORS=1 (for a fastst installed with its "
                             "switch)")
    parser.add_argument("--fastst", default=ROOT, metavar="DIR",
                        help="import fastst from DIR (the folder holding the package)")
    parser.add_argument("--data-dir", default=os.path.join(ROOT, "bench", "_data", "coldstart"))
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    args.data_dir = os.path.abspath(args.data_dir)
    files = make_files(args.data_dir, args.model_mib)
    rows = rows_for(files, args.switch)
    children = [child for row in rows for child in (row.fastst, row.reference)] + [FLOOR]
    started, load_before = datetime.datetime.now(datetime.timezone.utc), load_average()
    runs = measure(children, args.rounds, os.path.abspath(args.fastst), args.data_dir)
    model_bytes = sum(os.path.getsize(os.path.join(files["model"], name))
                      for name in os.listdir(files["model"]) if name.endswith(".safetensors"))
    lines = [f"Produced by `python bench/coldstart.py {' '.join(argv or sys.argv[1:])}`"
             f" on {started:%Y-%m-%d %H:%M} UTC: {platform.python_version()}, "
             f"{os.cpu_count()} cores, load average {load_before} before the run and "
             f"{load_average()} after. Median of {args.rounds} rounds; the model holds "
             f"{model_bytes / 2**20:.0f} MiB; from_pretrained switched by "
             f"`--switch {args.switch}`.", ""] + table(rows, runs)
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
