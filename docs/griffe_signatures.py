"""A griffe extension for the API reference: each class without an ``__init__`` of its
own gets one with the parameters the class is called with, so that its page shows
them. mkdocstrings takes a class's signature, and the defaults in its parameter table,
from ``__init__`` alone, which a NamedTuple (its fields) and a class whose ``__new__``
does the work (``safe_open``) lack."""
from __future__ import annotations

from typing import Any, List, Set, Union

from griffe import (Attribute, Class, Expr, Extension, Function, Module, Parameter,
                    ParameterKind, Parameters)

NAMED_TUPLE_BASES = ("NamedTuple", "typing.NamedTuple", "typing_extensions.NamedTuple")


class ClassSignatures(Extension):
    """Gives ``__init__`` to NamedTuples (their fields) and to classes with a
    ``__new__`` (its parameters)."""

    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        _visit(pkg, set())


def _visit(node: Union[Module, Class], seen: Set[str]) -> None:
    if node.canonical_path in seen:
        return
    seen.add(node.canonical_path)
    if isinstance(node, Class) and "__init__" not in node.members:
        parameters = _call_parameters(node)
        if parameters:
            node.set_member("__init__", Function(
                "__init__", lineno=0, endlineno=0, parent=node, returns="None",
                parameters=Parameters(Parameter("self", kind=ParameterKind.positional_or_keyword),
                                      *parameters)))
    for member in node.members.values():
        if not member.is_alias and (member.is_module or member.is_class):
            _visit(member, seen)  # type: ignore[arg-type]


def _call_parameters(cls: Class) -> List[Parameter]:
    """The parameters `cls` is called with: its fields for a NamedTuple, those of its
    ``__new__`` past ``cls`` otherwise (none when it has neither)."""
    if any(_path(base) in NAMED_TUPLE_BASES for base in cls.bases):
        return [Parameter(member.name, annotation=member.annotation, default=member.value,
                          kind=ParameterKind.positional_or_keyword, docstring=member.docstring)
                for member in cls.members.values()
                if isinstance(member, Attribute) and member.annotation is not None
                and "property" not in member.labels]
    new = cls.members.get("__new__")
    if isinstance(new, Function):
        return list(new.parameters)[1:]
    return []


def _path(base: Union[str, Expr]) -> str:
    return base.canonical_path if isinstance(base, Expr) else base
