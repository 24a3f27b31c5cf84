"""The reference's own tests (huggingface safetensors' ``bindings/python/tests``, at the
release whose API the switch reports) through the switch: each test that passes with
the reference passes with fastst served as ``safetensors``, or fails on purpose as
reference_differences.py says and docs/switching.md explains.

They run when FASTST_REFERENCE_TESTS names the folder of the reference's tests, with
the reference installed; ``nox -s reference`` fetches them and runs this file. None of
the reference's code is kept here."""
from __future__ import annotations

import json
import os
import pathlib
import shutil

import pytest

from helpers import switched_python
from reference_differences import DIFFERENCES
from reference_plugin import OUTCOMES_VARIABLE

TESTS = pathlib.Path(__file__).resolve().parent
SWITCHING = TESTS.parent / "docs" / "switching.md"
FOLDER_VARIABLE = "FASTST_REFERENCE_TESTS"
# each run of the reference's tests, with the reference or through the switch
RUN_TIMEOUT = 600


def reference_tests() -> pathlib.Path:
    """The folder of the reference's tests; a skip when there is none."""
    folder = os.environ.get(FOLDER_VARIABLE)
    if not folder:
        pytest.skip(f"{FOLDER_VARIABLE} names no folder of the reference's tests "
                    f"(nox -s reference fetches them)")
    if not (pathlib.Path(folder) / "test_simple.py").is_file():
        pytest.fail(f"{FOLDER_VARIABLE}={folder}: no test_simple.py there")
    return pathlib.Path(folder)


def run_reference_tests(folder: pathlib.Path, work: pathlib.Path, switch: bool) -> dict:
    """Run the reference's tests (a copy of `folder`, as `work`/tests: they write
    their files under ./tests/data) with FASTST_PATCH_SAFETENSORS=1 where `switch`
    and unset otherwise; what reference_plugin.py recorded."""
    shutil.copytree(folder, work / "tests")
    # no settings, as in the reference's checkout, rather than those of a folder above
    (work / "pytest.ini").write_text("[pytest]\n")
    outcomes = work / "outcomes.json"
    code = f"""
    import os, sys
    import pytest
    sys.path.append({str(TESTS)!r})     # reference_plugin, and nothing else of fastst's tests
    os.chdir({str(work)!r})
    os.environ[{OUTCOMES_VARIABLE!r}] = {str(outcomes)!r}
    sys.exit(pytest.main(["tests", "-q", "-p", "reference_plugin", "-p", "no:cacheprovider",
                          "--continue-on-collection-errors"]))
    """
    done = switched_python(code, work / "site", variable="1" if switch else None,
                           timeout=RUN_TIMEOUT)
    assert outcomes.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(outcomes.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """What the reference's tests gave with the reference ("reference") and through the
    switch ("switch")."""
    folder = reference_tests()
    pytest.importorskip("safetensors", reason="the reference gives the tests' baseline")
    return {way: run_reference_tests(folder, tmp_path_factory.mktemp(way), way == "switch")
            for way in ("reference", "switch")}


def passed(run: dict) -> set:
    return {test for test, outcome in run["outcomes"].items() if outcome == "passed"}


def test_the_reference_tests_ran_with_the_reference_and_then_with_fastst(runs):
    import fastst
    import fastst._switch

    served = pathlib.Path(fastst.__file__).parent
    assert pathlib.Path(runs["reference"]["safetensors"]).parent != served
    assert pathlib.Path(runs["switch"]["safetensors"]).parent == served
    assert runs["switch"]["version"] == fastst._switch.REFERENCE_VERSION
    assert runs["reference"]["version"] == fastst._switch.REFERENCE_VERSION, \
        "the installed reference is not the release whose API the switch reports"
    assert len(passed(runs["reference"])) > 50     # not a run whose imports failed


def listed(test: str) -> bool:
    """Whether `test` is in DIFFERENCES, by its id or its file's."""
    return test in DIFFERENCES or test.partition("::")[0] in DIFFERENCES


def test_each_reference_test_that_passes_with_the_reference_passes_through_the_switch(runs):
    failing = sorted(test for test in passed(runs["reference"]) - passed(runs["switch"])
                     if not listed(test))
    reports = {test: (runs["switch"]["outcomes"].get(test, "not run"),
                      runs["switch"]["reports"].get(test, "")) for test in failing}
    assert not failing, "\n\n".join(f"{test}: {outcome}\n{report}"
                                    for test, (outcome, report) in reports.items())


def test_each_listed_difference_still_fails_through_the_switch(runs):
    """A listed test that passes through the switch is no difference any more: its
    entry, and maybe the documentation's, must go."""
    assert not sorted(test for test in passed(runs["reference"]) & passed(runs["switch"])
                      if listed(test))


def test_each_listed_difference_is_one_documented_in_the_switching_page():
    documented = SWITCHING.read_text(encoding="utf-8")
    assert not [test for test, difference in DIFFERENCES.items()
                if not difference.why or not difference.entries
                or any(f"**{entry}**" not in documented for entry in difference.entries)]
