"""A short pass of the fuzz target in fuzz/fuzz_load.py, quick enough for CI.

* Without atheris: every seed of fuzz/make_corpus.py and a few thousand seeded random
  mutations of them (byte-level, and header-level through the target's own
  ``mutate_structure``) go through ``TestOneInput``, which lets only ``SafetensorError``
  (and ``IndexError`` from indexing, where NumPy raises it too) pass; anything else
  it raises, disagreements between entry points included, fails the test.
* With atheris: the target runs under libFuzzer for 2,000 inputs on a seed corpus
  written into a temporary folder and must exit cleanly.

The same for fuzz/fuzz_ranges.py, the ranged reader against a fetch that lies as a
script says: its seeds and a few thousand random scripts over mutated files, then,
with atheris, 2,000 inputs under libFuzzer.
"""
from __future__ import annotations

import importlib.util
import os
import random
import struct
import subprocess
import sys

import pytest

import fastst
from helpers import libfuzzer_runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "fuzz")
TARGET = os.path.join(FUZZ, "fuzz_load.py")
RANGES_TARGET = os.path.join(FUZZ, "fuzz_ranges.py")
MAX_SEED_SIZE = 4096
MUTATIONS = 2000


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"fastst_fuzz_{name}",
                                                  os.path.join(FUZZ, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus_module():
    return _module("make_corpus")


@pytest.fixture(scope="module")
def seeds(corpus_module):
    found = list(corpus_module.validation_seeds()) + list(corpus_module.saved_seeds())
    return [data for _, data in found if len(data) <= MAX_SEED_SIZE]


TOKENS = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"-", b"0", b"1", b"9", b" ", b"\\",
          b"-0", b"null", b"true", b"1e3", b'"F4"', b'"U8"', b'"shape"', b"\x00", b"\xff",
          b"18446744073709551615", b"9223372036854775808", b"256"]


def _mutate(rng: random.Random, data: bytes, seeds) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randint(0, len(out))
        if op == 0 and out:                                  # flip a bit
            pos = min(pos, len(out) - 1)
            out[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and out:                                # set a byte
            out[min(pos, len(out) - 1)] = rng.randrange(256)
        elif op == 2:                                        # delete a run
            del out[pos:pos + rng.randint(1, 8)]
        elif op == 3:                                        # insert a token
            out[pos:pos] = rng.choice(TOKENS)
        elif op == 4:                                        # overwrite with a token
            token = rng.choice(TOKENS)
            out[pos:pos + len(token)] = token
        elif op == 5 and len(out) >= 8:                      # nudge the length prefix
            (n,) = struct.unpack("<Q", bytes(out[:8]))
            out[:8] = struct.pack("<Q", max(0, min(n + rng.randint(-9, 9), 2**64 - 1)))
        else:                                                # splice with another seed
            other = rng.choice(seeds)
            cut = rng.randint(0, len(other))
            out = out[:pos] + bytearray(other[cut:cut + rng.randint(1, 64)])
    return bytes(out)


def _mutations(target, seeds, rng: random.Random, count: int):
    """Byte-level and header-level mutations, each built on an earlier one now and
    then so that some inputs carry several changes."""
    previous = rng.choice(seeds)
    for _ in range(count):
        base = previous if rng.random() < 0.3 else rng.choice(seeds)
        mutated = None
        if rng.random() < 0.5:
            mutated = target.mutate_structure(base, rng, MAX_SEED_SIZE)
        if mutated is None:
            mutated = _mutate(rng, base, seeds)
        previous = mutated
        yield mutated


def test_target_accepts_seeds_and_mutations_without_atheris(seeds):
    target = _module("fuzz_load")
    rng = random.Random(20240601)
    inputs = list(seeds) + list(_mutations(target, seeds, rng, MUTATIONS))
    failures = []
    for data in inputs:
        try:
            target.TestOneInput(data)
        except Exception as error:   # the target lets only the allowed errors through
            failures.append(f"{type(error).__name__}: {str(error)[:300]}\n    input: {data!r}"[:900])
    assert not failures, (f"{len(failures)} of {len(inputs)} inputs failed; first ones:\n"
                          + "\n".join(failures[:5]))


def test_target_runs_under_libfuzzer(tmp_path, corpus_module):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    written, _ = corpus_module.write_corpus(str(corpus), max_size=MAX_SEED_SIZE)
    assert len(written) > 100
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fastst.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, TARGET, str(corpus), "-runs=2000", "-seed=1", "-max_len=4096",
         "-timeout=5", "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}{os.sep}",
         f"-dict={os.path.join(FUZZ, 'safetensors.dict')}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=120)
    output = result.stdout.decode("utf-8", "replace")
    assert result.returncode == 0, output[-6000:]
    assert libfuzzer_runs(output) >= 2000, output[-3000:]


def _lying_inputs(target, rng: random.Random, count: int):
    """Seeds of the ranged target with random scripts (padding first), their files
    now and then changed as headers."""
    seeds = [data for _, data in target.seeds()]
    for _ in range(count):
        base = rng.choice(seeds)
        file = base[1 + base[0]:]
        script = bytes([rng.randrange(4), rng.randrange(256)]
                       + [rng.randrange(256) for _ in range(rng.randint(0, 40))])
        if rng.random() < 0.5:
            file = target.fuzz_load.mutate_structure(file, rng, MAX_SEED_SIZE) or file
        yield target.joined(script, file)


def test_ranges_target_accepts_seeds_and_lying_scripts_without_atheris():
    target = _module("fuzz_ranges")
    rng = random.Random(20261125)
    inputs = [data for _, data in target.seeds()] + list(_lying_inputs(target, rng, MUTATIONS))
    failures = []
    for data in inputs:
        try:
            target.TestOneInput(data)
        except Exception as error:   # the target lets only the allowed errors through
            failures.append(f"{type(error).__name__}: {str(error)[:300]}\n"
                            f"    input: {data!r}"[:900])
    assert not failures, (f"{len(failures)} of {len(inputs)} inputs failed; first ones:\n"
                          + "\n".join(failures[:5]))


def test_ranges_target_runs_under_libfuzzer(tmp_path):
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(fastst.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, RANGES_TARGET, "--write-seeds", str(corpus)], check=True,
                   env=env, timeout=120)
    result = subprocess.run(
        [sys.executable, RANGES_TARGET, str(corpus), "-runs=2000", "-seed=1", "-max_len=4096",
         "-timeout=5", "-rss_limit_mb=2048", f"-artifact_prefix={tmp_path}{os.sep}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        timeout=120)
    output = result.stdout.decode("utf-8", "replace")
    assert result.returncode == 0, output[-6000:]
    assert libfuzzer_runs(output) >= 2000, output[-3000:]
