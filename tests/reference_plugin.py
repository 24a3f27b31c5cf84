"""A pytest plugin that records how a run of the reference's own tests went (see
test_reference_suite.py, which passes it with ``-p reference_plugin``): which
``safetensors`` the tests imported, and each test's outcome, written as JSON to the
file FASTST_REFERENCE_OUTCOMES names when the run ends."""
from __future__ import annotations

import json
import os
from typing import Any, Dict

import pytest

OUTCOMES_VARIABLE = "FASTST_REFERENCE_OUTCOMES"
# how much of a failure's report is kept, from its end
REPORT_CHARACTERS = 1500

outcomes: Dict[str, str] = {}
reports: Dict[str, str] = {}


def record(nodeid: str, outcome: str, report: Any) -> None:
    outcomes[nodeid] = outcome
    if outcome in ("failed", "error"):
        reports[nodeid] = report.longreprtext[-REPORT_CHARACTERS:]


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that cannot be imported (a framework missing) is an error of its own."""
    if report.failed:
        record(report.nodeid, "error", report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One outcome a test: its setup's when that failed or skipped, else its call's."""
    if report.when == "setup" and not report.passed:
        record(report.nodeid, "error" if report.failed else "skipped", report)
    elif report.when == "call":
        record(report.nodeid, report.outcome, report)
    elif report.when == "teardown" and report.failed:
        record(report.nodeid, "error", report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import safetensors     # whichever the tests imported: the reference or fastst

    with open(os.environ[OUTCOMES_VARIABLE], "w", encoding="utf-8") as file:
        json.dump({"safetensors": safetensors.__file__, "version": safetensors.__version__,
                   "outcomes": outcomes, "reports": reports}, file, indent=1)
