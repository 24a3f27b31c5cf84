"""A torch checkpoint -> safetensors, without torch and without running its pickle:
the tensors of the (possibly nested) object, tied weights kept once, each tensor
read by byte range and written in C order, little-endian."""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
from collections import OrderedDict

from .. import SafetensorError
from ._output import Declared
from ._torch_files import CHUNK, Checkpoint
from ._torch_pickle import TensorRef

__all__ = ["flatten", "tied_names", "declare", "MAX_DEPTH"]

MAX_DEPTH = 256
# Entries a tree may repeat by referring to one container from several places (a
# pickle's memo makes that a few bytes each time): written out as a tree, a container
# is repeated in full wherever it is referred to, so a tiny pickle could otherwise
# stand for exponentially many entries.
MAX_REPEATED_ENTRIES = 1_000_000


def flatten(tree: Any, source: str, key: Optional[str] = None,
            tensor_type: Any = TensorRef) -> Tuple[List[Tuple[str, Any]], Dict[str, str]]:
    """The tensors of `tree` by name, and the metadata that describes the rest.

    A state dict (a dict of tensors) keeps its names and needs no metadata; any
    other nest (``{"model": ..., "epoch": 3}``, an optimizer state) is laid out
    as ``fastst.state`` lays it out: tensors named by their path
    (``model/embed.weight``, ``state/0/exp_avg``), the tree with its other
    leaves in the metadata, so that ``fastst.load_state`` gives it back. With
    `key`, only ``tree[key]`` is converted (a ``/``-separated path for deeper
    nests). `tensor_type` is what counts as a tensor (torch.Tensor to name the
    tensors of ``torch.load`` the same way)."""
    if key is not None:
        for part in key.split("/"):
            if not isinstance(tree, dict) or part not in tree:
                raise SafetensorError(f"{source}: the checkpoint has no key {key!r} (top-level "
                                      f"keys: {_keys(tree)})")
            tree = tree[part]
    if isinstance(tree, tensor_type):
        return [("tensor", tree)], {}
    if isinstance(tree, dict) and all(
            type(k) is str and isinstance(v, tensor_type) for k, v in tree.items()):
        return list(tree.items()), {}       # a state dict: its names as they are
    if not isinstance(tree, (dict, list, tuple)):
        raise SafetensorError(f"{source}: the checkpoint holds a {type(tree).__name__}, not "
                              f"tensors")
    from ..state import state_to_tensors

    try:
        tensors, metadata = state_to_tensors(_plain(tree, tensor_type, 0, _Walk()))
    except SafetensorError as error:
        raise type(error)(f"{source}: {error}") from None
    return list(tensors.items()), metadata


class _Walk:
    """The containers a walk of a tree has met, and the entries it has repeated by
    meeting some of them again."""

    def __init__(self) -> None:
        self.seen: Set[int] = set()   # ids: the tree keeps every container alive meanwhile
        self.repeated = 0

    def meet(self, container: Any) -> None:
        if id(container) not in self.seen:
            self.seen.add(id(container))
            return
        self.repeated += len(container) + 1
        if self.repeated > MAX_REPEATED_ENTRIES:
            raise SafetensorError(
                f"the checkpoint refers to the same containers from so many places that, "
                f"written out as a tree, it would repeat over {MAX_REPEATED_ENTRIES} entries")


def _plain(node: Any, tensor_type: Any, depth: int, walk: _Walk) -> Any:
    """`node` in the types a state tree holds: dict and tuple subclasses (a state
    dict's OrderedDict, torch.Size) as the plain type, sets as lists, dtypes,
    devices and complex numbers as their text."""
    if depth > MAX_DEPTH:
        raise SafetensorError(f"the checkpoint nests deeper than {MAX_DEPTH}")
    if isinstance(node, tensor_type) or node is None or type(node) in (bool, int, float, str,
                                                                       bytes):
        return node
    if isinstance(node, (dict, list, set, frozenset, tuple)):
        walk.meet(node)
    if isinstance(node, OrderedDict):
        return OrderedDict((k, _plain(v, tensor_type, depth + 1, walk)) for k, v in node.items())
    if isinstance(node, dict):
        return {k: _plain(v, tensor_type, depth + 1, walk) for k, v in node.items()}
    if isinstance(node, (list, set, frozenset)):
        return [_plain(v, tensor_type, depth + 1, walk) for v in node]
    if isinstance(node, tuple):
        return tuple(_plain(v, tensor_type, depth + 1, walk) for v in node)
    if isinstance(node, bytearray):
        return bytes(node)
    return str(node)


def _keys(tree: Any) -> str:
    if not isinstance(tree, dict):
        return f"none: it is a {type(tree).__name__}"
    shown = [repr(k) for k in list(tree)[:10]]
    return ", ".join(shown) + (", ..." if len(tree) > 10 else "")


def tied_names(tensors: List[Tuple[str, TensorRef]]) -> Dict[str, str]:
    """Names whose tensor is another's exactly (same storage, dtype, offset, shape
    and stride: tied weights) -> the name kept, the first in sorted order, as
    ``save_model`` keeps it."""
    by_layout: Dict[Tuple[Any, ...], List[str]] = {}
    for name, ref in tensors:
        if ref.numel:
            by_layout.setdefault(ref.layout(), []).append(name)
    dropped: Dict[str, str] = {}
    for names in by_layout.values():
        kept, *others = sorted(names)
        for name in others:
            dropped[name] = kept
    return dropped


def _byte_order_dtype(code: str, itemsize: int) -> Tuple[np.dtype, np.dtype]:
    """Big- and little-endian NumPy dtypes of the width of `code`, for swapping."""
    if code == "C64":
        return np.dtype(">c8"), np.dtype("<c8")
    return np.dtype(f">u{itemsize}"), np.dtype(f"<u{itemsize}")


def declare(checkpoint: Checkpoint, name: str, ref: TensorRef) -> Declared:
    """The Declared tensor `name` of `checkpoint`: header entry, and its bytes."""
    begin, end = ref.byte_span()
    byte_range = checkpoint.ranges[ref.storage.key]
    if end > ref.storage.nbytes or end > byte_range.size:
        raise SafetensorError(
            f"{checkpoint.source}: tensor {name!r} (shape {list(ref.shape)}, stride "
            f"{list(ref.stride)}, offset {ref.offset}) reaches byte {end} of storage "
            f"{ref.storage.key!r}, which holds {byte_range.size}")
    swap = checkpoint.big_endian and ref.itemsize > 1
    if ref.is_contiguous() and not swap:
        def chunks() -> Iterator[memoryview]:
            buffer = bytearray(min(CHUNK, end - begin))
            for position in range(begin, end, CHUNK):
                view = memoryview(buffer)[:min(CHUNK, end - position)]
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
            compact = np.ascontiguousarray(array.astype(little, copy=False))
            yield compact.reshape(-1).view(np.uint8).data
    return Declared(name, ref.code, ref.header_shape(), ref.nbytes, chunks)

