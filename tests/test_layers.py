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
