"""Reproduce the findings of fuzz/fuzz_load.py with explicit calls.

Each case opens a small file with both backends and compares
``get_slice(name)[index]`` with ``get_tensor(name)[index]``, the result the
``SafeSlice`` documentation promises. Run: ``python fuzz/findings/reproduce.py``.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

import fastst

HERE = os.path.dirname(os.path.abspath(__file__))

# (input file in this folder, tensor name, index)
CASES = [
    ("pread-packed-1d.safetensors", "p", slice(None)),
    ("pread-packed-flat.safetensors", "p", slice(None)),
    ("pread-narrow-index-array.safetensors", "a", np.array([1], dtype=np.uint8)),
    ("pread-narrow-index-array.safetensors", "a", np.array([-1], dtype=np.int8)),
    ("pread-unrepresentable-zero-rows.safetensors", "a", slice(None)),
    ("pread-unrepresentable-huge-rows.safetensors", "a", -1),
    ("pread-unrepresentable-huge-rows.safetensors", "a", np.array([0])),
    ("pread-unrepresentable-huge-rows.safetensors", "a", 0),
    ("pread-unrepresentable-intp-overflow.safetensors", "a", 0),
    ("pread-unrepresentable-65-dims.safetensors", "a", 0),
]


def outcome(call, path):
    try:
        result = call()
    except Exception as error:  # every outcome is shown, whatever its type
        text = f"{type(error).__name__}: {error}".replace(path, "<file>")
        return text if len(text) <= 110 else text[:107] + "..."
    return f"array {result.dtype}{list(result.shape)} {result.tobytes()[:16]!r}"


def main() -> None:
    for filename, name, index in CASES:
        path = os.path.join(HERE, filename)
        print(f"{filename}  [{name!r}][{index!r}]")
        for backend in ("mmap", "pread"):
            with fastst.safe_open(path, framework="np", backend=backend) as f:
                whole = outcome(lambda: f.get_tensor(name)[index], path)
                sliced = outcome(lambda: f.get_slice(name)[index], path)
            mark = "  " if whole == sliced else "!!"
            print(f"  {mark} {backend:5}  get_tensor()[i]: {whole}")
            print(f"  {mark} {'':5}  get_slice()[i]:  {sliced}")


if __name__ == "__main__":
    main()
