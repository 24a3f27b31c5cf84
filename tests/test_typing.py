"""The public API's types, as mypy sees them: revealed types of correct calls,
and errors on wrong ones. One mypy run checks every file (mypy reads torch's
and JAX's own types, which takes a while)."""
import importlib.util
import pathlib
import re

import pytest

mypy_api = pytest.importorskip("mypy.api")

HERE = pathlib.Path(__file__).parent / "typing"
EXAMPLES, FRAMEWORKS, MUST_FAIL = (HERE / name for name in
                                   ("examples.py", "frameworks.py", "must_fail.py"))
HAVE_FRAMEWORKS = all(importlib.util.find_spec(name) for name in ("torch", "jax"))
needs_frameworks = pytest.mark.needs("torch", "jax")    # conftest.py skips without them

ARRAY = "numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]]"
TENSOR = "torch._tensor.Tensor"
JAX_ARRAY = "jax._src.basearray.Array"
# how mypy spells fastst.state.State[leaf], down to its first nested level
STATE_OF = ("{leaf} | None | int | float | str | bytes | dict[None | bool | int | float | "
            "str | bytes, {leaf} | None | bool | int | float | str | bytes | dict[")


LEAVES = (ARRAY, TENSOR, "Any")


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory):
    """mypy's output lines, by the file they are about."""
    files = [EXAMPLES] + ([FRAMEWORKS, MUST_FAIL] if HAVE_FRAMEWORKS else [])
    out, _, _ = mypy_api.run(["--strict", "--no-incremental", "--show-error-codes",
                              "--cache-dir", str(tmp_path_factory.mktemp("mypy")),
                              *map(str, files)])
    report = {}
    for line in out.splitlines():
        path = line.split(":", 1)[0]
        report.setdefault(pathlib.Path(path).name, []).append(line)
    return report


def revealed(lines):
    found = [re.search(r'Revealed type is "([^"]+)"', line) for line in lines]
    # NumPy's stubs spelled the shape of an NDArray Any (2.0, 2.1), then tuple[int, ...]
    types = [re.sub(r"ndarray\[(?:Any|tuple\[int, \.\.\.\]),", "ndarray[tuple[Any, ...],",
                    match.group(1).replace("builtins.", ""))
             for match in found if match]
    # a state's type nests without end: its first level says what it is
    return [next((state for state in (STATE_OF.format(leaf=leaf) for leaf in LEAVES)
                  if revealed_type.startswith(state)), revealed_type)
            for revealed_type in types]


def errors(lines):
    return [line for line in lines if ": error:" in line]


def test_fastst_itself_type_checks(mypy_report):
    checked = {EXAMPLES.name, FRAMEWORKS.name, MUST_FAIL.name, "Success"}
    assert [line for name, lines in mypy_report.items() if name not in checked
            for line in lines if not line.startswith("Found ")] == []


def test_numpy_api_types(mypy_report):
    lines = mypy_report.get("examples.py", [])
    assert errors(lines) == []
    assert revealed(lines) == [
        ARRAY,
        "list[str]",
        "dict[str, Any] | None",
        "list[int]",
        ARRAY,
        "list[int]",
        "fastst._handles.protocols.ArrayHandle",
        f"dict[str, {ARRAY}]",
        "bytes",
        f"dict[str, {ARRAY}]",
        "fastst._core.SafetensorError",
        "fastst._handles.protocols.ArrayHandle",
        ARRAY,
        # a framework held in a str, and the frameworks without types of their own
        "fastst._handles.protocols.Handle[Any]",
        "Any",
        "fastst._handles.protocols.Handle[Any]",      # _safe_open_handle
        f"dict[str, {ARRAY}]",            # fastst.numpy.load
        "list[str]",                      # isinstance(opened, fastst.safe_open)
        STATE_OF.format(leaf=ARRAY),       # load_state: a tree of arrays and scalars
        STATE_OF.format(leaf="Any"),
    ]


@needs_frameworks
def test_framework_handles_give_framework_types(mypy_report):
    lines = mypy_report.get("frameworks.py", [])
    assert errors(lines) == []
    assert revealed(lines) == [
        f"fastst._handles.protocols.Handle[{TENSOR}]",
        TENSOR,
        TENSOR,
        f"dict[str, {TENSOR}]",
        "list[str]",
        JAX_ARRAY,
        JAX_ARRAY,
        TENSOR,
        f"dict[str, {TENSOR}]",
        f"dict[str, {JAX_ARRAY}]",
        "dict[str, torch._C.dtype | None]",
        STATE_OF.format(leaf=TENSOR),
        "tuple[set[str], list[str]]",
        "fastst.data.RowDataset",
        "torch.utils.data.dataloader.DataLoader[Any]",
        "torch.utils.data.sampler.BatchSampler",
    ]


@needs_frameworks
def test_wrong_calls_are_type_errors(mypy_report):
    source = MUST_FAIL.read_text().splitlines()
    marked = {number for number, text in enumerate(source, 1) if text.endswith("# error")}
    reported = {int(line.split(":")[1]) for line in errors(mypy_report.get("must_fail.py", []))}
    assert len(marked) == 9
    assert reported == marked
