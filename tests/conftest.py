import ast
import doctest
import functools
import importlib.util
import inspect
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import textwrap
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


@pytest.fixture(autouse=True)
def stores_read_at_the_first_pace() -> None:
    """Each test's stores start at the first pace, not at the level an earlier test's
    store with the same name reached (a bucket, a port used again)."""
    ranged = sys.modules.get("fastst._io.ranged")    # not imported by every test
    if ranged is not None:
        ranged.LEARNED.clear()


@pytest.fixture(scope="module", params=["orjson", "json"])
def json_codec(request):
    """Each JSON codec of fastst._json in turn, for this process and the children it
    starts: orjson, and the standard library's json that a free-threaded build uses."""
    from fastst import _json

    with pytest.MonkeyPatch.context() as patch:
        if request.param == "orjson":
            if not _json.uses_orjson() or not is_installed("orjson"):
                pytest.skip("this interpreter decodes JSON with the standard library")
            orjson = importlib.import_module("orjson")    # not a need of the tests using it
            patch.setattr(_json, "_LOADS", orjson.loads)
            patch.setattr(_json, "_DUMPS", orjson.dumps)
        else:
            patch.setenv("FASTST_JSON", "json")
            patch.setattr(_json, "_LOADS", _json._stdlib_loads)
            patch.setattr(_json, "_DUMPS", _json._stdlib_dumps)
        yield request.param


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
def restore_read_options():
    """The core's read options as they were before the test, whatever it set."""
    before = fastst.read_options()
    yield
    fastst.read_options(**before._asdict())


@pytest.fixture
def docstring_examples(tmp_path, monkeypatch):
    """A runner of a module's docstring examples, (failures, tried), whose temporary
    folders (``tempfile.mkdtemp()``) go under this test's `tmp_path`. A compiled
    module's examples are those of its stubs (``_core/*.pyi``), which the API
    reference documents it from. A class is searched in the module its ``__module__``
    names (the public one that offers it). A docstring whose examples need an optional
    package that is not installed (torch, JAX, dask, fsspec, xxhash) is left out.
    ``...`` in an expected output matches any text."""
    from helpers import missing_frameworks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def run(module):
        for name in getattr(module, "__all__", ()):
            getattr(module, name)    # a lazy name, made an attribute for the finder to see
        stubs = stubs_of(module)
        tests = ([test for stub in stubs for test in stub_doctests(stub)] if stubs is not None
                 else PublicClassFinder().find(module, module.__name__))
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        for test in tests:
            code = "".join(example.source for example in test.examples)
            if test.examples and not missing_frameworks(code):
                runner.run(test)
        return tuple(runner.summarize(verbose=False))

    return run


class PublicClassFinder(doctest.DocTestFinder):
    """doctest's finder, which also takes the methods of a class that names `module`
    as its ``__module__`` though a private module defines them."""

    def _from_module(self, module, object):
        owner, _, member = getattr(object, "__qualname__", "").partition(".")
        offered = getattr(module, owner, None) if member else None
        if isinstance(offered, type) and offered.__module__ == module.__name__:
            return True
        return super()._from_module(module, object)


def stubs_of(module):
    """The ``.pyi`` stubs of a compiled module: those of the folder beside it that is its
    path (``_core/__init__.pyi`` and the stubs it re-exports, by concern), or the one
    stub beside it; None for a Python module."""
    path = module.__file__
    if path.endswith(".py"):
        return None
    folder = getattr(module, "__path__", None)
    if folder:
        return sorted(str(stub) for stub in pathlib.Path(folder[0]).glob("*.pyi"))
    return [os.path.join(os.path.dirname(path), module.__name__.rsplit(".", 1)[-1] + ".pyi")]


def stub_doctests(stub):
    """The examples of every docstring of a stub file (modules', classes', functions'
    and attributes'), each run in a namespace of its own."""
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


# --- the quick check: `pytest -m core` ------------------------------------------------------

TESTS = pathlib.Path(__file__).resolve().parent
# What the `test-core` extra installs beside fastst's own dependencies (import names). A
# test that imports anything else outside the standard library (PyTorch, JAX, dask, moto,
# MkDocs...: minutes to install) is left out of the quick check.
CORE_MODULES = {"numpy", "ml_dtypes", "orjson", "pytest", "_pytest", "hypothesis",
                "safetensors", "xxhash", "mypy", "fsspec", "aiohttp", "fastst"}
# fastst's modules that import a framework when they are imported.
FRAMEWORK_OF_MODULE = {"fastst.torch": "torch", "fastst.flax": "jax", "fastst.jax": "jax",
                       "fastst.dask": "dask"}


def pytest_configure(config):
    config.addinivalue_line("markers", "core: needs only the `test-core` extra (added by "
                            "conftest.py from what a test imports)")
    config.addinivalue_line("markers", "needs(*modules): imports these modules (added by "
                            "conftest.py; a test may also name what it runs indirectly)")


def pytest_report_header(config):
    free = shutil.disk_usage(tempfile.gettempdir()).free
    return (f"fastst {fastst.__version__} from {pathlib.Path(fastst.__file__).parent}, "
            f"numpy {np.__version__}, ml_dtypes {ml_dtypes.__version__}; "
            f"{free / 2**30:.1f} GiB free in {tempfile.gettempdir()}")


def pytest_sessionstart(session):
    """FASTST_TEST_INSTALLED=1: the tests must run against an installed fastst, not the
    checkout beside them (run pytest from another folder, without PYTHONPATH)."""
    if os.environ.get("FASTST_TEST_INSTALLED") == "1" and \
            pathlib.Path(fastst.__file__).resolve().parent == TESTS.parent / "fastst":
        raise pytest.UsageError(f"FASTST_TEST_INSTALLED=1 but fastst is imported from "
                                f"{fastst.__file__}, in the checkout")


def pytest_collection_modifyitems(config, items):
    """Mark each test `needs(...)` with the modules outside the standard library that it
    imports (its module, its body, its fixtures and the test helpers they call), `core`
    when the `test-core` extra has them all, and skip it when one is not installed."""
    for item in items:
        needed = set(modules_needed_by(item))
        for mark in item.iter_markers("needs"):
            needed.update(mark.args)
        if needed:
            item.add_marker(pytest.mark.needs(*sorted(needed)))
        if needed <= CORE_MODULES:
            item.add_marker(pytest.mark.core)
        missing = sorted(name for name in needed if not is_installed(name))
        if missing:
            item.add_marker(pytest.mark.skip(reason=f"needs {', '.join(missing)}"))


class ModuleNotImportable(pytest.Module):
    """A test module whose own imports are not all installed: skipped whole, with the
    reason, rather than an error (the reference, which has no free-threaded wheel)."""

    def collect(self):
        missing = ", ".join(self.missing)
        raise pytest.skip.Exception(f"needs {missing}", allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if not module_path.name.startswith("test_"):
        return None
    tree = ast.parse(module_path.read_text())
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    missing = sorted(name for name in third_party(imported_names(imports))
                     if not is_installed(name))
    if not missing:
        return None
    module = ModuleNotImportable.from_parent(parent, path=module_path)
    module.missing = missing
    return module


@functools.lru_cache(maxsize=None)
def is_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def modules_needed_by(item) -> set:
    needed = set(module_level_imports(item.module.__file__)) if item.module else set()
    functions = [getattr(item, "function", None)]
    for definitions in item._fixtureinfo.name2fixturedefs.values():    # its fixtures
        functions += [definition.func for definition in definitions]
    for function in functions:
        if function is not None:
            needed.update(imports_of_function(inspect.unwrap(function)))
    return needed


def third_party(names) -> set:
    """The top-level names of the modules among `names` that are neither the standard
    library's nor the tests' own; fastst's adapters stand for their framework."""
    found = set()
    for name in names:
        name = FRAMEWORK_OF_MODULE.get(name, name)
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and not (TESTS / f"{top}.py").exists():
            found.add(top)
    return found


def imported_names(nodes) -> list:
    """Modules named by import statements and `pytest.importorskip("...")` calls."""
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            # `from fastst import torch` imports fastst.torch
            names += [f"{node.module}.{alias.name}" for alias in node.names
                      if f"{node.module}.{alias.name}" in FRAMEWORK_OF_MODULE]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant)):
            names.append(node.args[0].value)
    return names


@functools.lru_cache(maxsize=None)
def module_level_imports(filename: str) -> frozenset:
    """What a test file imports outside its functions."""
    tree = ast.parse(pathlib.Path(filename).read_text())
    nodes, pending = [], list(ast.iter_child_nodes(tree))
    while pending:
        node = pending.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            pending.extend(ast.iter_child_nodes(node))
    return frozenset(third_party(imported_names(nodes)))


@functools.lru_cache(maxsize=None)
def imports_of_function(function) -> frozenset:
    """What a function of the tests imports, with the functions of the tests it calls."""
    needed: set = set()
    seen: set = set()
    pending = [function]
    while pending:
        function = pending.pop()
        function = inspect.unwrap(function) if callable(function) else function
        code = getattr(function, "__code__", None)
        if (code is None or function in seen
                or not pathlib.Path(code.co_filename).is_relative_to(TESTS)):
            continue
        seen.add(function)
        nodes = list(ast.walk(ast.parse(textwrap.dedent(inspect.getsource(function)))))
        needed |= third_party(imported_names(nodes))
        called = {node.func.id for node in nodes
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        pending += [function.__globals__.get(name) for name in called]
    return frozenset(needed)
