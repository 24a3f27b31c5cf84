import ast
import os
import subprocess
import sys
import tempfile
import threading
import time

import ml_dtypes
import numpy as np
import pytest

import fastst

# JAX on a GPU takes most of its memory at first use unless told not to: leave it to torch
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def numpy_dtype_named(name: str) -> np.dtype:
    """The NumPy dtype of a `fastst.DTYPES` row's `numpy` name (ml_dtypes' or NumPy's)."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


# Every NumPy dtype that has a safetensors code, with that code: the codes of whole
# bytes (sub-byte codes surface as packed uint8 and cannot be written from NumPy).
WRITABLE_DTYPES = {row.code: numpy_dtype_named(row.numpy)
                   for row in fastst.DTYPES if row.bits >= 8}


def random_array(rng: np.random.Generator, dtype: np.dtype, shape) -> np.ndarray:
    """An array of `dtype` filled with random bit patterns (NaNs and all)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    if dtype == np.bool_:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bit patterns (NaN-safe)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def mapping_ranges(path) -> list:
    """[start, end) address ranges where `path` is mapped in this process."""
    target = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def modules_loaded_by(statements: str, modules) -> list:
    """Which of `modules` a fresh interpreter has imported after running
    `statements` (sorted)."""
    code = (f"import sys; {statements}; "
            f"print(sorted(m for m in {tuple(modules)!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return ast.literal_eval(done.stdout.strip())


def cpu_beside(work) -> tuple:
    """Run `work()` while another thread counts in a loop; return (the CPU seconds of
    `work`'s thread, the CPU seconds the other thread had meanwhile). The other thread
    runs only while it holds the GIL: beside a call that holds the GIL throughout it
    gets next to nothing; beside one that lets it go, the scheduler gives both threads
    like shares of the processors, however busy the machine (CPU time, not the clock)."""
    started, done, other_cpu = threading.Event(), threading.Event(), [0.0]

    def other():
        started.set()
        begin = time.thread_time()
        while not done.is_set():
            pass
        other_cpu[0] = time.thread_time() - begin

    thread = threading.Thread(target=other)
    thread.start()
    started.wait()
    begin = time.thread_time()
    try:
        work()
    finally:
        work_cpu = time.thread_time() - begin
        done.set()
        thread.join()
    return work_cpu, other_cpu[0]


@pytest.fixture
def docstring_examples(tmp_path, monkeypatch):
    """A runner of a module's docstring examples, (failures, tried), whose temporary
    folders (``tempfile.mkdtemp()``) go under this test's `tmp_path`."""
    import doctest

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda module: tuple(doctest.testmod(module, raise_on_error=False))
