"""The package is built in layers that import downward only (docs/design.md): every
import of a fastst module, lazy ones included, goes to a module below the importer;
and the facts that once had several homes have one."""
import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fastst"

# Every unit, bottom first: a folder of fastst (a layer), or a module at its top; each
# may import only units before it. The public faces come last.
LAYERS = [
    # JSON, which the core imports
    "_json",
    # core
    "_core",
    # facts
    "_version",
    # where bytes are
    "_io",
    # formats and facts above the core
    "_format",
    # frameworks
    "_frameworks",
    # handles
    "_handles",
    # capabilities
    "checkpoint", "integrity", "writer",
    # API
    "_api",
    # on top
    "numpy", "_data", "data", "state", "dask", "distributed", "torch", "flax", "convert", "_tools", "cli", "_switch",
    "remote", "jax", "__main__", "__init__",
]

# The modules of each layer's folder, bottom first: each may import only those before
# it (and the units below its folder). The convert package is one unit: its modules
# import each other.
FOLDERS = {
    "_io": ["__init__", "limits", "progress", "files", "ranged", "http", "fileobj", "fsspec",
            "upload", "transports", "source"],
    "_format": ["__init__", "blocks", "torch_dtypes", "checksums", "lowlevel", "names", "index"],
    "_frameworks": ["__init__", "cuda", "torch", "jax", "registry", "specs"],
    "_handles": ["__init__", "readahead", "slicing", "prefetch", "meta", "protocols", "handle",
                 "edit"],
    "_data": ["__init__", "rowblocks", "order", "pipeline", "loader"],
    "_tools": ["__init__", "inspect", "demo"],
}


def place_of(path: pathlib.Path):
    """(unit, module within the unit's folder, or None) of a file of fastst."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return (parts[0], parts[1]) if len(parts) > 1 else (parts[0], None)


def imported_places(path: pathlib.Path):
    """(line, unit, module or None) of each fastst module `path` imports, at any depth
    of the code."""
    here = path.relative_to(PACKAGE).parent.parts     # () for fastst/, ("_io",)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".")[1:] or ["__init__"] for alias in node.names
                       if alias.name.split(".")[0] == "fastst"]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "fastst":
                    continue
                base = parts[1:]
            else:
                base = list(here[:len(here) - (node.level - 1)]) + (
                    node.module.split(".") if node.module else [])
            # from . import name, from ._io import ranged: the names may be modules
            names_modules = not base or (len(base) == 1 and base[0] in FOLDERS)
            targets = [base + [alias.name] for alias in node.names] if names_modules else [base]
        else:
            continue
        for unit, *module in targets:
            yield node.lineno, unit, module[0] if module else None


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_tree_shows_the_layers():
    """A few modules at the top (faces, capabilities, the API), the rest in the folders
    of the layers, and the compiled core's sources in its own: two extensions, the
    format core and the loader's ring."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 20, top
    assert set(FOLDERS) <= {path.name for path in PACKAGE.iterdir() if path.is_dir()}
    assert len(FOLDERS) >= 5
    assert [path.name for path in PACKAGE.iterdir()
            if path.suffix in (".pyx", ".pxd", ".pxi", ".h", ".pyi")] == []
    assert sorted(path.name for path in (PACKAGE / "_core").glob("*.pyx")) == [
        "__init__.pyx", "_ring.pyx"]


def test_the_tests_are_in_folders_that_mirror_the_layers():
    """tests/core/ for the compiled core, tests/io/ for fastst/_io/, and so on; what
    stands on several layers (the capabilities, the faces, the docs) at the top."""
    tests = PACKAGE.parent / "tests"
    folders = {path.name for path in tests.iterdir()
               if path.is_dir() and any(path.glob("test_*.py"))}
    assert folders == {"core"} | {folder.lstrip("_") for folder in FOLDERS}


TESTS = PACKAGE.parent / "tests"
# The private units each test folder's tests reach: the layer they test, and the
# compiled core under every layer (its records, counters and read options).
TESTED_BY_FOLDER = {"core": {"_core", "_json"}, "io": {"_io"}, "format": {"_format"},
                    "frameworks": {"_frameworks"}, "handles": {"_handles", "_api"},
                    "data": {"_data"}, "tools": {"_tools"}}
# The tests that reach private units beyond those, and why.
REACHING = {
    "conftest.py": ({"_io", "_json"}, "resets the stores' paces; runs each JSON codec"),
    "conformance.py": ({"_io"}, "the suites every source and transport passes"),
    "ranks.py": ({"_frameworks", "_handles", "_json"},
                 "imports a rank's modules before its bytes are counted"),
    "core/test_shuffle.py": ({"_data"}, "the core's shuffle against the loader's order"),
    "frameworks/test_gpu.py": ({"_handles", "_io"}, "opens a source with a converter alone"),
    "frameworks/test_torch.py": ({"_handles"}, "counts the calls torch's loads make"),
    "handles/test_metadata_edit.py": ({"_io"}, "a crash in the middle of a file's write"),
    "test_checkpoint.py": ({"_handles"}, "a sharded handle satisfies the handle protocols"),
    "test_typing.py": ({"_handles"}, "the protocols, for the type checker"),
    "test_cold_start.py": ({"_data", "_format", "_frameworks", "_handles", "_io"},
                           "names the modules a first call imports"),
    "test_docs.py": ({"_api", "_format", "_frameworks", "_handles", "_io", "_switch"},
                     "runs the examples of the modules that define public names"),
    "test_public_names.py": ({"_api"}, "where the public names are defined"),
    "test_hardening.py": ({"_api"}, "loaded before the memory limit of a hostile read"),
    "test_integrity.py": ({"_format", "_io"}, "the checksum format; the progress bar"),
    "test_convert_cli.py": ({"_io"}, "the progress bar"),
    "test_stream.py": ({"_json"}, "loaded before the memory limit of a write"),
    "test_switch.py": ({"_switch"}, "the switch's own module"),
    "test_reference_suite.py": ({"_switch"}, "the switch's own module"),
}


def private_units_reached(path):
    """The private units of fastst that a test file names (imports, monkeypatch targets)."""
    units = {place_of(module)[0] for module in sources()}
    text = path.read_text()
    named = re.findall(r"fastst\.(_[a-z][a-z_]*)", text) + re.findall(
        r"from fastst import (_[a-z][a-z_]*)", text)
    return {unit for unit in named if unit in units | {"_core"}}


@pytest.mark.parametrize("path", sorted(TESTS.rglob("*.py")),
                         ids=lambda path: str(path.relative_to(TESTS)))
def test_tests_reach_private_modules_only_of_the_layer_they_test(path):
    """A test folder's tests reach the private modules of the layer it mirrors (and the
    core's); any other reach is listed in REACHING with its reason, and each listed
    reach is one the test still makes."""
    name = str(path.relative_to(TESTS))
    folder = path.relative_to(TESTS).parts[0] if len(path.relative_to(TESTS).parts) > 1 else ""
    allowed = {"_core"} | TESTED_BY_FOLDER.get(folder, set())
    listed = REACHING.get(name, (set(), ""))[0]
    reached = private_units_reached(path)
    assert sorted(reached - allowed - listed) == []
    assert sorted(listed - reached) == [], "REACHING lists what the test no longer reaches"


def test_every_module_has_a_layer():
    assert sorted({place_of(path)[0] for path in sources()}) == sorted(set(LAYERS) - {"_core"})
    for folder, modules in FOLDERS.items():
        assert sorted(path.stem for path in (PACKAGE / folder).glob("*.py")) == sorted(modules)


def is_below(target, module, unit, own_module):
    if target != unit:
        return LAYERS.index(target) < LAYERS.index(unit)
    if unit not in FOLDERS or module is None or own_module is None:
        return True     # a unit that is one module, or the convert package
    return FOLDERS[unit].index(module) < FOLDERS[unit].index(own_module)


@pytest.mark.parametrize("path", sources(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_modules_import_only_from_the_layers_below(path):
    unit, own_module = place_of(path)
    upward = [f"line {line}: {target}{'.' + module if module else ''}"
              for line, target, module in imported_places(path)
              if not is_below(target, module, unit, own_module)]
    assert upward == [], f"{path.name} imports modules at or above its own layer"


def code_outside(*allowed):
    for path in sources():
        if str(path.relative_to(PACKAGE)) not in allowed:
            yield path, path.read_text()


def test_only_the_source_module_tells_a_url_from_a_path_or_a_file_object():
    asking = re.compile(r"""is_url|is_remote|URL\.match|["']seek["']|\[A-Za-z\]\[A-Za-z0-9""")
    found = [f"{path.name}: {match.group()}" for path, text in code_outside("_io/source.py")
             for match in asking.finditer(text)]
    assert found == []


def test_one_identity_of_a_file_version():
    defining = re.compile(r"^(?:class|def) \w*(?:[Ss]tamp|Identity|file_changed)\w*",
                          flags=re.M)
    found = [f"{path.name}: {match.group()}" for path, text in code_outside("_io/source.py")
             for match in defining.finditer(text)]
    assert found == []


def test_one_parser_of_the_checkpoint_index():
    parsing = re.compile(r"weight_map[\"']\]|\.get\([\"']weight_map")
    found = [path.name for path, text in code_outside("_format/index.py") if parsing.search(text)]
    assert found == []
