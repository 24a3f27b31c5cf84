"""The public API's types, as mypy sees them through the shipped stubs."""
import pathlib
import re

import pytest

mypy_api = pytest.importorskip("mypy.api")

EXAMPLES = pathlib.Path(__file__).parent / "typing" / "examples.py"

ARRAY = "numpy.ndarray[tuple[Any, ...], numpy.dtype[Any]]"
EXPECTED = [
    ARRAY,
    "list[str]",
    "dict[str, str] | None",
    "list[int]",
    "Any",            # a NumPy array, or a torch/jax tensor under those frameworks
    f"dict[str, {ARRAY}]",
    "bytes",
    f"dict[str, {ARRAY}]",
    "fastst._core.SafetensorError",
]


def test_stubs_give_the_public_api_its_types(tmp_path):
    out, err, status = mypy_api.run([
        "--strict", "--no-incremental", "--cache-dir", str(tmp_path), str(EXAMPLES)])
    revealed = re.findall(r'Revealed type is "([^"]+)"', out)
    problems = [line for line in out.splitlines() if ": error:" in line]
    assert problems == []
    assert [r.replace("builtins.", "") for r in revealed] == EXPECTED
