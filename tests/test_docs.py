"""The documentation's examples run and say what they claim."""
import doctest
import importlib.util
import pathlib
import re

import pytest

import fastst._api

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_docstring_examples():
    failures, tried = doctest.testmod(fastst._api, raise_on_error=False)
    assert tried > 0 and failures == 0


def readme_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    blocks = readme_blocks()
    assert len(blocks) >= 6
    ran = 0
    for block in blocks:
        frameworks = set(re.findall(r"^\s*(?:import|from) (torch|jax)\b", block, flags=re.M))
        if any(importlib.util.find_spec(name) is None for name in frameworks):
            continue
        exec(compile(block, str(README), "exec"), namespace)
        ran += 1
    assert ran >= 6
    assert "exceeds the limit of 64 bytes" in capsys.readouterr().out
