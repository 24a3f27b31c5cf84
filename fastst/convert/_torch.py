"""A torch checkpoint -> safetensors, without torch and without running its pickle:
the tensors of the (possibly nested) object, tied weights kept once, each tensor
read by byte range and written in C order, little-endian."""
from __future__ import annotations

import itertools
import shlex
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
from collections import OrderedDict

from .._core import SafetensorError
from ._output import TensorToWrite
from ._torch_files import PIECE_BYTES, Checkpoint
from ._torch_pickle import TensorRef, _short

__all__ = ["flatten", "training_checkpoint_note", "tied_names", "declare",
           "max_repeated_entries", "MAX_DEPTH"]

MAX_DEPTH = 256
# Entries a tree may repeat by referring to one container from several places (a
# pickle's memo makes that a few bytes each time): written out as a tree, a container
# is repeated in full wherever it is referred to, so a tiny pickle could otherwise
# stand for exponentially many entries.
MAX_REPEATED_ENTRIES = 1_000_000
# Below that bound, a tree may repeat REPEATED_ENTRIES_BASE entries and this many
# per byte of its pickle, so that the walk's work follows the size of the input: a
# config or a parameter list shared by a real checkpoint repeats a few entries per
# byte, a DAG of tuples 2**n for 2n bytes.
REPEATED_ENTRIES_PER_BYTE = 16
REPEATED_ENTRIES_BASE = 100_000


def max_repeated_entries(pickle_bytes: int) -> int:
    """The entries a tree unpickled from `pickle_bytes` bytes may repeat."""
    return min(MAX_REPEATED_ENTRIES,
               REPEATED_ENTRIES_BASE + REPEATED_ENTRIES_PER_BYTE * pickle_bytes)


def flatten(tree: Any, source: str, key: Optional[str] = None,
            tensor_type: Any = TensorRef, max_text: Optional[int] = None,
            max_repeated: int = MAX_REPEATED_ENTRIES
            ) -> Tuple[List[Tuple[str, Any]], Dict[str, str]]:
    """The tensors of `tree` by name, and the metadata that describes the rest.

    A state dict (a dict of tensors) keeps its names and needs no metadata; any
    other nest (``{"model": ..., "epoch": 3}``, an optimizer state) is laid out
    as ``fastst.state`` lays it out: tensors named by their path
    (``model/embed.weight``, ``state/0/exp_avg``), the tree with its other
    leaves in the metadata, so that ``fastst.load_state`` gives it back. With
    `key`, only ``tree[key]`` is converted (a ``/``-separated path for deeper
    nests). `tensor_type` is what counts as a tensor (torch.Tensor to name the
    tensors of ``torch.load`` the same way). A container the pickle refers to from
    many places is repeated in full wherever it is referred to: a nest that would
    repeat more than `max_repeated` entries, or whose names and other leaves would
    take more than `max_text` bytes, is refused before it is written out. So is a
    tree without tensors, naming `key` and saying what it holds instead."""
    holder = "the checkpoint" if key is None else f"key {key!r}"
    if key is not None:
        for part in key.split("/"):
            if not isinstance(tree, dict) or part not in tree:
                raise SafetensorError(f"{source}: the checkpoint has no key {key!r} (top-level "
                                      f"keys: {_keys(tree)})")
            tree = tree[part]
    if isinstance(tree, tensor_type):
        return [("tensor", tree)], {}
    if not isinstance(tree, (dict, list, tuple)):
        raise SafetensorError(f"{source}: {holder} holds {_kind(tree, tensor_type)}, not tensors")
    tensors, metadata = _tensors_of(tree, source, tensor_type, max_text, max_repeated)
    if not tensors:
        raise SafetensorError(f"{source}: {holder} holds no tensors: it is "
                              f"{_contents(tree, tensor_type)}{_optimizer_note(tree)}")
    return tensors, metadata


def _tensors_of(tree: Any, source: str, tensor_type: Any, max_text: Optional[int],
                max_repeated: int) -> Tuple[List[Tuple[str, Any]], Dict[str, str]]:
    """`flatten` of a container."""
    if _is_state_dict(tree, tensor_type):
        return list(tree.items()), {}       # its names as they are
    from ..state import state_to_tensors

    try:
        tensors, metadata = state_to_tensors(_plain(tree, tensor_type, 0, 0,
                                                    _Walk(max_text, max_repeated)))
    except SafetensorError as error:
        raise type(error)(f"{source}: {error}") from None
    return list(tensors.items()), metadata


class _Walk:
    """The containers a walk of a tree has met, the entries it has repeated by
    meeting some of them again, and the bytes of text (names, keys, str and
    bytes leaves) the tree written out would hold."""

    def __init__(self, max_text: Optional[int], max_repeated: int) -> None:
        self.seen: Set[int] = set()   # ids: the tree keeps every container alive meanwhile
        self.repeated = 0
        self.text = 0
        self.max_text, self.max_repeated = max_text, max_repeated

    def meet(self, container: Any) -> None:
        if id(container) not in self.seen:
            self.seen.add(id(container))
            return
        self.repeated += len(container) + 1
        if self.repeated > self.max_repeated:
            raise SafetensorError(
                f"the checkpoint refers to the same containers from so many places that, "
                f"written out as a tree, it would repeat over {self.max_repeated} entries")

    def write(self, size: int) -> None:
        self.text += size
        if self.max_text is not None and self.text > self.max_text:
            raise SafetensorError(
                f"the checkpoint's names and values other than tensors, written out as a "
                f"tree, would take over {self.max_text} bytes")


def _plain(node: Any, tensor_type: Any, depth: int, path: int, walk: _Walk) -> Any:
    """`node` in the types a state tree holds: dict and tuple subclasses (a state
    dict's OrderedDict, torch.Size) as the plain type, sets as lists, dtypes,
    devices and complex numbers as their text. `path` is the length of the name
    a tensor found here gets."""
    if depth > MAX_DEPTH:
        raise SafetensorError(f"the checkpoint nests deeper than {MAX_DEPTH}")
    if isinstance(node, tensor_type):
        walk.write(path)
        return node
    if node is None or type(node) in (bool, int, float):
        walk.write(1)
        return node
    if type(node) in (str, bytes, bytearray):
        walk.write(len(node) + 1)
        return bytes(node) if type(node) is bytearray else node
    if isinstance(node, (dict, list, set, frozenset, tuple)):
        walk.meet(node)
        walk.write(1)
    if isinstance(node, dict):
        items = ((k, _plain(v, tensor_type, depth + 1, path + _key_size(k, walk), walk))
                 for k, v in node.items())
        return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
    if isinstance(node, (list, set, frozenset, tuple)):
        kind = tuple if isinstance(node, tuple) else list
        return kind(_plain(v, tensor_type, depth + 1, path + len(str(k)) + 1, walk)
                    for k, v in enumerate(node))
    text = str(node)
    walk.write(len(text))
    return text


def _key_size(key: Any, walk: _Walk) -> int:
    """The bytes dict key `key` adds to the names below it (and writes once)."""
    size = (len(key) if type(key) in (str, bytes) else 20) + 1
    walk.write(size)
    return size


def _is_state_dict(node: Any, tensor_type: Any) -> bool:
    return isinstance(node, dict) and all(
        type(k) is str and isinstance(v, tensor_type) for k, v in node.items())


def _kind(node: Any, tensor_type: Any) -> str:
    """`node` in a few words: "an empty dict", "a list of 2", "an int (3)"."""
    if isinstance(node, tensor_type):
        return "a tensor"
    name = type(node).__name__
    article = "an" if name[0] in "aeiou" else "a"
    if isinstance(node, (dict, list, tuple, set, frozenset)):
        return f"an empty {name}" if not node else f"{article} {name} of {len(node)}"
    return f"{article} {name} ({_short(node, 30)})"


def _contents(node: Any, tensor_type: Any) -> str:
    """`node` in a few words, and for a dict its first keys with what each holds."""
    if not isinstance(node, dict) or not node:
        return _kind(node, tensor_type)
    entries = [f"{_short(key)}: {_kind(value, tensor_type)}"
               for key, value in itertools.islice(node.items(), 10)]
    return "a dict {" + ", ".join(entries) + (", ...}" if len(node) > 10 else "}")


def _optimizer_note(node: Any) -> str:
    if not (isinstance(node, dict) and {"state", "param_groups"} <= node.keys()):
        return ""
    return (". An optimizer's state holds tensors once it has taken a step, and only for "
            "an optimizer that keeps some (SGD without momentum keeps none)")


def training_checkpoint_note(tree: Any, names: List[str], source: str) -> Optional[str]:
    """What to say of a training checkpoint converted whole: a dict whose values
    include a state dict beside entries that are not (``{"model": ...,
    "optimizer": ..., "epoch": 3}``). Its tensors are named by their path
    (`names`, ``model/weight``); ``--key`` converts the model's weights alone,
    under their own names. None for another tree."""
    if not isinstance(tree, dict):
        return None
    models = [key for key, value in tree.items()
              if type(key) is str and _is_state_dict(value, TensorRef) and len(value)]
    if not models or len(models) == len(tree):
        return None
    (first, what), *others = [(_short(key), ("a state dict of " if key in models else "")
                               + f"{_tensor_count(value, set()) or 'no'} tensors")
                              for key, value in itertools.islice(tree.items(), 10)]
    return (f"{source}: a training checkpoint: {first} holds {what}"
            f"{''.join(f', {key} {what}' for key, what in others)}"
            f"{', ...' if len(tree) > 10 else ''}. It is written as one "
            f"tree whose tensors are named by their path ({_short(names[0])}, ...), which "
            f"fastst.load_state reads back whole; for the weights of {_short(models[0])} "
            f"alone, under their own names, convert it with --key {shlex.quote(models[0])}")


def _tensor_count(node: Any, seen: Set[int]) -> int:
    """The tensors under `node`, each container counted once (`seen`: their ids)."""
    if isinstance(node, TensorRef):
        return 1
    if not isinstance(node, (dict, list, tuple, set, frozenset)) or id(node) in seen:
        return 0
    seen.add(id(node))
    values = node.values() if isinstance(node, dict) else node
    return sum(_tensor_count(value, seen) for value in values)


def _keys(tree: Any) -> str:
    if not isinstance(tree, dict):
        return f"none: it is a {type(tree).__name__}"
    shown = [_short(k) for k in itertools.islice(tree, 10)]
    return ", ".join(shown) + (", ..." if len(tree) > 10 else "")


def tied_names(tensors: List[Tuple[str, TensorRef]]) -> Dict[str, str]:
    """Names whose tensor is another's exactly (same storage, dtype, offset, shape
    and stride: tied weights) -> the name kept, the first in the checkpoint's order.

    A module registers the weight it owns before the heads tied to it
    (``transformer.wte.weight`` before ``lm_head.weight``, ``shared.weight``
    before T5's ``encoder.embed_tokens.weight``): keeping the first is keeping
    the name that ``save_pretrained`` keeps, the one the model without a head
    (``GPT2Model``) loads as well as the model with it. (``save_model`` keeps the
    first in sorted order, ``lm_head.weight``, which the base model lacks.)"""
    # keyed by text: the hash of a tuple of ints a pickle chose can be made to collide
    by_layout: Dict[str, List[str]] = {}
    for name, ref in tensors:
        if ref.numel:
            by_layout.setdefault(repr(ref.layout()), []).append(name)
    dropped: Dict[str, str] = {}
    for names in by_layout.values():
        kept, *others = names
        for name in others:
            dropped[name] = kept
    return dropped


def _byte_order_dtype(code: str, itemsize: int) -> Tuple[np.dtype, np.dtype]:
    """Big- and little-endian NumPy dtypes of the width of `code`, for swapping."""
    if code == "C64":
        return np.dtype(">c8"), np.dtype("<c8")
    return np.dtype(f">u{itemsize}"), np.dtype(f"<u{itemsize}")


def declare(checkpoint: Checkpoint, name: str, ref: TensorRef) -> TensorToWrite:
    """The TensorToWrite tensor `name` of `checkpoint`: header entry, and its bytes."""
    begin, end = ref.byte_span()
    byte_range = checkpoint.ranges[ref.storage.key]
    layout = f"shape {list(ref.shape)}, stride {list(ref.stride)}, offset {ref.offset}"
    if end > ref.storage.nbytes or end > byte_range.size:
        raise SafetensorError(
            f"{checkpoint.source}: tensor {name!r} ({layout}) reaches byte {end} of storage "
            f"{ref.storage.key!r}, which holds {byte_range.size}")
    origin = f"{layout}, over {end - begin} bytes of storage {ref.storage.key!r}"
    swap = checkpoint.big_endian and ref.itemsize > 1
    if ref.is_contiguous() and not swap:
        def chunks() -> Iterator[memoryview]:
            buffer = bytearray(min(PIECE_BYTES, end - begin))
            for position in range(begin, end, PIECE_BYTES):
                view = memoryview(buffer)[:min(PIECE_BYTES, end - position)]
                byte_range.read_into(position, view)
                yield view
    else:
        def chunks() -> Iterator[memoryview]:
            span = np.empty(end - begin, np.uint8)
            byte_range.read_into(begin, span.data)
            big, little = _byte_order_dtype(ref.code, ref.itemsize)
            typed = span.view(big if swap else little)
            array = np.lib.stride_tricks.as_strided(
                typed, ref.shape, tuple(step * ref.itemsize for step in ref.stride),
                writeable=False)
            for block in c_order_blocks(array, PIECE_BYTES):
                compact = np.ascontiguousarray(block.astype(little, copy=False))
                yield compact.reshape(-1).view(np.uint8).data
    return TensorToWrite(name, ref.code, ref.header_shape(), ref.nbytes, chunks, origin)


def c_order_blocks(array: np.ndarray, size: int) -> Iterator[np.ndarray]:
    """`array` cut, in C order, into blocks of whole rows (or, for rows over `size`
    bytes, into blocks of each row), each of at most `size` bytes but for a
    single element: a view with zero strides is copied a block at a time, never
    whole."""
    if array.ndim == 0 or array.nbytes <= size:
        yield array
        return
    row_bytes = array.nbytes // array.shape[0]
    if row_bytes <= size or array.ndim == 1:
        rows = max(size // max(row_bytes, 1), 1)
        for start in range(0, array.shape[0], rows):
            yield array[start:start + rows]
        return
    for row in array:
        yield from c_order_blocks(row, size)
