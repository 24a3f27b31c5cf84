"""The boxes of a tensor's parts (``fastst._format.blocks``): which bytes of the file
hold a box, and which part of a split each rank owns, as torch cuts it."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fastst._format.blocks import RUN_GAP, box_of_index, part_of, runs_of, widened, within


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_runs_of_a_box_hold_exactly_its_bytes(data):
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    box = tuple(tuple(sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n)))))
                for n in shape)
    itemsize = data.draw(st.sampled_from([1, 2, 4, 8]))
    array = np.arange(int(np.prod(shape)) * itemsize, dtype=np.uint64).astype(np.uint8)
    raw = array.tobytes()
    blocks = array.reshape(shape + (itemsize,)) if shape else array.reshape(itemsize)
    offsets, length = runs_of(box, shape, itemsize)
    got = b"".join(raw[offset:offset + length] for offset in offsets)
    want = blocks[tuple(slice(a, b) for a, b in box)].tobytes()
    assert got == want
    gap = data.draw(st.sampled_from([0, 8, 64, RUN_GAP]))
    wide = widened(box, shape, itemsize, gap)
    assert all(a <= c and d <= b for (a, b), (c, d) in zip(wide, box))
    offsets, length = runs_of(wide, shape, itemsize)
    assert len(offsets) <= 1 or np.diff(offsets).min() - length >= gap
    inside = blocks[tuple(slice(a, b) for a, b in wide)][within(box, wide)]
    assert inside.tobytes() == want


def test_basic_indices_become_boxes_and_others_do_not():
    assert box_of_index((1, slice(None, None, -2)), (3, 5)) == \
        (((1, 2), (0, 5)), (0, slice(4, None, -2)))
    assert box_of_index((..., 3), (2, 3, 4)) == (((0, 2), (0, 3), (3, 4)),
                                                (slice(0, 2, 1), slice(0, 3, 1), 0))
    for other in [None, (np.array([0]),), (True,), (0, None), (5,)]:
        assert box_of_index(other, (3, 4)) is None


@pytest.mark.parametrize("split", ["chunk", "tensor_split"])
def test_parts_are_those_torch_cuts(split):
    torch = pytest.importorskip("torch")
    for n in range(0, 23):
        for parts in range(1, 7):
            pieces = (torch.arange(n).chunk(parts) if split == "chunk"
                      else torch.arange(n).tensor_split(parts))
            for part in range(parts):
                start, stop = part_of(n, parts, part, split)
                want = pieces[part].tolist() if part < len(pieces) else []
                assert list(range(start, stop)) == want, (n, parts, part)
