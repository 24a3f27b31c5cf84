"""Writes: determinism, atomic replacement, file modes and input checking."""
import os
import stat

import numpy as np
import pytest

import fastst
from fastst import _api


def test_output_does_not_depend_on_insertion_order():
    a, b, c = np.ones(3, np.float32), np.zeros(2, np.int8), np.arange(4, dtype=np.float64)
    one = fastst.save({"a": a, "b": b, "c": c}, metadata={"x": "1", "y": "2", "z": "3"})
    two = fastst.save({"c": c, "b": b, "a": a}, metadata={"z": "3", "x": "1", "y": "2"})
    assert one == two
    assert one.index(b'{"__metadata__":{"x":"1","y":"2","z":"3"}') == 8


def test_save_file_writes_the_same_bytes_as_save(tmp_path):
    tensors = {"w": np.arange(10, dtype=np.int16), "s": np.float64(1.0)}
    fastst.save_file(tensors, tmp_path / "f.safetensors", metadata={"k": "v"})
    assert (tmp_path / "f.safetensors").read_bytes() == fastst.save(tensors, metadata={"k": "v"})


def test_failed_save_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(4)}, path)
    before = path.read_bytes()

    def write_half_then_fail(fd, prefix, arrays, source):
        os.write(fd, prefix)
        raise OSError(28, "No space left on device", source)

    monkeypatch.setattr(_api._core, "write_fd", write_half_then_fail)
    with pytest.raises(OSError, match="No space"):
        fastst.save_file({"new": np.zeros(1000)}, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_invalid_input_fails_before_touching_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(4)}, path)
    with pytest.raises(TypeError):
        fastst.save_file({"ok": np.ones(2), "bad": np.array([object()])}, path)
    assert fastst.load_file(path)["old"].tolist() == [1.0] * 4
    assert os.listdir(tmp_path) == ["model.safetensors"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_file_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        fastst.save_file({"x": np.ones(1)}, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat(tmp_path / "m.safetensors").st_mode)
    assert mode == 0o666 & ~umask


def test_saving_through_a_symlink_replaces_its_target(tmp_path):
    real = tmp_path / "real.safetensors"
    link = tmp_path / "link.safetensors"
    fastst.save_file({"a": np.ones(1)}, real)
    link.symlink_to(real)
    fastst.save_file({"b": np.zeros(2)}, link)
    assert link.is_symlink()
    assert list(fastst.load_file(real)) == ["b"]


def test_fsync_mode_writes_the_same_file(tmp_path):
    fastst.save_file({"a": np.arange(3)}, tmp_path / "d.safetensors", fsync=True)
    assert fastst.load_file(tmp_path / "d.safetensors")["a"].tolist() == [0, 1, 2]


def test_overwriting_a_file_that_is_open_keeps_existing_views(tmp_path):
    path = tmp_path / "m.safetensors"
    fastst.save_file({"a": np.full(4, 7.0)}, path)
    with fastst.safe_open(path) as f:
        old = f.get_tensor("a")
        fastst.save_file({"a": np.full(4, 9.0)}, path)
        assert old.tolist() == [7.0] * 4
    assert fastst.load_file(path)["a"].tolist() == [9.0] * 4


@pytest.mark.parametrize("tensors, error, message", [
    ({1: np.ones(1)}, TypeError, "names must be str"),
    ({"__metadata__": np.ones(1)}, ValueError, "reserved"),
    ({"x": [1, 2, 3]}, TypeError, "expected a numpy.ndarray, got builtins.list"),
    ({"x": 1.5}, TypeError, "expected a numpy.ndarray"),
    ({"x": np.array(["a"])}, TypeError, "has no safetensors code"),
    ({"x": np.array([object()])}, TypeError, "object arrays"),
    ({"x": np.ones(2, np.complex128)}, TypeError, "complex128"),
    ({"x": np.zeros(2, "datetime64[s]")}, TypeError, "has no safetensors code"),
    ({"x": np.zeros(2, [("a", "<f4")])}, TypeError, "has no safetensors code"),
    ({"\ud800": np.ones(1)}, ValueError, "UTF-8"),
], ids=["int-name", "reserved-name", "list", "float", "str-array", "object-array",
        "complex128", "datetime", "structured", "lone-surrogate"])
def test_bad_tensors_are_refused_clearly(tensors, error, message):
    with pytest.raises(error, match=message):
        fastst.save(tensors)


@pytest.mark.parametrize("metadata", [{"k": 1}, {1: "v"}, ["k"], {"k": None}])
def test_bad_metadata_is_refused(metadata):
    with pytest.raises(TypeError, match="metadata"):
        fastst.save({"x": np.ones(1)}, metadata=metadata)


def test_non_dict_tensors_are_refused():
    with pytest.raises(TypeError, match="dict"):
        fastst.save([("x", np.ones(1))])


def test_empty_metadata_is_written_as_an_empty_object():
    assert b'"__metadata__":{}' in fastst.save({"x": np.ones(1)}, metadata={})
    assert b"__metadata__" not in fastst.save({"x": np.ones(1)}, metadata=None)
