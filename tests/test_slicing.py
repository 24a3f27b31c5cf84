"""get_slice(name)[index] gives exactly what NumPy gives on the full array."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import fastst

SHAPES = [(), (5,), (4, 6), (3, 1, 5), (2, 3, 0, 2)]


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    path = tmp_path_factory.mktemp("slices") / "s.safetensors"
    tensors = {f"t{i}": np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
               for i, shape in enumerate(SHAPES)}
    fastst.save_file(tensors, path)
    handles = {backend: fastst.safe_open(path, backend=backend) for backend in ("mmap", "pread")}
    yield tensors, handles
    for handle in handles.values():
        handle.close()


def outcome(function):
    try:
        return "value", function()
    except IndexError:
        return "error", IndexError


def check(opened, name, index):
    tensors, handles = opened
    expected = outcome(lambda: tensors[name][index])
    for backend, handle in handles.items():
        got = outcome(lambda: handle.get_slice(name)[index])
        assert got[0] == expected[0], (backend, index)
        if got[0] == "value":
            np.testing.assert_array_equal(got[1], expected[1])
            assert got[1].shape == expected[1].shape and got[1].dtype == expected[1].dtype


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_basic_indexing_matches_numpy(opened, data):
    i = data.draw(st.integers(0, len(SHAPES) - 1))
    shape = SHAPES[i]
    index = data.draw(hnp.basic_indices(shape, min_dims=0, allow_newaxis=False,
                                        allow_ellipsis=True))
    check(opened, f"t{i}", index)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_out_of_range_and_odd_indices_match_numpy(opened, data):
    i = data.draw(st.integers(1, len(SHAPES) - 1))
    bound = st.one_of(st.none(), st.integers(-12, 12))
    step = st.one_of(st.none(), st.integers(-4, 4).filter(bool))
    part = st.one_of(st.integers(-8, 8), st.builds(slice, bound, bound, step),
                     st.just(Ellipsis), st.integers(-8, 8).map(np.int64))
    index = data.draw(st.lists(part, max_size=len(SHAPES[i]) + 1).map(tuple))
    check(opened, f"t{i}", index)


def test_integer_array_gathers_rows(opened):
    rows = np.array([3, 0, 3, 1])
    check(opened, "t1", rows)
    check(opened, "t1", (rows, slice(None, None, 2)))
    check(opened, "t1", np.array([4]))


def test_slices_are_views_where_numpy_gives_views(opened):
    tensors, handles = opened
    part = handles["mmap"].get_slice("t2")[1:3, ::2]
    assert not part.flags.owndata
    assert np.shares_memory(part, handles["mmap"].get_tensor("t2"))


def test_slice_describes_its_tensor(opened):
    _, handles = opened
    s = handles["mmap"].get_slice("t3")
    assert s.get_shape() == [3, 1, 5] and s.shape == (3, 1, 5) and s.ndim == 3
    assert s.get_dtype() == "I32" and s.dtype == np.int32 and len(s) == 3
    with pytest.raises(TypeError):
        len(handles["mmap"].get_slice("t0"))
    with pytest.raises(fastst.TensorNotFoundError):
        handles["mmap"].get_slice("missing")


def test_packed_sub_byte_tensors_slice_on_leading_axes(tmp_path):
    from test_validation_helpers import raw_file
    data = raw_file({"q": {"dtype": "F4", "shape": [3, 4], "data_offsets": [0, 6]}},
                    bytes(range(6)))
    path = tmp_path / "f4.safetensors"
    path.write_bytes(data)
    with fastst.safe_open(path) as f:
        q = f.get_slice("q")
        assert q.get_shape() == [3, 4] and q.get_dtype() == "F4"
        assert f.get_tensor("q").shape == (3, 2) and f.get_tensor("q").dtype == np.uint8
        np.testing.assert_array_equal(q[1:], [[2, 3], [4, 5]])
        np.testing.assert_array_equal(q[..., :], f.get_tensor("q"))
        with pytest.raises(fastst.SafetensorError, match="packed"):
            q[:, 1]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_packed_index_rules_hold_for_both_backends(tmp_path, backend):
    from test_validation_helpers import raw_file
    path = tmp_path / "f6.safetensors"
    path.write_bytes(raw_file({"q": {"dtype": "F6_E3M2", "shape": [2, 2, 4],
                                     "data_offsets": [0, 12]}}, bytes(range(12))))
    with fastst.safe_open(path, backend=backend) as f:
        q = f.get_slice("q")
        np.testing.assert_array_equal(q[1], np.arange(6, 12).reshape(2, 3))
        np.testing.assert_array_equal(q[:, 1], [[3, 4, 5], [9, 10, 11]])
        np.testing.assert_array_equal(q[np.array([1, 0])][0, 0], [6, 7, 8])
        for bad in [(0, 0, 1), (..., 0), (slice(None), slice(None), slice(1))]:
            with pytest.raises(fastst.SafetensorError, match="packed"):
                q[bad]


def test_pread_reads_only_the_rows_it_needs(tmp_path, monkeypatch):
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"m": np.arange(1000 * 16, dtype=np.float32).reshape(1000, 16)}, path)
    full = np.arange(1000 * 16, dtype=np.float32).reshape(1000, 16)
    with fastst.safe_open(path, backend="pread") as f:
        ranges, gathers = [], []
        read_rows, read_row_list = type(f).read_rows, type(f).gather_rows
        monkeypatch.setattr(type(f), "read_rows", lambda self, name, a, b:
                            ranges.append((a, b)) or read_rows(self, name, a, b))
        monkeypatch.setattr(type(f), "gather_rows", lambda self, name, rows:
                            gathers.append(rows.tolist()) or read_row_list(self, name, rows))
        m = f.get_slice("m")
        np.testing.assert_array_equal(m[10:20:3, 2], full[10:20:3, 2])
        np.testing.assert_array_equal(m[-1], full[-1])
        np.testing.assert_array_equal(m[30:5:-4], full[30:5:-4])
        np.testing.assert_array_equal(m[np.array([500, 7, -1, 7])], full[[500, 7, -1, 7]])
        np.testing.assert_array_equal(m[np.array([3, 1], np.uint8), 1:3], full[[3, 1], 1:3])
        np.testing.assert_array_equal(m[np.array([], np.int64)], full[[]])
        with pytest.raises(IndexError):
            m[np.array([1000])]
    assert ranges == [(10, 20), (999, 1000), (6, 31)]
    assert gathers == [[500, 7, 999, 7], [1, 3], []]


def test_gathering_rows_releases_the_gil(tmp_path):
    """Data loaders gather random rows in threads: the copy runs without the GIL."""
    from conftest import time_with_longest_pause
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.ones((16384, 1024), np.float32)}, path)
    rows = np.random.default_rng(0).integers(0, 16384, 16384 * 6)
    batches = []
    with fastst.safe_open(path) as f:
        s = f.get_slice("x")
        s[:].sum()     # page the file in: measure the gather, not the first faults
        elapsed, longest_pause = time_with_longest_pause(lambda: batches.append(s[rows]))
    assert batches[0].shape == (rows.size, 1024)
    assert elapsed > 0.05 and longest_pause < elapsed / 2, (longest_pause, elapsed)
