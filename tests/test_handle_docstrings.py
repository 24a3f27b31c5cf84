"""Each handle method is documented once. Its whole description lives with
`NumpyHandle`: in the compiled reader's stub for the methods the core implements,
in `NumpyHandle` itself for the rest. Every other handle (a framework's, a
sharded checkpoint's, a verifying one) says only what it does differently and
names the method it refines: none of its paragraphs, parameters, return values or
errors repeats another handle's text for the same method. The examples are left
out of the comparison: each shows its own handle."""
import ast
import pathlib
import re
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fastst"
HANDLES = {
    "_core/reader.pyi": ("Reader",),
    "_handles/handle.py": ("NumpyHandle", "FrameworkHandle", "VerifyingHandle"),
    "checkpoint.py": ("ShardedHandle", "NumpyShardedHandle"),
}
SECTION = re.compile(r"(?m)^(\w[\w ]*)\n-{3,}\n")
# Today well over this many methods are documented by two handles or more: finding
# fewer means the files or classes moved, and the test would compare nothing.
FEWEST_SHARED_METHODS = 15


def pieces(docstring):
    """The prose paragraphs of `docstring` and the entries of its sections (a
    parameter, a return value, an error), each as one lowercased line; the examples
    left out."""
    found = []
    parts = SECTION.split(docstring)
    found += paragraphs(parts[0])
    for title, body in zip(parts[1::2], parts[2::2]):
        if title == "Examples":
            continue
        found += entries(body) if title in ("Parameters", "Returns", "Raises", "Yields") \
            else paragraphs(body)
    return [" ".join(piece.lower().split()) for piece in found if piece.strip()]


def paragraphs(text):
    return re.split(r"\n\s*\n", text)


def entries(body):
    """A numpydoc section's entries: each starts at a line that is not indented."""
    starts = [match.start() for match in re.finditer(r"(?m)^\S", body)]
    return [body[start:end] for start, end in zip(starts, starts[1:] + [len(body)])]


def documented_methods():
    """method name -> {class name: the pieces of its docstring}."""
    methods = defaultdict(dict)
    for relative, classes in HANDLES.items():
        tree = ast.parse((ROOT / relative).read_text())
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name in classes):
                continue
            for item in node.body:
                docstring = (isinstance(item, ast.FunctionDef) and ast.get_docstring(item))
                if docstring:
                    methods[item.name][node.name] = pieces(docstring)
    return methods


def test_every_handle_class_and_many_shared_methods_are_found():
    methods = documented_methods()
    found = {owner for owners in methods.values() for owner in owners}
    assert found == {name for classes in HANDLES.values() for name in classes}
    assert sum(len(owners) > 1 for owners in methods.values()) >= FEWEST_SHARED_METHODS


def test_no_handle_repeats_another_handles_words_for_the_same_method():
    repeated = []
    for method, owners in sorted(documented_methods().items()):
        first_said_by = {}
        for owner, said in owners.items():
            for piece in said:
                earlier = first_said_by.setdefault(piece, owner)
                if earlier != owner:
                    repeated.append(f"{method}: {owner} repeats {earlier}: {piece!r}")
    assert not repeated, "\n".join(repeated)


def test_the_check_finds_a_repeated_entry():
    first = pieces("Tensor `name`.\n\nRaises\n------\nTensorNotFoundError\n"
                   "    When the file has no tensor `name`.\n")
    second = pieces("Tensor `name`, from its shard.\n\nRaises\n------\nKeyError\n    Never.\n"
                    "TensorNotFoundError\n    When the file has no\n    tensor `name`.\n\n"
                    "Examples\n--------\n>>> 1\n1\n")
    assert set(first) & set(second) == {"tensornotfounderror when the file has no tensor `name`."}
    assert ">>> 1 1" not in second
