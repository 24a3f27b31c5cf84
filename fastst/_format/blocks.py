"""Boxes of tensors and the bytes that hold them.

A box is a part of a C-ordered tensor, ``[start, stop)`` along each of its axes: what
a device's shard of a JAX array, a tensor-parallel rank's slice or a basic NumPy index
covers. Its bytes are runs of equal length at regular places in the tensor; reading
those runs, and nothing else, reads exactly what the box holds. Runs less than a page
(RUN_GAP) apart are read as one, the gap read and dropped (`widened`): a read call
costs more than copying a few KiB, and the disk reads whole pages anyway; a file read
by ranges joins requests up to RUN_GAP apart, so its runs are joined as its requests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np

from .._core import SafetensorError, TensorInfo, dtype_bits

if TYPE_CHECKING:   # numpy.typing costs milliseconds to import
    import numpy.typing as npt

__all__ = ["Box", "RUN_GAP", "bounding", "box_bytes", "box_of_index", "check_split",
           "device_boxes", "grouped", "index_of", "join_gap", "leading_index", "packed_refusal",
           "part_of", "runs_of", "shape_of", "whole", "widened", "within"]

Box = Tuple[Tuple[int, int], ...]     # (start, stop) along each axis
# Runs of a box closer than this are read as one: a page, about what a read call
# costs in bytes copied. The core joins requests for byte ranges up to this far apart
# (RANGE_GAP): for a file read by ranges, runs this far apart are joined too.
RUN_GAP = 4 << 10
Split = Literal["chunk", "tensor_split"]
SPLITS = ("chunk", "tensor_split")


def whole(shape: Sequence[int]) -> Box:
    """The box of a whole tensor of `shape`."""
    return tuple((0, int(n)) for n in shape)


def shape_of(box: Box) -> Tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def index_of(box: Box) -> Tuple[slice, ...]:
    """The NumPy index that selects `box`."""
    return tuple(slice(start, stop) for start, stop in box)


def leading_index(box: Box, shape: Sequence[int]) -> Any:
    """The NumPy index that selects `box`, without the trailing axes it takes whole
    (a packed tensor may be indexed along its leading axes only)."""
    spans = list(box)
    while spans and spans[-1] == (0, shape[len(spans) - 1]):
        spans.pop()
    return tuple(slice(start, stop) for start, stop in spans) if spans else Ellipsis


def box_of_index(index: Any, shape: Sequence[int]) -> Optional[Tuple[Box, Tuple[Any, ...]]]:
    """The smallest box that holds what a basic index (ints, slices with any step,
    ``...``) selects from a tensor of `shape`, and the same index relative to the box;
    None for an index of another kind (None, arrays, booleans), or one NumPy refuses
    (it says why when it is applied)."""
    parts = index if isinstance(index, tuple) else (index,)
    if not all(_is_plain(part) for part in parts) or sum(p is Ellipsis for p in parts) > 1:
        return None
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts = parts[:at] + (slice(None),) * (len(shape) - len(parts) + 1) + parts[at + 1:]
    if len(parts) > len(shape):
        return None
    parts = parts + (slice(None),) * (len(shape) - len(parts))
    box: List[Tuple[int, int]] = []
    local: List[Any] = []
    for part, n in zip(parts, shape):
        if isinstance(part, slice):
            span, relative = _slice_span(part, int(n))
            box.append(span)
            local.append(relative)
            continue
        position = int(part) + n if part < 0 else int(part)
        if not 0 <= position < n:
            return None
        box.append((position, position + 1))
        local.append(0)
    return tuple(box), tuple(local)


def _is_plain(part: Any) -> bool:
    if isinstance(part, (bool, np.bool_)):
        return False
    return part is Ellipsis or isinstance(part, (slice, int, np.integer))


def _slice_span(part: slice, n: int) -> Tuple[Tuple[int, int], slice]:
    """The span [first, last + 1) a slice of an axis of length `n` touches, and the
    slice relative to it."""
    rows = range(*part.indices(n))
    if not rows:
        return (0, 0), slice(0, 0)
    first, last = min(rows[0], rows[-1]), max(rows[0], rows[-1])
    stop = rows.stop - first
    return (first, last + 1), slice(rows.start - first, stop if stop >= 0 else None, rows.step)


def runs_of(box: Box, shape: Sequence[int], itemsize: int) -> Tuple[npt.NDArray[np.int64], int]:
    """Where the bytes of `box` lie in a C-ordered tensor of `shape` whose elements
    take `itemsize` bytes: (the offset of each run, from the tensor's first byte, in
    the box's C order; the length of every run). Each run is as long as it can be:
    the axes after the last one the box narrows come whole. An empty box has no run."""
    if any(stop <= start for start, stop in box):
        return np.empty(0, np.int64), 0
    strides = _strides(shape, itemsize)
    inner = len(box) - 1
    while inner >= 0 and box[inner] == (0, shape[inner]):
        inner -= 1
    if inner < 0:
        return np.zeros(1, np.int64), int(np.prod(shape, dtype=object)) * itemsize
    start, stop = box[inner]
    offsets = np.full(1, start * strides[inner], np.int64)
    for axis in range(inner - 1, -1, -1):
        first, last = box[axis]
        steps = np.arange(first, last, dtype=np.int64) * strides[axis]
        offsets = (steps[:, None] + offsets[None, :]).reshape(-1)
    return offsets, (stop - start) * strides[inner]


def join_gap(backend: str) -> int:
    """Runs of bytes closer than this are read as one by a handle of `backend`."""
    return RUN_GAP + 1 if backend == "ranges" else RUN_GAP


def widened(box: Box, shape: Sequence[int], itemsize: int, gap: int = RUN_GAP) -> Box:
    """`box`, taken whole along its innermost narrowed axes for as long as its runs
    of bytes would lie less than `gap` bytes apart: the box worth reading to get
    `box` (the same box when its runs are further apart, or it has one run)."""
    strides = _strides(shape, itemsize)
    spans = list(box)
    while True:
        inner = len(spans) - 1
        while inner >= 0 and spans[inner] == (0, shape[inner]):
            inner -= 1
        if inner <= 0 or all(stop - start <= 1 for start, stop in spans[:inner]):
            return tuple(spans)
        run = (spans[inner][1] - spans[inner][0]) * strides[inner]
        if strides[inner - 1] - run >= gap:
            return tuple(spans)
        spans[inner] = (0, shape[inner])


def within(box: Box, outer: Box) -> Tuple[slice, ...]:
    """The index of `box` in an array of `outer`, a box that holds it."""
    return tuple(slice(start - first, stop - first)
                 for (start, stop), (first, _) in zip(box, outer))


def bounding(boxes: Sequence[Box]) -> Box:
    """The smallest box that holds all of `boxes` (of one tensor)."""
    return tuple((min(start for start, _ in spans), max(stop for _, stop in spans))
                 for spans in zip(*boxes))


def grouped(boxes: Dict[Box, List[Any]]) -> List[Tuple[Box, Dict[Box, List[Any]]]]:
    """The reads that get the distinct `boxes` of one tensor (box -> the devices that
    hold it), each with the boxes it holds: one read of their bounding box when
    they tile it (the shards of one process's devices mostly do: a block of the
    array, read with few calls however the shards cut it), else one read a box."""
    if not boxes:
        return []
    bound = bounding(list(boxes))
    if sum(box_bytes(box, 1) for box in boxes) == box_bytes(bound, 1):
        return [(bound, boxes)]
    return [(box, {box: devices}) for box, devices in boxes.items()]


def _strides(shape: Sequence[int], itemsize: int) -> List[int]:
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= int(n)
    return strides[::-1]


def box_bytes(box: Box, itemsize: int) -> int:
    return int(np.prod(shape_of(box), dtype=object)) * itemsize


def part_of(n: int, parts: int, part: int, split: Split = "chunk") -> Tuple[int, int]:
    """[start, stop) of part `part` of `parts` along an axis of length `n`.

    ``"chunk"`` as ``torch.chunk``: parts of ``ceil(n / parts)``, the last ones
    shorter, and empty where ``torch.chunk`` gives fewer parts than asked;
    ``"tensor_split"`` as ``torch.tensor_split`` (and ``numpy.array_split``): the
    first ``n % parts`` parts one longer than the others."""
    if split == "chunk":
        size = -(-n // parts)
        return min(part * size, n), min((part + 1) * size, n)
    small, longer = divmod(n, parts)
    start = part * small + min(part, longer)
    return start, start + small + (part < longer)


def check_split(split: Any) -> None:
    if split not in SPLITS:
        raise SafetensorError(f"split must be 'chunk' or 'tensor_split', got {split!r}")


def packed_refusal(source: str, name: str, info: TensorInfo, box: Box) -> Optional[str]:
    """Why `box` cannot be read of a packed sub-byte tensor (F4, F6_*), whose array
    is its bytes: its leading axes may be split, never the packed last one (nor any
    axis of a tensor packed flat); None when it can, or the tensor is not packed."""
    if dtype_bits(info.dtype) >= 8:
        return None
    array_shape = info.array_shape or ()
    flat = len(array_shape) != len(info.shape)
    split = [axis for axis, span in enumerate(box) if span != (0, array_shape[axis])]
    if not split or (not flat and split[-1] < len(array_shape) - 1):
        return None
    return (f"{source}: tensor {name!r} ({info.dtype}, shape {info.shape}) is stored packed: "
            f"only its leading axes can be split, not the packed last one"
            + (" (its last axis does not hold whole bytes: it is packed flat)" if flat else ""))


def device_boxes(sharding: Any, shape: Tuple[int, ...], tensor: str) -> Dict[Box, List[Any]]:
    """The box of each addressable device's shard of an array of `shape` laid out by
    `sharding` (anything with JAX's ``addressable_devices_indices_map``), and the
    devices that hold each box, in the sharding's order: a box held by several
    devices (replicated) is read once and copied to the others. `tensor` names the
    array in errors."""
    check_fit(sharding, shape, tensor)
    boxes: Dict[Box, List[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        found = box_of_index(tuple(index), shape)
        if found is None:
            raise SafetensorError(f"{tensor}: sharding {sharding!r} gives device {device} an "
                                  f"index that is not a box: {index!r}")
        boxes.setdefault(found[0], []).append(device)
    return boxes


def check_fit(sharding: Any, shape: Tuple[int, ...], tensor: str) -> None:
    """Refuse a `sharding` that cannot lay out an array of `shape`, as
    ``jax.device_put`` refuses it (the same error, a ValueError, naming `tensor` and
    `shape` too): one of more dimensions than the array (JAX's shardings check it),
    or whose tiling does not divide a dimension (``IndivisibleError``)."""
    check_rank = getattr(sharding, "check_compatible_aval", None)
    try:
        if check_rank is not None:
            check_rank(shape)
        sharding.shard_shape(shape)
    except ValueError as error:
        raise type(error)(f"{tensor} (shape {shape}): {error}") from None

