"""Nested state (a model's, an optimizer's, a training loop's) in a safetensors file,
never through pickle.

A state is a tree of dicts (OrderedDicts too), lists and tuples whose leaves are arrays (NumPy, torch,
JAX), Python ints, floats (inf and nan included), bools, strings, bytes or None; dict
keys may be any of those scalars. Each array becomes an ordinary tensor named by its
path in the tree (``state/0/exp_avg``); the tree itself, with its scalar leaves, is
JSON in ``__metadata__`` under ``"fastst.state"``. Any safetensors reader opens the
file; ``load_state`` gives back the same tree, the same container and key types, and
arrays that view the file.

The path names: dict keys and list indices joined by ``/``. A str key has ``%`` and
``/`` percent-escaped, and its first character too when the key reads as an integer
or starts with ``#``; an int key is its decimal digits; other keys are ``#`` and
their repr (``#None``, ``#True``, ``#0.5``), bytes ``#x`` and their hex. Names are
unique within a tree: the tree in the metadata says which tensor each leaf is, so a
reader needs none of these rules.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
>>> state = {"step": 3, "moments": {0: np.zeros(2), 1: (np.ones(1), None)}}
>>> fastst.save_state(path, state)
>>> fastst.load_file(path).keys()
dict_keys(['moments/0', 'moments/1/0'])
>>> fastst.load_state(path)
{'step': 3, 'moments': {0: array([0., 0.]), 1: (array([1.]), None)}}
"""
from __future__ import annotations

import base64
import binascii
import math
import re
from collections import OrderedDict
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Mapping,
                    Optional, Protocol, Set, Tuple, TypeVar, Union, overload)

import numpy as np

from ._api import safe_open
from ._core import SafetensorError, SafetensorTypeError, WriteSpec
from ._format.checksums import plan_with_checksums
from ._frameworks.specs import is_tensor, spec_of
from ._io.files import PathLike, write_atomically
from ._io.limits import DEFAULT_BACKEND
from .checkpoint import ShardEntry, save_checkpoint

if TYPE_CHECKING:
    import jax  # type: ignore[import-not-found, unused-ignore]
    import numpy.typing as npt
    import torch  # type: ignore[import-not-found, unused-ignore]

    from ._handles.protocols import Backend

__all__ = ["STATE_KEY", "STATE_VERSION", "MAX_DEPTH", "save_state", "load_state",
           "state_to_tensors", "state_from_tensors", "tensor_specs"]

class Array(Protocol):
    """What the arrays of a state to save have: NumPy's, torch's, JAX's..."""

    @property
    def shape(self) -> object: ...
    @property
    def dtype(self) -> object: ...


Leaf = TypeVar("Leaf")
Scalar = Union[None, bool, int, float, str, bytes]
# A state whose arrays are Leafs: scalars, and dicts, lists and tuples of states.
State = Union[Leaf, Scalar, Dict[Scalar, "State[Leaf]"], List["State[Leaf]"],
              Tuple["State[Leaf]", ...]]

STATE_KEY = "fastst.state"
"""The ``__metadata__`` key that holds a state's tree, as JSON text (in the index's
``metadata`` for a sharded state); reserved: the `metadata` given to `save_state`
may not use it."""
STATE_VERSION = 1
"""The version of the state format that `save_state` writes and `load_state` reads; a
file of another version is refused."""
MAX_DEPTH = 256
"""The deepest nesting of containers a state may have: deeper trees are refused when
saved and when loaded, in bounded time and stack, never a RecursionError."""
INT_RANGE = (-2**63, 2**64)    # ints JSON holds as numbers; others go as decimal text
MAX_INT_BITS = 4096            # 1,234 digits at most: far below Python's int/str limit
SCALARS = (type(None), bool, int, float, str, bytes)
CONTAINERS: Dict[type, str] = {dict: "dict", OrderedDict: "ordered_dict", list: "list", tuple: "tuple"}
CONTAINER_TAGS = {tag: kind for kind, tag in CONTAINERS.items()}
INTEGER_TEXT = re.compile(r"-?[0-9]+")
SCALAR_TAGS = ("float", "int", "bytes")    # scalars that JSON numbers and strings cannot hold
JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\],]')    # strings, and what nests


def save_state(filename: PathLike, tree: State[Array], metadata: Optional[Mapping[str, str]] = None,
               *, fsync: bool = False, checksum: Optional[str] = None,
               max_shard_size: Union[int, str, None] = None) -> None:
    """Write a nested state (a model's, an optimizer's) to a safetensors file,
    atomically, never through pickle.

    Each array of the tree becomes a tensor named by its path in the tree;
    the tree, with its scalar leaves, is JSON under `STATE_KEY` in the
    metadata (see the module's doc). Any safetensors reader opens the file.

    Parameters
    ----------
    filename : str or bytes or os.PathLike
        The file to write (the directory, or ``DIR/NAME.safetensors``, with
        `max_shard_size`).
    tree : object
        Dicts (OrderedDicts too), lists and tuples, nested at most
        `MAX_DEPTH` deep, whose leaves are arrays (NumPy, torch, JAX), None,
        bools, ints, floats, strs or bytes; dict keys are such scalars.
    metadata : mapping of str to str, optional
        More ``__metadata__``, beside the tree.
    fsync : bool, default False
        Flush the file and its directory to disk before returning.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum (see ``fastst.save_file``).
    max_shard_size : int or str, optional
        Save a sharded checkpoint, as ``fastst.save_file(...,
        max_shard_size=...)`` saves tensors: the tensors are cut into shards
        in tree order, and the tree and `metadata` go into the index's
        ``metadata`` (into the file's, when everything fits in one).

    Raises
    ------
    SafetensorTypeError
        When a leaf or a key is of a type a state cannot hold (a set, an
        object...).
    SafetensorError
        When the tree holds itself (a cycle), nests deeper than `MAX_DEPTH`,
        gives two leaves one tensor name, or `metadata` uses `STATE_KEY`.
    OSError
        When the file cannot be written.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "optimizer.safetensors")
    >>> state = {"step": 10, "lr": 1e-3, "moments": [np.zeros(2), np.ones(2)]}
    >>> fastst.save_state(path, state, {"framework": "np"})
    >>> sorted(fastst.load_file(path))
    ['moments/0', 'moments/1']
    """
    tensors, state_metadata = state_to_tensors(tree, metadata)
    specs = tensor_specs(tensors)
    if max_shard_size is not None:
        entries = [ShardEntry(spec, 0 if spec.data is None else spec.data.nbytes)
                   for spec in specs]
        save_checkpoint(entries, filename, max_shard_size=max_shard_size,
                        metadata=state_metadata, fsync=fsync, checksum=checksum)
        return
    write_atomically(plan_with_checksums(specs, state_metadata, checksum), filename, fsync=fsync)


@overload
def load_state(filename: PathLike, framework: Literal["np", "numpy"] = "np",
               device: Literal["cpu"] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
               verify: bool = False) -> State[npt.NDArray[Any]]: ...
@overload
def load_state(filename: PathLike, framework: Literal["pt", "torch", "pytorch"],
               device: Union[str, int, torch.device] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
               verify: bool = False) -> State[torch.Tensor]: ...
@overload
def load_state(filename: PathLike, framework: Literal["jax", "flax"],
               device: Union[str, jax.Device] = "cpu", *, backend: Backend = DEFAULT_BACKEND,
               verify: bool = False) -> State[jax.Array]: ...
@overload
def load_state(filename: PathLike, framework: str, device: Any = "cpu", *,
               backend: Backend = DEFAULT_BACKEND, verify: bool = False) -> State[Any]: ...
def load_state(filename: PathLike, framework: str = "np", device: Any = "cpu", *,
               backend: Backend = DEFAULT_BACKEND, verify: bool = False) -> State[Any]:
    """Load the nested state that `save_state` wrote: the same tree, the same
    container and key types.

    Nothing in the file is run: no pickle, no eval, no import it names; the
    tree is checked against the format and the file's tensors (each used
    exactly once). A sharded state (its directory or index) is read through
    one handle over its shards, each shard opened when the tree first needs
    one of its tensors.

    Parameters
    ----------
    filename : str or bytes or os.PathLike
        The state file, or a sharded state's directory or index.
    framework : str, default "np"
        What the arrays are, as ``fastst.safe_open`` names them (``"np"``,
        ``"pt"``, ``"jax"``...): views of the file's map for NumPy, and for
        torch on the CPU.
    device : str, default "cpu"
        Where the framework puts them.
    backend : "mmap" or "pread", default "mmap"
        How the file is read.
    verify : bool, default False
        Check each tensor's checksum as it is read.

    Returns
    -------
    object
        The tree. For typing, a ``State`` of the framework's arrays (a
        union of its leaves and containers: narrow it with ``isinstance``, or
        ``typing.cast`` it to the tree you saved).

    Raises
    ------
    SafetensorError
        When the file is not a state file, its tree is not valid (unknown
        nodes, a key twice, a tensor used twice, or one of the file's left
        out), or its format version is not `STATE_VERSION`.
    FileNotFoundError
        When the file does not exist.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "state.safetensors")
    >>> fastst.save_state(path, {"step": 1, "best": (0.5, b"id"), 7: np.arange(3)})
    >>> fastst.load_state(path)
    {'step': 1, 'best': (0.5, b'id'), 7: array([0, 1, 2])}
    """
    with safe_open(filename, framework, device, backend=backend, verify=verify) as handle:
        return state_from_tensors(handle.metadata(), handle.get_tensor, handle.keys(),
                                  handle.source)


# ---------------------------------------------------------------------------
# Tree -> tensors + metadata
# ---------------------------------------------------------------------------


def state_to_tensors(tree: State[Array], metadata: Optional[Mapping[str, str]] = None
                     ) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Split a nested state into its arrays and the metadata that describes the
    rest: what any writer (one file, or shards) stores to make a state file.

    Parameters
    ----------
    tree : object
        The state (see `save_state`).
    metadata : mapping of str to str, optional
        More metadata, kept beside the tree.

    Returns
    -------
    tensors : dict of str to array
        Each array of the tree (NumPy, torch or JAX, as given), by its path
        name, in tree order.
    metadata : dict of str to str
        `metadata` plus the tree, under `STATE_KEY`.

    Raises
    ------
    SafetensorTypeError
        When a leaf or a key is of a type a state cannot hold.
    SafetensorError
        When the tree holds itself, nests deeper than `MAX_DEPTH`, gives two
        leaves one name, or `metadata` uses `STATE_KEY`.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.state import state_to_tensors
    >>> tensors, metadata = state_to_tensors({"step": 3, "w": np.zeros(2)})
    >>> tensors
    {'w': array([0., 0.])}
    >>> metadata
    {'fastst.state': '{"version":1,"tree":{"dict":[["step",3],["w",{"tensor":"w"}]]}}'}
    """
    from fastst._json import dumps

    extra = dict(metadata or {})
    if STATE_KEY in extra:
        raise SafetensorError(f"metadata key {STATE_KEY!r} is reserved for the state tree")
    tensors: Dict[str, Any] = {}
    encoded = _Encoder(tensors).node(tree, "", 0, set())
    try:
        text = dumps({"version": STATE_VERSION, "tree": encoded}).decode()
    except TypeError as error:     # a str with a lone surrogate
        raise SafetensorTypeError(f"state tree cannot be written as UTF-8 JSON: {error}") from None
    return tensors, {**extra, STATE_KEY: text}


class _Encoder:
    """Encodes a tree as JSON-ready nodes, collecting its arrays by path name."""

    def __init__(self, tensors: Dict[str, Any]) -> None:
        self.tensors = tensors

    def node(self, value: Any, path: str, depth: int, open_ids: Set[int]) -> Any:
        kind = type(value)
        if kind in CONTAINERS:
            return self.container(value, path, depth, open_ids)
        if kind in SCALARS:
            return _scalar(value, path)
        if is_tensor(value):
            return self.array(value, path)
        name = f"{kind.__module__}.{kind.__qualname__}"
        if isinstance(value, tuple) and hasattr(kind, "_fields"):
            raise SafetensorTypeError(
                f"state tree at {_where(path)}: a NamedTuple ({name}) cannot be stored: an "
                f"optax state is made of them; save its leaves, "
                f"jax.tree_util.tree_leaves(opt_state), and put them back with "
                f"jax.tree_util.tree_unflatten(jax.tree_util.tree_structure("
                f"optimizer.init(params)), leaves)")
        article = "an" if name[0] in "aeiou" else "a"
        raise SafetensorTypeError(f"state tree at {_where(path)}: {article} {name} cannot be "
                                  f"stored (only dicts, lists, tuples, arrays, and None, bool, "
                                  f"int, float, str, bytes)")

    def container(self, value: Any, path: str, depth: int, open_ids: Set[int]) -> Any:
        if depth >= MAX_DEPTH:
            raise SafetensorError(f"state tree at {_where(path)}: nested deeper than "
                                  f"{MAX_DEPTH} containers")
        if id(value) in open_ids:
            raise SafetensorError(f"state tree at {_where(path)}: the container holds itself "
                                  f"(a cycle)")
        open_ids.add(id(value))
        tag = CONTAINERS[type(value)]
        if isinstance(value, dict):
            node = {tag: [self.item(key, item, path, depth, open_ids)
                          for key, item in value.items()]}
        else:
            node = {tag: [
                self.node(item, _child(path, str(index)), depth + 1, open_ids)
                for index, item in enumerate(value)]}
        open_ids.discard(id(value))
        return node

    def item(self, key: Any, value: Any, path: str, depth: int, open_ids: Set[int]
             ) -> List[Any]:
        if type(key) not in SCALARS:
            raise SafetensorTypeError(f"state tree at {_where(path)}: dict key of type "
                                      f"{type(key).__name__} cannot be stored")
        child = _child(path, _key_name(key))
        return [_scalar(key, child), self.node(value, child, depth + 1, open_ids)]

    def array(self, value: Any, path: str) -> Dict[str, Any]:
        if path in self.tensors:
            raise SafetensorError(f"state tree at {_where(path)}: two keys give this tensor "
                                  f"name")
        self.tensors[path] = value
        return {"scalar" if isinstance(value, np.generic) else "tensor": path}


def _scalar(value: Any, path: str) -> Any:
    if type(value) is float and not math.isfinite(value):
        return {"float": repr(value)}
    if type(value) is int and not INT_RANGE[0] <= value < INT_RANGE[1]:
        if value.bit_length() > MAX_INT_BITS:
            raise SafetensorError(f"state tree at {_where(path)}: an int of "
                                  f"{value.bit_length()} bits is too large to store")
        return {"int": str(value)}
    if type(value) is bytes:
        return {"bytes": base64.b64encode(value).decode()}
    return value


def _key_name(key: Any) -> str:
    """A dict key as one part of a path name (see the module's doc)."""
    if type(key) is str:
        escaped = key.replace("%", "%25").replace("/", "%2F")
        if INTEGER_TEXT.fullmatch(key) or key.startswith("#"):
            escaped = f"%{ord(key[0]):02X}" + escaped[1:]
        return escaped
    if type(key) is int:
        return str(key)
    if type(key) is bytes:
        return "#x" + key.hex()
    return "#" + repr(key)


def _child(path: str, part: str) -> str:
    return part if not path else f"{path}/{part}"


def _where(path: str) -> str:
    return repr(path) if path else "the root"


def tensor_specs(tensors: Mapping[str, Any]) -> List[WriteSpec]:
    """The `WriteSpec` of each tensor of a state, whatever its framework.

    Parameters
    ----------
    tensors : mapping of str to array
        NumPy arrays and scalars, torch tensors (through its adapter),
        anything else NumPy can view (JAX arrays, buffers).

    Returns
    -------
    list of WriteSpec
        In the order of `tensors`.

    Raises
    ------
    SafetensorTypeError
        When a dtype has no safetensors code.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.state import tensor_specs
    >>> tensor_specs({"w": np.ones(2, np.float16)})
    [WriteSpec(name='w', dtype='F16', shape=(2,), data=array([1., 1.], dtype=float16))]
    """
    return [spec_of(name, value) for name, value in tensors.items()]


# ---------------------------------------------------------------------------
# Metadata + tensors -> tree
# ---------------------------------------------------------------------------


def state_from_tensors(metadata: Optional[Mapping[str, str]], get_tensor: Callable[[str], Any],
                       names: Iterable[str], source: str = "<state>") -> State[Any]:
    """The nested state that a file's metadata describes, its arrays taken from
    the file: what `load_state` does with an open file.

    Parameters
    ----------
    metadata : mapping of str to str or None
        The file's ``__metadata__`` (or a sharded state index's
        ``metadata``).
    get_tensor : callable
        ``get_tensor(name)``: the tensor of a leaf.
    names : iterable of str
        The tensors the file holds: the tree must use each exactly once.
    source : str, default "<state>"
        What messages call the file.

    Returns
    -------
    object
        The tree.

    Raises
    ------
    SafetensorError
        When the metadata holds no state, or its tree is not valid.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.state import state_from_tensors, state_to_tensors
    >>> tensors, metadata = state_to_tensors({"step": 3, "w": np.zeros(2)})
    >>> state_from_tensors(metadata, tensors.__getitem__, tensors)
    {'step': 3, 'w': array([0., 0.])}
    """
    document = _state_document(metadata, source)
    decoder = _Decoder(get_tensor, set(names), source)
    tree = decoder.node(document["tree"], "", 0)
    unused = decoder.available - decoder.used
    if unused:
        raise SafetensorError(f"{source}: tensor {min(unused)!r} is in the file but not in "
                              f"the state tree")
    return tree


def _state_document(metadata: Optional[Mapping[str, str]], source: str) -> Dict[str, Any]:
    from fastst._json import JSONDecodeError, loads

    text = (metadata or {}).get(STATE_KEY)
    if text is None:
        raise SafetensorError(f"{source}: not a state file: its metadata has no "
                              f"{STATE_KEY!r} key")
    try:
        document = loads(text)
    except JSONDecodeError as error:
        raise SafetensorError(f"{source}: metadata {STATE_KEY!r} is not valid JSON "
                              f"({error})") from None
    twice = _key_given_twice(text)
    if twice is not None:
        raise SafetensorError(f"{source}: metadata {STATE_KEY!r} gives the key "
                              f"{twice[:80]!r} twice in one object")
    if not isinstance(document, dict) or set(document) != {"version", "tree"}:
        raise SafetensorError(f"{source}: metadata {STATE_KEY!r} must be an object of "
                              f"'version' and 'tree'")
    version = document["version"]
    if version != STATE_VERSION or type(version) is not int:
        raise SafetensorError(f"{source}: state format version {version!r} is not known "
                              f"(this fastst reads version {STATE_VERSION})")
    return document


def _key_given_twice(text: str) -> Optional[str]:
    """The first key that an object of the JSON `text` (valid JSON) gives twice,
    or None: a parser keeps one of the two silently, as the header parser does
    not. One pass over the tokens, with no recursion however deep the nesting."""
    from fastst._json import loads

    open_keys: List[Optional[Set[str]]] = []     # per open container: its keys; None: an array
    key_next = False
    for match in JSON_TOKEN.finditer(text):
        token = match.group()
        if token[0] == '"':
            if key_next:
                key = loads(token) if "\\" in token else token[1:-1]
                keys = open_keys[-1]
                if keys is not None:
                    if key in keys:
                        return key
                    keys.add(key)
                key_next = False
        elif token == "{":
            open_keys.append(set())
            key_next = True
        elif token == "[":
            open_keys.append(None)
        elif token in ("}", "]"):
            open_keys.pop()
        elif token == ",":
            key_next = open_keys[-1] is not None
    return None


class _Decoder:
    """Rebuilds a tree from its JSON nodes, checking each against the format."""

    def __init__(self, get_tensor: Callable[[str], Any], available: Set[str],
                 source: str) -> None:
        self.get_tensor = get_tensor
        self.available = available
        self.used: Set[str] = set()
        self.source = source

    def fail(self, path: str, rule: str) -> SafetensorError:
        return SafetensorError(f"{self.source}: state tree at {_where(path)}: {rule}")

    def node(self, node: Any, path: str, depth: int) -> Any:
        if type(node) is not dict:
            if type(node) is list:
                raise self.fail(path, "a bare JSON array is not a node")
            return node
        if len(node) != 1:
            raise self.fail(path, "a node must be an object of one key")
        ((tag, body),) = node.items()
        if tag in CONTAINER_TAGS:
            return self.container(tag, body, path, depth)
        if tag in ("tensor", "scalar"):
            return self.tensor(tag, body, path)
        return self.scalar(tag, body, path)

    def container(self, tag: str, body: Any, path: str, depth: int) -> Any:
        if depth >= MAX_DEPTH:
            raise self.fail(path, f"nested deeper than {MAX_DEPTH} containers")
        if type(body) is not list:
            raise self.fail(path, f"a {tag} node must hold a JSON array")
        if tag in ("dict", "ordered_dict"):
            pairs = self.dict_of(body, path, depth)
            return pairs if tag == "dict" else OrderedDict(pairs)
        items = [self.node(item, _child(path, str(index)), depth + 1)
                 for index, item in enumerate(body)]
        return items if tag == "list" else tuple(items)

    def dict_of(self, pairs: List[Any], path: str, depth: int) -> Dict[Any, Any]:
        result: Dict[Any, Any] = {}
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2:
                raise self.fail(path, "a dict item must be a [key, value] pair")
            key = self.key(pair[0], path)
            if key in result:
                raise self.fail(path, f"dict key {key!r} is given twice")
            child = _child(path, _key_name(key))
            result[key] = self.node(pair[1], child, depth + 1)
        return result

    def key(self, node: Any, path: str) -> Any:
        if type(node) is dict and len(node) == 1 and next(iter(node)) in SCALAR_TAGS:
            ((tag, body),) = node.items()
            return self.scalar(tag, body, path)
        if type(node) in (dict, list):
            raise self.fail(path, "a dict key must be a scalar")
        return node

    def tensor(self, tag: str, name: Any, path: str) -> Any:
        if type(name) is not str or name not in self.available:
            raise self.fail(path, f"tensor {name!r} is not in the file")
        if name in self.used:
            raise self.fail(path, f"tensor {name!r} is used twice")
        self.used.add(name)
        value = self.get_tensor(name)
        if tag == "scalar":
            shape = tuple(value.shape)
            if shape:
                raise self.fail(path, f"a scalar node names tensor {name!r} of shape "
                                      f"{list(shape)}; a scalar's tensor has shape []")
            if isinstance(value, np.ndarray):
                return value[()]
        return value

    def scalar(self, tag: str, text: Any, path: str) -> Any:
        if tag not in SCALAR_TAGS:
            raise self.fail(path, f"unknown node {tag[:40]!r}")
        if type(text) is not str:
            raise self.fail(path, f"a {tag} node must hold a string")
        if tag == "float":
            if text not in ("nan", "inf", "-inf"):
                raise self.fail(path, "a float node holds 'nan', 'inf' or '-inf'")
            return float(text)
        if tag == "int":
            if not INTEGER_TEXT.fullmatch(text) or len(text) > MAX_INT_BITS // 3:
                raise self.fail(path, f"an int node holds at most {MAX_INT_BITS // 3} "
                                      f"decimal digits")
            return int(text)
        try:
            return base64.b64decode(text, validate=True)
        except binascii.Error:
            raise self.fail(path, "a bytes node must hold base64 text") from None
