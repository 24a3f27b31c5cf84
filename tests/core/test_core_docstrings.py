"""Each docstring of the compiled core is written once: in its stub (fastst/_core/*.pyi),
which the API reference is built from; what help() shows of the compiled name is that
docstring's first paragraph."""
import ast
import importlib
import inspect
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = ROOT / "fastst" / "_core"
# the ring's stub describes the second extension; every other stub, the first
MODULE_OF_STUB = {"_ring.pyi": "fastst._core._ring"}
# What the stubs document today is well above this: a test that finds the stubs or the
# names gone compares nothing, and must not pass for it.
FEWEST_PAIRS = 80


def summary(docstring):
    """The first paragraph of `docstring`, its lines joined by single spaces; None for
    none."""
    if not docstring or not docstring.strip():
        return None
    return " ".join(inspect.cleandoc(docstring).split("\n\n")[0].split())


def compiled_summary(found, name, owner):
    """The first paragraph of a compiled object's docstring, without the signature line
    that Cython's ``embedsignature`` puts first (``name(...)``, ``Owner.name(...)``,
    ``name: type`` for an attribute)."""
    docstring = getattr(found, "__doc__", None)
    if docstring is None:
        return None
    first, _, rest = docstring.partition("\n")
    owned = rf"(?:{re.escape(owner)}\.)?" if owner else ""
    signature = rf"{owned}{re.escape(name)}(?:\(|: )"
    return summary(rest if re.match(signature, first) else docstring)


def is_setter(node):
    return any(isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter")
               for decorator in node.decorator_list)


def is_protocol(node):
    return any(isinstance(base, ast.Name) and base.id == "Protocol" for base in node.bases)


def documented_names():
    """(stub, dotted name, stub docstring, compiled object, name, owner) of each function
    and class a stub declares, and of each method and property of those classes; the
    special methods left out (their compiled docstrings are Python's own), and the
    protocols (which exist for type checkers only)."""
    for stub in sorted(CORE.glob("*.pyi")):
        module = importlib.import_module(MODULE_OF_STUB.get(stub.name, "fastst._core"))
        for node in ast.parse(stub.read_text()).body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or (
                    isinstance(node, ast.ClassDef) and is_protocol(node)):
                continue
            found = getattr(module, node.name, None)
            yield stub.name, node.name, ast.get_docstring(node), found, node.name, None
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (not isinstance(item, ast.FunctionDef) or is_setter(item)
                        or item.name.startswith("__")):
                    continue
                member = inspect.getattr_static(found, item.name, None)
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                yield (stub.name, f"{node.name}.{item.name}", ast.get_docstring(item), member,
                       item.name, node.name)


def docstring_pairs():
    """(where, stub summary, compiled summary) of each documented name that has a
    docstring on either side."""
    pairs = []
    for stub, dotted, docstring, found, name, owner in documented_names():
        compiled = compiled_summary(found, name, owner) if found is not None else None
        if docstring is not None or compiled is not None:
            pairs.append((f"{stub}: {dotted}", summary(docstring), compiled))
    return pairs


def test_each_compiled_docstring_is_the_first_paragraph_of_its_stubs():
    """Both sides hold one text: a compiled docstring with no stub docstring, or a stub
    docstring with no compiled one, differs too."""
    pairs = docstring_pairs()
    differing = [f"{where}\n  stub:     {stub}\n  compiled: {compiled}"
                 for where, stub, compiled in pairs if stub != compiled]
    assert len(pairs) >= FEWEST_PAIRS
    assert differing == [], (f"{len(differing)} of {len(pairs)} differ:\n"
                             + "\n".join(differing))


def test_every_name_the_stubs_declare_is_found_in_the_compiled_core():
    """A name compared as missing would hide a docstring that no test reads."""
    missing = [f"{stub}: {dotted}" for stub, dotted, _, found, _, _ in documented_names()
               if found is None]
    assert missing == []
