"""The documentation's examples run and say what they claim; the docs name no machine."""
import dataclasses
import functools
import html
import importlib
import importlib.util
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import fastst
from helpers import FRAMEWORK_OF_IMPORT, frameworks_needed, missing_frameworks

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README] + sorted(DOCS.rglob("*.md"))
INSTALL_COMMANDS = ['pip install . && fastst demo',
                    'pip install -e ".[test]" && python -m pytest']


def page_name(page):
    return str(page.relative_to(ROOT))


def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def run_block(block, page, namespace):
    exec(compile(block, str(page), "exec"), namespace)


# each with what it needs marked: conftest.py skips it when that is missing
BLOCKS = [pytest.param(page, number, marks=pytest.mark.needs(*frameworks_needed(block)),
                       id=f"{page_name(page)}-{number}")
          for page in PAGES for number, block in enumerate(python_blocks(page))]


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


def test_readme_is_short_and_has_an_example():
    assert len(README.read_text().splitlines()) <= 150
    assert len(python_blocks(README)) >= 1


def test_readme_links_lead_somewhere():
    """README.md's links to the docs, which GitHub shows as they are."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) >= 15
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_every_guide_page_has_examples():
    guide = sorted((DOCS / "guide").glob("*.md"))
    assert len(guide) >= 12
    assert [page_name(page) for page in guide if not python_blocks(page)] == []


@pytest.mark.parametrize("page, number", BLOCKS)
def test_doc_block_runs_alone(page, number, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_block(python_blocks(page)[number], page, {})


PAGES_WITH_BLOCKS = [page for page in PAGES if python_blocks(page)]


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=map(page_name, PAGES_WITH_BLOCKS))
def test_doc_page_examples_run_in_order(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    ran = 0
    for block in python_blocks(page):
        if not missing_frameworks(block):
            run_block(block, page, namespace)
            ran += 1
    if ran == 0:
        pytest.skip("every example needs a framework that is not installed")
    if page == DOCS / "guide" / "reading.md":
        assert "exceeds the limit of 64 bytes" in capsys.readouterr().out


def test_install_lines_install_from_the_checkout():
    """fastst installs from its checkout: `pip install ".[remote]"`, never a name that
    pip would look up in a package index."""
    wrong = [f"{page_name(page)}: {line.strip()}" for page in PAGES
             for line in page.read_text().splitlines()
             if re.search(r"pip install(?:\s+-\S+)*\s+[\"']?fastst\b", line)
             or re.search(r"fastst\[\w", line)]
    assert wrong == []


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
    """The rows of the table of files the reference reads and fastst refuses
    (docs/switching.md), as files."""
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


def test_table_of_refused_files_is_true():
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    text = (DOCS / "switching.md").read_text()
    table = text.split("Files that `safetensors` 0.8 reads and fastst refuses", 1)[1]
    table = table.split("\n\n", 2)[1]
    rows = [line.split(" | ")[0].lstrip("| ") for line in table.splitlines()[2:]]
    examples = refused_file_examples()
    assert rows == list(examples)
    for row, data in examples.items():
        safetensors_numpy.load(data)
        with pytest.raises(fastst.SafetensorError):
            fastst.load(data)


# --- the site ----------------------------------------------------------------------------

def build_site(config, site, timeout=300):
    """`mkdocs build --strict` of `config` into `site`, from the checkout's root (where
    the snippets' paths start)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(config), "--site-dir", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.needs("mkdocs")
def test_site_builds_strict(tmp_path):
    done = build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    reference = (tmp_path / "site" / "reference" / "fastst" / "index.html").read_text()
    assert 'id="fastst.safe_open"' in reference and 'id="fastst.SafetensorError"' in reference
    benchmarks = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "Produced by <code>python bench/run.py" in benchmarks     # RESULTS.md, included
    assert benchmarks.count('src="../img/bench/') == len(list((DOCS / "img" / "bench").glob("*.svg")))


FAULTS = {
    "a link to a missing page": ("[gone](missing.md)", "missing.md"),
    "a link to a missing heading": ("[gone](#no-such-heading)", "no-such-heading"),
    "a reference to a missing name": ("::: fastst.no_such_name", "fastst.no_such_name"),
}


@pytest.mark.needs("mkdocs")
@pytest.mark.parametrize("fault", FAULTS)
def test_strict_build_fails_on(fault, tmp_path):
    yaml = pytest.importorskip("yaml")
    text, named = FAULTS[fault]
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# A page\n\n{text}\n")
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}], extra_css=[])
    python = config["plugins"][-1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(ROOT)]
    python["options"]["extensions"] = site_extensions()
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and named in done.stderr, done.stderr


# The modules that define the public names (or, for the compiled core, its stub that
# documents them), and the public modules whose own docstrings show examples: every
# example in them runs, those needing a package that is not installed left out.
DOCSTRING_MODULES = ["fastst", "fastst._api", "fastst._core", "fastst._handles.edit",
                     "fastst._format.checksums", "fastst._format.index", "fastst._format.lowlevel",
                     "fastst._format.names", "fastst._frameworks.jax", "fastst._frameworks.specs",
                     "fastst._frameworks.torch", "fastst._handles.handle", "fastst._io.files",
                     "fastst._io.fsspec", "fastst._io.ranged", "fastst._io.transports",
                     "fastst._io.upload", "fastst._handles.readahead", "fastst._switch",
                     "fastst.checkpoint", "fastst.dask", "fastst.data", "fastst.distributed",
                     "fastst.flax", "fastst.integrity", "fastst.jax", "fastst.numpy",
                     "fastst.remote", "fastst.state", "fastst.torch", "fastst.writer"]
OPTIONAL = ["dask", "fsspec", "jax", "torch", "xxhash"]
# the reference pages whose names are documented, examples and all
DOCUMENTED_MODULES = ["fastst", "fastst.numpy", "fastst.torch", "fastst.flax", "fastst.jax",
                      "fastst.writer", "fastst.checkpoint", "fastst.integrity", "fastst.remote",
                      "fastst.state", "fastst.data", "fastst.dask", "fastst.distributed"]
# classes made on first use of their name (where their framework is installed)
MADE_ON_USE = {"fastst.data": ["RowDataset"]}


@pytest.mark.parametrize("module", DOCSTRING_MODULES)
def test_docstring_examples_run(module, docstring_examples):
    # fastst.torch without torch raises an ImportError that says how to install it
    imported = pytest.importorskip(module, exc_type=ImportError)
    for name in MADE_ON_USE.get(module, []):
        if importlib.util.find_spec("torch") is not None:
            getattr(imported, name)
    failures, tried = docstring_examples(imported)
    missing = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    if tried == 0 and missing:
        pytest.skip(f"every example needs one of {', '.join(missing)}")
    assert tried > 0 and failures == 0


def test_the_examples_of_every_public_name_run():
    """Each public function and class is defined in a module whose examples run (the
    compiled core's: in its stub)."""
    defined_in = set()
    for module in DOCUMENTED_MODULES:
        framework = FRAMEWORK_OF_IMPORT.get(module)
        if framework is not None and importlib.util.find_spec(framework) is None:
            continue
        imported = importlib.import_module(module)
        defined_in |= {getattr(imported, name).__module__ for name in imported.__all__
                       if callable(getattr(imported, name))}
    assert defined_in - {"builtins"} <= set(DOCSTRING_MODULES)


REFERENCE_PAGES = {"fastst": "fastst", "fastst.numpy": "numpy", "fastst.torch": "torch",
                   "fastst.flax": "flax", "fastst.jax": "jax", "fastst.writer": "writer",
                   "fastst.checkpoint": "checkpoint", "fastst.integrity": "integrity",
                   "fastst.remote": "remote", "fastst.state": "state", "fastst.data": "data",
                   "fastst.dask": "dask", "fastst.convert": "convert",
                   "fastst.distributed": "distributed"}


@pytest.mark.parametrize("module", [
    pytest.param(module, marks=pytest.mark.needs(FRAMEWORK_OF_IMPORT[module]))
    if module in FRAMEWORK_OF_IMPORT else module for module in REFERENCE_PAGES])
def test_api_reference_documents_every_public_name(module):
    """Each public name, by its public path: modules may move inside the package."""
    public = [name for name in importlib.import_module(module).__all__
              if not (module == "fastst" and name in ("numpy", "writer"))]  # pages of their own
    page = (DOCS / "reference" / f"{REFERENCE_PAGES[module]}.md").read_text()
    documented = re.findall(rf"^::: {re.escape(module)}\.(\w+)$", page, flags=re.M)
    assert sorted(documented) == sorted(public)
    assert re.search(rf"^::: {re.escape(module)}$", page, flags=re.M)    # the module's own doc


def site_extensions():
    """The griffe extensions that mkdocs.yml builds the reference pages with."""
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    options = config["plugins"][-1]["mkdocstrings"]["handlers"]["python"]["options"]
    return [str(ROOT / path) for path in options.get("extensions", [])]


@functools.lru_cache(maxsize=None)
def reference_package():
    """fastst as the API reference reads it: from the sources and the core's stub, not
    by import, through the site's griffe extensions."""
    griffe = pytest.importorskip("griffe")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT)], allow_inspection=False,
                                 docstring_parser=griffe.Parser("numpy"),
                                 extensions=griffe.load_extensions(*site_extensions()))
    package = loader.load("fastst")
    loader.resolve_aliases(implicit=True)
    return package


def reference_objects(module):
    """(public path, griffe object) of each public name of `module`."""
    package = reference_package()
    found = package if module == "fastst" else package[module.removeprefix("fastst.")]
    return [(f"{module}.{name}", found[name]) for name in importlib.import_module(module).__all__
            if not (module == "fastst" and name in ("numpy", "writer"))]


@pytest.mark.parametrize("module", DOCUMENTED_MODULES)
def test_every_public_name_has_a_numpydoc_docstring_with_examples(module):
    """Each public function and class: a summary, its parameters, what it returns (or
    yields), and examples (which test_docstring_examples_run runs); each constant: a
    docstring of its own; each public method and property of a class: a docstring."""
    if module in FRAMEWORK_OF_IMPORT and importlib.util.find_spec(FRAMEWORK_OF_IMPORT[module]) is None:
        pytest.skip(f"needs {FRAMEWORK_OF_IMPORT[module]}")
    from griffe import DocstringSectionKind as Kind

    missing = []
    for path, found in reference_objects(module):
        if found.docstring is None:
            missing.append(f"{path}: no docstring")
            continue
        kinds = {section.kind for section in found.docstring.parsed}
        if found.is_attribute:
            continue
        if Kind.examples not in kinds:
            missing.append(f"{path}: no Examples")
        if found.is_function:
            if any(p.name not in ("self", "cls") for p in found.parameters) \
                    and Kind.parameters not in kinds:
                missing.append(f"{path}: no Parameters")
            if str(found.returns) != "None" and not kinds & {Kind.returns, Kind.yields}:
                missing.append(f"{path}: no Returns")
        if found.is_class:
            missing += [f"{path}.{name}: no docstring" for name, member in found.members.items()
                        if not name.startswith("_") and (member.is_function or "property" in
                                                         member.labels)
                        and member.docstring is None]
    assert missing == []


def documented_callables(page):
    """(path, griffe object, runtime object, owner) of each function and class that
    `page` renders (``::: fastst...``), and of each public method of those classes
    (`owner`: its class, None for the others); a module whose framework is not
    installed is left out."""
    package = reference_package()
    for path in re.findall(r"^::: (fastst\.[\w.]+)$", page.read_text(), flags=re.M):
        found = package[path.removeprefix("fastst.")]
        if not (found.is_function or found.is_class):
            continue
        module, _, name = path.rpartition(".")
        try:
            runtime = getattr(importlib.import_module(module), name)
        except ImportError:
            continue
        yield path, found, runtime, None
        for member_name, member in (found.all_members.items() if found.is_class else ()):
            if not member_name.startswith("_") and member.is_function \
                    and "property" not in member.labels:
                yield (f"{path}.{member_name}", member,
                       inspect.getattr_static(runtime, member_name, None), runtime)


def shown_parameters(found, method, namespace):
    """(name, kind, default) of each parameter a page shows for `found` (a class's are
    its __init__'s), self and cls left out; a default as written, evaluated in
    `namespace`."""
    parameters = list(found.parameters)
    if (found.is_class or method and "staticmethod" not in found.labels) and parameters:
        parameters = parameters[1:]
    return [(p.name, p.kind.value, inspect.Parameter.empty if p.default is None
             else eval(str(p.default), dict(namespace))) for p in parameters]


def called_parameters(runtime, method):
    """(name, kind, default) of each parameter Python calls `runtime` with, self and
    cls left out (a dataclass field's default: what its factory makes); None when
    Python cannot tell (a class built into the core)."""
    function = runtime.__func__ if isinstance(runtime, (classmethod, staticmethod)) else runtime
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return None
    if method and not isinstance(runtime, staticmethod):
        parameters = parameters[1:]
    made = {field.name: field.default_factory() for field in dataclasses.fields(runtime)
            if field.default_factory is not dataclasses.MISSING} \
        if dataclasses.is_dataclass(runtime) else {}
    return [(p.name, p.kind.description, made.get(p.name, p.default)) for p in parameters]


def signature_errors(path, shown, called):
    """How the parameters a page shows differ from those Python calls with."""
    if [(name, kind) for name, kind, _ in shown] != [(name, kind) for name, kind, _ in called]:
        return [f"{path}: shows {shown}, is called with {called}"]
    return [f"{path}: {name} shows the default {a!r}, has {b!r}"
            for (name, kind, a), (_, _, b) in zip(shown, called)
            if not kind.startswith("variadic")     # *args and **kwargs show no default
            and not (a is b or type(a) is type(b) and a == b)]


def defining_namespace(runtime, owner):
    """The globals of the module whose code defines `runtime` (a function, a class or
    a member of `owner`), where its defaults' names are found: a public class names
    the public module that offers it, not the one that defines it."""
    for candidate in (runtime, getattr(runtime, "__init__", None), getattr(runtime, "fget", None),
                      getattr(runtime, "__func__", None)):
        if hasattr(candidate, "__globals__"):
            return candidate.__globals__
    return vars(sys.modules[(owner or runtime).__module__])


@pytest.mark.parametrize("page", sorted(REFERENCE_PAGES.values()))
def test_every_reference_signature_is_the_one_python_calls(page):
    """Each documented function, class and method shows the parameters that Python
    calls it with: their names, kinds and defaults, as ``inspect.signature`` gives
    them."""
    wrong, compared = [], 0
    for path, found, runtime, owner in documented_callables(DOCS / "reference" / f"{page}.md"):
        if runtime is None:
            wrong.append(f"{path}: not found at run time")
            continue
        called = called_parameters(runtime, owner is not None)
        if called is None:
            continue
        namespace = defining_namespace(runtime, owner)
        wrong += signature_errors(path, shown_parameters(found, owner is not None, namespace),
                                  called)
        compared += 1
    assert compared and wrong == []


def test_every_reference_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert sorted(re.findall(r"reference/(\w+)\.md", nav)) == sorted(REFERENCE_PAGES.values())


# --- the benchmark charts ----------------------------------------------------------------

def bench_charts():
    """bench/charts.py (its parsing and labels; drawing needs matplotlib, not imported)."""
    name = "fastst_bench_charts"
    if name not in sys.modules:     # registered first: its dataclass looks itself up there
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "charts.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.needs("markdown")     # the anchors of the headings, as MkDocs makes them
def test_benchmarks_page_shows_a_chart_of_each_ratio_table():
    charts = bench_charts()
    tables = charts.ratio_tables((ROOT / "bench" / "RESULTS.md").read_text())
    assert len(tables) >= 20
    drawn = sorted(path.name for path in (DOCS / "img" / "bench").glob("*.svg"))
    assert drawn == sorted(f"{table.name}.svg" for table in tables)
    page = (DOCS / "benchmarks.md").read_text()
    assert charts.gallery(tables) in page
    # the page includes RESULTS.md from its second line: the first is its title
    assert '--8<-- "bench/RESULTS.md:2:"' in page
    assert (ROOT / "bench" / "RESULTS.md").read_text().startswith("# ")


def test_charts_show_the_ratios_of_results_md():
    """A chart redrawn after its table changed: every ratio of the table is written on
    its chart, as ``python bench/charts.py`` writes it."""
    charts = bench_charts()
    for table in charts.ratio_tables((ROOT / "bench" / "RESULTS.md").read_text()):
        svg = (DOCS / "img" / "bench" / f"{table.name}.svg").read_text()
        texts = [html.unescape(text).strip() for text in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]
        expected = [charts.value_label(table, row, column)
                    for column in table.ratio_columns for row in table.rows]
        missing = [label for label in expected if label not in texts]
        assert missing == [], table.name


# --- the drop-in tables ------------------------------------------------------------------

def drop_in_rows(page):
    """(safetensors import, fastst import) of each row of a page's table of imports."""
    return re.findall(r"^\| `(from safetensors[^`]*)` \| `(from fastst[^`]*)` \|$",
                      page.read_text(), flags=re.M)


@pytest.mark.parametrize("page", [README, DOCS / "switching.md"], ids=page_name)
def test_drop_in_tables_name_what_each_side_has(page):
    rows = drop_in_rows(page)
    assert len(rows) >= 4
    for reference, ours in rows:
        if missing_frameworks(ours):        # fastst.torch, safetensors.torch: torch...
            continue
        for statement in (reference, ours):
            module, names = re.fullmatch(r"from ([\w.]+) import (.+)", statement).groups()
            if module.startswith("safetensors"):
                pytest.importorskip("safetensors")
            imported = importlib.import_module(module)
            assert all(hasattr(imported, name.strip()) for name in names.split(",")), statement
