"""get_slice(name)[index] gives exactly what NumPy gives on the full array."""
import io

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import fastst
from helpers import raw_file

SHAPES = [(), (5,), (4, 6), (3, 1, 5), (2, 3, 0, 2)]


@pytest.fixture(scope="module")
def opened(tmp_path_factory):
    path = tmp_path_factory.mktemp("slices") / "s.safetensors"
    tensors = {f"t{i}": np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
               for i, shape in enumerate(SHAPES)}
    fastst.save_file(tensors, path)
    handles = {backend: fastst.safe_open(path, backend=backend) for backend in ("mmap", "pread")}
    handles["ranges"] = fastst.safe_open(io.BytesIO(path.read_bytes()))   # a file object
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


@pytest.mark.parametrize("index", [
    (np.array([-9]), -2, np.array([], np.int64), Ellipsis),
    (np.array([7]), slice(None), np.array([], np.int64)),
    (np.array([7]), np.zeros((2, 5), bool)),
    (np.array([7]), np.array([], np.int64).reshape(0, 1)),
    (np.array([], np.int64), 0, np.array([5])),
    ([[7]], np.zeros((0, 1), np.int64)),
    (Ellipsis, np.array([9]), np.array([], np.int64)),
    (slice(0, 0), np.array([7])),
    (np.array([7]), slice(3, 1)),
    (slice(None, None, -1), slice(5, 0), np.array([0, -9])),
], ids=repr)
def test_arrays_out_of_range_are_refused_even_when_they_select_nothing(opened, index):
    """NumPy checks no value of an index's arrays when the result has no element
    (a slice that selects nothing, arrays that broadcast to no element), or warns
    (before 2.5): fastst checks them, so that every backend says the same whatever
    NumPy's version."""
    _, handles = opened
    for backend, handle in handles.items():
        with pytest.raises(fastst.SafetensorIndexError,
                           match="out of bounds for tensor dimension|Invalid index"):
            handle.get_slice("t3")[index]


@pytest.mark.parametrize("index", [
    (np.array([], np.int64), np.array([0])),
    (np.array([2]), slice(None), np.array([], np.int64)),
    (np.array([-3]), np.zeros((1, 5), bool)),
    (np.array([7, 1]), np.array([0, 1])),
    (np.array([1, 2]), [0]),
    (Ellipsis, np.array([0]), np.array([], np.int64)),
], ids=repr)
def test_arrays_in_range_that_select_nothing_give_numpys_answer(opened, index):
    check(opened, "t3", index)


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
    from conftest import cpu_beside
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.ones((16384, 1024), np.float32)}, path)
    rows = np.random.default_rng(0).integers(0, 16384, 16384 * 6)
    batches = []
    with fastst.safe_open(path) as f:
        s = f.get_slice("x")
        s[:].sum()     # page the file in: measure the gather, not the first faults
        work_cpu, other_cpu = cpu_beside(lambda: batches.append(s[rows]))
    assert batches[0].shape == (rows.size, 1024)
    assert work_cpu > 0.05 and other_cpu > work_cpu / 2, (other_cpu, work_cpu)


def bytes_read_by(handle, monkeypatch):
    """A list that collects the bytes each row read of `handle` returns."""
    sizes = []
    for method in ("read_rows", "gather_rows", "get_tensor"):
        original = getattr(type(handle), method)

        def counted(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            sizes.append(result.nbytes)
            return result
        monkeypatch.setattr(type(handle), method, counted)
    return sizes


def proc_read_bytes() -> int:
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_pread_narrowed_gather_reads_each_distinct_row_once(tmp_path, monkeypatch):
    rows, width = 8, 1 << 18                       # 1 MiB rows
    full = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"w": full}, path)
    with fastst.safe_open(path, backend="pread") as f:
        s = f.get_slice("w")
        read = {}
        for repeats in (1, 64):
            index = (np.full(repeats, 5), slice(2, 4))
            sizes = bytes_read_by(f, monkeypatch)
            before = proc_read_bytes()
            got = s[index]
            read[repeats] = (sum(sizes), proc_read_bytes() - before)
            monkeypatch.undo()
            np.testing.assert_array_equal(got, full[index])
        assert read[1][0] == read[64][0] == width * 4     # the row, once
        assert read[64][1] < 2 * read[1][1]              # as the kernel counts it too
        mixed = (np.array([7, 1, 7, -1, 1, 0]), slice(None, None, 1000))
        sizes = bytes_read_by(f, monkeypatch)
        np.testing.assert_array_equal(s[mixed], full[mixed])
        assert sum(sizes) == 3 * width * 4               # rows 0, 1 and 7


@pytest.mark.parametrize("batch_bytes", [1, 64, 1 << 30])
def test_narrowed_gathers_read_in_batches_give_numpys_answer(tmp_path, monkeypatch,
                                                             batch_bytes):
    import fastst._handles.slicing
    monkeypatch.setattr(fastst._handles.slicing, "GATHER_BATCH_BYTES", batch_bytes)
    full = np.arange(20 * 6, dtype=np.int16).reshape(20, 2, 3)
    path = tmp_path / "b.safetensors"
    fastst.save_file({"t": full}, path)
    with fastst.safe_open(path, backend="pread") as f:
        for index in [(np.array([3, 19, 3, 0, -20]), 1), (np.array([4, 4]), slice(None), 2),
                      (np.array([], np.int64), 0), (np.array([2, 1]), ..., None, slice(1, None))]:
            np.testing.assert_array_equal(f.get_slice("t")[index], full[index])
            assert f.get_slice("t")[index].shape == full[index].shape


def test_pread_gather_of_empty_rows_of_an_unrepresentable_count(tmp_path):
    path = tmp_path / "z.safetensors"
    path.write_bytes(raw_file({"z": {"dtype": "U8", "shape": [1, 2**62, 0],
                                     "data_offsets": [0, 0]}}))
    handles = [fastst.safe_open(path, backend=backend) for backend in ("mmap", "pread")]
    for index in [(np.array([0, 0]), slice(None, 3)), (np.zeros(64, np.int64), 5),
                  (np.array([0, -1]), slice(2**62 - 2, None), slice(None))]:
        mapped, read = (handle.get_slice("z")[index] for handle in handles)
        assert mapped.shape == read.shape and mapped.dtype == read.dtype == np.uint8
        assert read.size == 0
    for handle in handles:        # 2 * 2**62 rows cannot be one array, either way
        with pytest.raises(fastst.SafetensorError, match=f"{path}.*'z'"):
            handle.get_slice("z")[np.array([0, 0])]
        handle.close()


OUT_OF_RANGE = [
    5, -6, np.int64(7), np.uint8(9), (0, 6), (slice(None), -7), (1, 2, 3),
    np.array([0, 5]), np.array([-6]), np.array([2**63], np.uint64), [0, 5], (np.array([1]), 9),
    (np.array([1, 2]), np.array([0, 6])), np.array([[0], [5]]), np.ones(4, bool),
    (Ellipsis, 6), (None, 5), 1.5,
]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("index", OUT_OF_RANGE, ids=repr)
def test_out_of_range_indices_raise_safetensor_index_error(tmp_path, backend, index):
    path = tmp_path / "r.safetensors"
    full = np.arange(30, dtype=np.float32).reshape(5, 6)
    fastst.save_file({"grid": full}, path)
    with pytest.raises(IndexError):
        full[index]
    with fastst.safe_open(path, backend=backend) as f:
        with pytest.raises(fastst.SafetensorIndexError) as error:
            f.get_slice("grid")[index]
    assert isinstance(error.value, IndexError) and isinstance(error.value, fastst.SafetensorError)
    assert str(path) in str(error.value) and "'grid'" in str(error.value)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_index_into_a_0d_tensor_raises_safetensor_index_error(tmp_path, backend):
    path = tmp_path / "s.safetensors"
    fastst.save_file({"scalar": np.float64(2.5)}, path)
    with fastst.safe_open(path, backend=backend) as f:
        assert f.get_slice("scalar")[()] == 2.5
        for index in (0, slice(None), np.array([0])):
            with pytest.raises(fastst.SafetensorIndexError, match="'scalar'"):
                f.get_slice("scalar")[index]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_out_of_range_indices_start_with_the_references_message(tmp_path, backend):
    """Code written for the reference compares its message, or the message's start:
    fastst's is the reference's, then the tensor and the file."""
    safetensors = pytest.importorskip("safetensors")
    path = tmp_path / "words.safetensors"
    fastst.save_file({"t": np.zeros((10, 5), np.float32)}, path)
    with safetensors.safe_open(str(path), framework="np") as theirs, \
            fastst.safe_open(path, backend=backend) as ours:
        for index in [(slice(2, None), 20), (slice(2, None), -6), 10, (0, 5), (-1, 20),
                      (slice(None, 3), np.int64(7)), (slice(1, 3, 1), 5)]:
            with pytest.raises(Exception) as expected:
                theirs.get_slice("t")[index]
            with pytest.raises(fastst.SafetensorIndexError) as got:
                ours.get_slice("t")[index]
            assert str(got.value) == f"{expected.value} (tensor 't' of {path})", index


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_an_out_of_range_index_the_reference_does_not_take_has_no_slicing_prefix(
        tmp_path, backend):
    """Arrays, steps and Ellipsis: the reference has no message with them to keep."""
    path = tmp_path / "words.safetensors"
    fastst.save_file({"t": np.zeros((10, 5), np.float32)}, path)
    words = "index 12 out of bounds for tensor dimension #0 of size 10"
    with fastst.safe_open(path, backend=backend) as f:
        for index in [np.array([0, 12]), (12, slice(None, None, 2)), (Ellipsis, 12, 0)]:
            with pytest.raises(fastst.SafetensorIndexError) as got:
                f.get_slice("t")[index]
            assert str(got.value) == f"{words} (tensor 't' of {path})", index


@pytest.mark.parametrize("index", [3, slice(1, 3), (1, 2), (slice(None), 0), (Ellipsis, 1),
                                   (None, 2)])
def test_ints_and_slices_of_a_map_skip_the_check_of_arrays(opened, index, monkeypatch):
    """An index of ints, slices, None and Ellipsis of a mapped tensor has no array to
    check against it: NumPy's own checks are all, and fastst's walk of the index is
    skipped (it cost some 60% of a row read); an index with an array is still walked."""
    import fastst._handles.slicing as slicing

    tensors, handles = opened
    walked = []
    check_arrays = slicing._check_arrays_in_range
    monkeypatch.setattr(slicing, "_check_arrays_in_range",
                        lambda *args: walked.append(args) or check_arrays(*args))
    part = handles["mmap"].get_slice("t2")
    assert np.array_equal(part[index], tensors["t2"][index]) and not walked
    part[[1]]
    assert len(walked) == 1
