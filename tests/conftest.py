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


def time_with_longest_pause(work) -> tuple:
    """Run `work()` while another thread ticks; return (seconds `work` took, the
    longest the ticking thread was kept waiting). A call that holds the GIL
    throughout shows a pause as long as itself."""
    done, longest = threading.Event(), [0.0]

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    try:
        work()
    finally:
        elapsed = time.perf_counter() - start
        done.set()
        thread.join()
    return elapsed, longest[0]


@pytest.fixture
def docstring_examples(tmp_path, monkeypatch):
    """A runner of a module's docstring examples, (failures, tried), whose temporary
    folders (``tempfile.mkdtemp()``) go under this test's `tmp_path`. A compiled
    module's examples are those of the stub beside it (``_core.pyi``), which the API
    reference documents it from. A docstring whose examples need an optional package
    that is not installed (torch, JAX, dask, fsspec, xxhash) is left out. ``...`` in
    an expected output matches any text."""
    import doctest

    from helpers import missing_frameworks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def run(module):
        stub = stub_of(module)
        tests = (stub_doctests(stub) if stub is not None
                 else doctest.DocTestFinder().find(module, module.__name__))
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in tests:
            code = "".join(example.source for example in test.examples)
            if test.examples and not missing_frameworks(code):
                runner.run(test)
        return tuple(runner.summarize(verbose=False))

    return run


def stub_of(module):
    """The ``.pyi`` stub beside a compiled module; None for a Python module."""
    path = module.__file__
    if path.endswith(".py"):
        return None
    return os.path.join(os.path.dirname(path), module.__name__.rsplit(".", 1)[-1] + ".pyi")


def stub_doctests(stub):
    """The examples of every docstring of a stub file (modules', classes', functions'
    and attributes'), each run in a namespace of its own."""
    import doctest
    import inspect

    with open(stub, encoding="utf-8") as file:
        text = file.read()
    parser = doctest.DocTestParser()
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            test = parser.get_doctest(inspect.cleandoc(node.value.value), {},
                                      f"{os.path.basename(stub)}:{node.lineno}", stub,
                                      node.lineno)
            if test.examples:
                yield test
