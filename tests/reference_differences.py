"""The reference's own tests that fail through the switch on purpose, each with why:
test_reference_suite.py runs the reference's tests with the reference and through the
switch, and every test that passes with the reference must pass through the switch
unless it is listed here. Each entry names the entries of docs/switching.md ("What
differs") that document the difference, by their words in bold."""
from __future__ import annotations

from typing import Dict, NamedTuple, Tuple


class Difference(NamedTuple):
    why: str
    # the bold words that start each entry of docs/switching.md about it
    entries: Tuple[str, ...]


# framework modules the switch does not serve: their tests import them
MISSING_MODULE = Difference(
    "it imports a module of the reference for a framework fastst has no module for; "
    "under the switch that import raises ModuleNotFoundError",
    ("No `safetensors.tensorflow`, `.paddle` or `.mlx` under the switch.",))

# a test's id, as pytest names it from the folder above the reference's tests/, or a
# test file's, for each of its tests -> why
DIFFERENCES: Dict[str, Difference] = {
    "tests/test_tf_comparison.py": MISSING_MODULE,
    "tests/test_paddle_comparison.py": MISSING_MODULE,
    "tests/test_mlx_comparison.py": MISSING_MODULE,
    "tests/test_simple.py::ReadmeTestCase::test_numpy_slice": Difference(
        "it compares whole messages of index errors, which fastst's start with and then "
        "name the tensor and the file; and it expects errors where fastst slices as NumPy "
        "does: a list of rows is taken, a slice past the end is cut short",
        ("Errors.", "Slices follow NumPy.")),
    "tests/test_pt_comparison.py::SliceTestCase::test_cannot_serialize_a_non_contiguous_tensor":
        Difference("fastst.torch.save_file writes a non-contiguous tensor as its "
                   "C-ordered data, where the reference raises a ValueError",
                   ("Non-contiguous tensors are saved.",)),
    "tests/test_pt_model.py::TorchModelTestCase::test_workaround_non_contiguous": Difference(
        "save_model(..., force_contiguous=False) writes a non-contiguous tensor as its "
        "C-ordered data, where the reference raises a ValueError",
        ("Non-contiguous tensors are saved.",)),
}
