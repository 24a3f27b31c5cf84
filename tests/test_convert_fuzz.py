"""A short pass of fuzz/fuzz_unpickler.py, quick enough for CI: its seeds (torch's
own pickles, hostile ones, and inputs that once cost hours or gigabytes) and a few
thousand seeded random mutations of them go through ``TestOneInput``, which lets
only ``SafetensorError`` pass and fails when a marker file appears (an input ran
code), or when an input costs more CPU time, memory or output than its size
justifies. With atheris, the target also runs under libFuzzer for 1,000 inputs."""
from __future__ import annotations

import importlib.util
import os
import pickle
import random
import subprocess
import sys

import pytest

from helpers import libfuzzer_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MUTATIONS = 1500
# Opcodes worth splicing in: the ones that build objects, call, or address the memo.
OPCODES = [pickle.REDUCE, pickle.BUILD, pickle.GLOBAL, pickle.STACK_GLOBAL, pickle.NEWOBJ,
           pickle.INST, pickle.OBJ, pickle.BINPERSID, pickle.TUPLE, pickle.MARK,
           pickle.SETITEMS, pickle.APPENDS, pickle.LONG_BINPUT, pickle.LONG_BINGET,
           pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.FRAME, pickle.BINBYTES8,
           b"cos\nsystem\n", b"ctorch._utils\n_rebuild_tensor_v2\n", b"\x8c\x05torch",
           b"K\xff", b"J\xff\xff\xff\x7f", b"\x8a\x08" + b"\xff" * 8]


@pytest.fixture(scope="module")
def target():
    spec = importlib.util.spec_from_file_location(
        "fastst_fuzz_unpickler", os.path.join(ROOT, "fuzz", "fuzz_unpickler.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mutate(data: bytes, rng: random.Random, others) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.randrange(5)
        position = rng.randrange(len(data) + 1)
        if choice == 0 and data:
            data[min(position, len(data) - 1)] = rng.randrange(256)
        elif choice == 1:
            data[position:position] = rng.choice(OPCODES)
        elif choice == 2:
            del data[position:position + rng.randint(1, 8)]
        elif choice == 3:
            other = rng.choice(others)
            start = rng.randrange(len(other))
            data[position:position] = other[start:start + rng.randint(1, 32)]
        else:
            data = data[:position]
    return bytes(data)


@pytest.mark.needs("torch")     # the target's seeds include torch's own pickles then
def test_seeds(target):
    seeds = list(target.seeds())
    assert {"os-system", "eval", "copyreg", "flat", "nested", "dos-hash-bomb", "dos-expanded",
            "dos-lying-zip", "dos-npz-zeros"} <= {name for name, _ in seeds}
    for _, data in seeds:
        target.TestOneInput(data)


def test_an_input_that_costs_too_much_is_a_finding(target, monkeypatch):
    """The target's own bounds: CPU time, and the size of what it wrote."""
    seeds = dict(target.seeds())
    monkeypatch.setattr(target, "CPU_SECONDS", -1.0)
    with pytest.raises(AssertionError, match="s of CPU"):
        target.TestOneInput(seeds["tensor"])
    monkeypatch.undo()
    monkeypatch.setattr(target, "EXPANSION_ALLOWANCE", 0)
    with pytest.raises(AssertionError, match="bytes written, over"):
        target.TestOneInput(seeds["dos-npz-zeros"])


def test_random_mutations(target):
    seeds = [data for _, data in target.seeds()]
    rng = random.Random(20261122)
    for _ in range(MUTATIONS):
        target.TestOneInput(mutate(rng.choice(seeds), rng, seeds))


@pytest.mark.needs("atheris")
def test_under_libfuzzer(tmp_path):
    corpus = tmp_path / "corpus"
    script = os.path.join(ROOT, "fuzz", "fuzz_unpickler.py")
    subprocess.run([sys.executable, script, "--write-seeds", str(corpus)], check=True, cwd=ROOT)
    result = subprocess.run([sys.executable, script, str(corpus), "-runs=1000",
                             "-max_len=4096", "-timeout=20", "-rss_limit_mb=2048",
                             f"-artifact_prefix={tmp_path}{os.sep}"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert libfuzzer_runs(result.stderr) >= 1000, result.stderr[-3000:]
