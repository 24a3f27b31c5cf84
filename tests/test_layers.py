"""The package is built in layers that import downward only (docs/design.md): every
import of a fastst module, lazy ones included, goes to a module below the importer;
and the facts that once had several homes have one."""
import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fastst"

# Every module, bottom first: each may import only modules before it. The convert
# package is one unit (its modules import each other); the package face comes last.
LAYERS = [
    # JSON, which the core imports
    "_json",
    # core
    "_core",
    # facts
    "_version", "_limits", "_progress", "_blocks", "_slicing", "_files", "_checksums",
    "_torch_dtypes",
    # where bytes are
    "_ranged", "_http", "remote", "_source", "_readahead",
    # formats
    "_lowlevel", "_index",
    # frameworks
    "_cuda", "_torch_adapter", "jax", "_adapters",
    # handles
    "_specs", "_prefetch", "_handle", "_edit",
    # capabilities
    "checkpoint", "integrity", "writer",
    # API
    "_api",
    # on top
    "numpy", "_rowblocks", "_order", "_pipeline", "_loader", "data", "state", "dask", "distributed", "torch", "flax", "convert", "_inspect", "_demo", "cli", "_switch",
    "__main__", "__init__",
]


def unit_of(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_units(path: pathlib.Path):
    """(line, unit) of each fastst module `path` imports, at any depth of the code."""
    here = path.relative_to(PACKAGE).parent.parts     # () for fastst/, ("convert",)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "fastst":
                    yield node.lineno, parts[1] if len(parts) > 1 else "__init__"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "fastst":
                    continue
                base = parts[1:]
            else:
                base = list(here[:len(here) - (node.level - 1)]) + (
                    node.module.split(".") if node.module else [])
            if base:
                yield node.lineno, base[0]
            else:     # from . import name: the modules named
                for alias in node.names:
                    yield node.lineno, alias.name


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer():
    assert sorted({unit_of(path) for path in sources()}) == sorted(set(LAYERS) - {"_core"})


@pytest.mark.parametrize("path", sources(), ids=lambda path: str(path.relative_to(PACKAGE)))
def test_modules_import_only_from_the_layers_below(path):
    unit = unit_of(path)
    upward = [f"line {line}: {target}" for line, target in imported_units(path)
              if target != unit and LAYERS.index(target) >= LAYERS.index(unit)]
    assert upward == [], f"{path.name} imports modules at or above its own layer"


def code_outside(*allowed):
    for path in sources():
        if path.name not in allowed:
            yield path, path.read_text()


def test_only_the_source_module_tells_a_url_from_a_path_or_a_file_object():
    asking = re.compile(r"""is_url|is_remote|URL\.match|["']seek["']|\[A-Za-z\]\[A-Za-z0-9""")
    found = [f"{path.name}: {match.group()}" for path, text in code_outside("_source.py")
             for match in asking.finditer(text)]
    assert found == []


def test_one_identity_of_a_file_version():
    defining = re.compile(r"^(?:class|def) \w*(?:[Ss]tamp|Identity|file_changed)\w*",
                          flags=re.M)
    found = [f"{path.name}: {match.group()}" for path, text in code_outside("_source.py")
             for match in defining.finditer(text)]
    assert found == []


def test_one_parser_of_the_checkpoint_index():
    parsing = re.compile(r"weight_map[\"']\]|\.get\([\"']weight_map")
    found = [path.name for path, text in code_outside("_index.py") if parsing.search(text)]
    assert found == []
