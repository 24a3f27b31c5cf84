"""The documentation's examples run and say what they claim; the docs name no machine."""
import importlib.util
import pathlib
import re
import subprocess

import pytest

import fastst
import fastst._api

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# What an example needs beyond fastst's own dependencies, by what it imports.
FRAMEWORK_OF_IMPORT = {"torch": "torch", "fastst.torch": "torch", "jax": "jax",
                       "fastst.flax": "jax", "fastst.jax": "jax", "fastst.dask": "dask",
                       "dask": "dask", "fsspec": "fsspec"}
INSTALL_COMMANDS = ['pip install . && fastst demo',
                    'pip install -e ".[test]" && python -m pytest']


def test_docstring_examples(docstring_examples):
    failures, tried = docstring_examples(fastst._api)
    assert tried > 0 and failures == 0


def readme_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def missing_frameworks(block):
    imported = re.findall(r"^\s*(?:import|from) ([\w.]+)", block, flags=re.M)
    needed = {FRAMEWORK_OF_IMPORT[name] for name in imported if name in FRAMEWORK_OF_IMPORT}
    return sorted(name for name in needed if importlib.util.find_spec(name) is None)


def run_block(block, namespace):
    exec(compile(block, str(README), "exec"), namespace)


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_fence = text.index("```")
    assert text[first_fence:].startswith("```\n" + "\n".join(INSTALL_COMMANDS) + "\n```\n")
    assert "```" not in text[:first_fence]


def test_ci_runs_the_readme_commands_and_nothing_else():
    script = (ROOT / ".ci" / "run").read_text()
    # It installs nothing itself: whatever it runs comes from README.md.
    assert not re.search(r"\bpip\b|\bpytest\b", script)
    (extract,) = [line for line in script.splitlines() if line.startswith("commands=")]
    done = subprocess.run(["bash", "-c", extract + '\nprintf "%s" "$commands"'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == INSTALL_COMMANDS, done.stderr
    assert subprocess.run(["bash", "-n", ".ci/run"], cwd=ROOT).returncode == 0


def test_readme_has_python_examples():
    assert len(readme_blocks()) >= 7


@pytest.mark.parametrize("number", range(len(readme_blocks())))
def test_readme_block_runs_alone(number, tmp_path, monkeypatch, capsys):
    block = readme_blocks()[number]
    if missing_frameworks(block):
        pytest.skip(f"needs {', '.join(missing_frameworks(block))}")
    monkeypatch.chdir(tmp_path)
    run_block(block, {})


def test_readme_python_examples_run_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in readme_blocks():
        if not missing_frameworks(block):
            run_block(block, namespace)
    assert "exceeds the limit of 64 bytes" in capsys.readouterr().out


MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|tmp)/")


def test_docs_name_no_machine_paths():
    # hidden folders (.git, .venv, caches) and build output hold no docs of ours
    docs = [path for path in ROOT.rglob("*.md")
            if not any(part.startswith(".") or part == "build"
                       for part in path.relative_to(ROOT).parts[:-1])]
    assert README in docs and len(docs) >= 4
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in docs for n, line in enumerate(path.read_text().splitlines(), 1)
             if MACHINE_PATH.search(line)]
    assert found == []


def test_findings_readme_and_skip_names_match_the_findings_folder():
    findings = ROOT / "fuzz" / "findings"
    stems = {path.stem for path in findings.iterdir() if path.suffix in (".safetensors", ".input")}
    assert stems
    for stem in stems:      # each finding: a minimal file and an input for the target
        assert (findings / f"{stem}.safetensors").exists() and (findings / f"{stem}.input").exists()
    readme = (findings / "README.md").read_text()
    assert sorted(set(re.findall(r"`(pread-[\w-]+)`", readme.split("\n## ")[0]))) == sorted(stems)

    spec = importlib.util.spec_from_file_location("fastst_fuzz_target_names",
                                                  ROOT / "fuzz" / "fuzz_load.py")
    target = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(target)
    for name in target.FINDINGS:
        assert any(stem.startswith(name) for stem in stems), name
    for stem in stems:
        assert any(stem.startswith(name) for name in target.FINDINGS), stem


def refused_file_examples():
    """The rows of the README's table of files the reference reads and fastst refuses,
    as files."""
    from helpers import raw_file

    u8 = '{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
    return {
        "a tensor name twice": raw_file('{"a":' + u8 + ',"a":' + u8 + "}", b"ab"),
        "a `__metadata__` key twice": raw_file('{"__metadata__":{"k":"1","k":"2"}}'),
        "a field besides `dtype`, `shape` and `data_offsets`":
            raw_file('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"align":64}}', b"ab"),
        "`__metadata__` set to `null`": raw_file('{"__metadata__":null}'),
        "a tensor entry written as a JSON array": raw_file('{"a":["U8",[2],[0,2]]}', b"ab"),
    }


def test_readme_table_of_refused_files_is_true():
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    text = README.read_text()
    table = text.split("Files that `safetensors` 0.8 reads and fastst refuses", 1)[1]
    table = table.split("\n\n", 2)[1]
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]
    examples = refused_file_examples()
    assert rows == list(examples)
    for row, data in examples.items():
        safetensors_numpy.load(data)
        with pytest.raises(fastst.SafetensorError):
            fastst.load(data)
