"""update_metadata: in place when the new header fits the old one's room, else a
bounded, atomic rewrite; the tensors' bytes never change."""
import hashlib
import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import fastst
from fastst.writer import WriteSpec


def data_digest(path):
    with fastst.safe_open(path) as handle:
        start = handle.data_start
    with open(path, "rb") as file:
        file.seek(start)
        return hashlib.sha256(file.read()).hexdigest()


@pytest.fixture
def model(tmp_path, rng):
    path = tmp_path / "model.safetensors"
    tensors = {"w": rng.standard_normal((64, 32)).astype(np.float32),
               "b": np.arange(7, dtype=np.int16), "e": np.zeros((0, 3), np.uint8)}
    fastst.save_file(tensors, path, {"format": "np", "author": "someone with a long name"})
    return path, tensors


def test_a_smaller_header_is_edited_in_place(model):
    path, tensors = model
    inode, digest, size = path.stat().st_ino, data_digest(path), path.stat().st_size
    assert fastst.update_metadata(path, {"format": "pt"}) is True
    assert path.stat().st_ino == inode and path.stat().st_size == size
    assert data_digest(path) == digest
    with fastst.safe_open(path) as handle:
        assert handle.metadata() == {"format": "pt"}
    assert safetensors.safe_open(str(path), "np").metadata() == {"format": "pt"}
    loaded = safetensors.numpy.load_file(path)
    assert all(loaded[name].tobytes() == array.tobytes() for name, array in tensors.items())


def test_an_edit_that_fits_can_still_be_an_atomic_rewrite(model):
    path, tensors = model
    inode = path.stat().st_ino
    assert fastst.update_metadata(path, {"format": "pt"}, in_place=False, fsync=True) is False
    assert path.stat().st_ino != inode
    assert path.read_bytes() == fastst.save(tensors, {"format": "pt"})


def test_metadata_can_be_removed_in_place(model):
    path, _ = model
    assert fastst.update_metadata(path, None) is True
    with fastst.safe_open(path) as handle:
        assert handle.metadata() is None


def test_a_larger_header_rewrites_the_file_atomically_with_the_same_data(model):
    path, tensors = model
    inode, digest = path.stat().st_ino, data_digest(path)
    metadata = {"notes": "x" * 5000}
    assert fastst.update_metadata(path, metadata) is False
    assert path.stat().st_ino != inode
    assert data_digest(path) == digest
    assert path.read_bytes() == fastst.save(tensors, metadata)
    assert [name for name in os.listdir(path.parent) if name.endswith(".fastst-tmp")] == []


def test_header_padding_makes_the_next_edits_in_place(model):
    path, tensors = model
    assert fastst.update_metadata(path, {"v": "1"}, header_padding=4096) is False
    inode = path.stat().st_ino
    for version in range(2, 6):
        assert fastst.update_metadata(path, {"v": str(version) * 1000}) is True
    assert path.stat().st_ino == inode
    loaded = safetensors.numpy.load_file(path)
    assert all(loaded[name].tobytes() == array.tobytes() for name, array in tensors.items())
    with fastst.safe_open(path) as handle:
        assert handle.metadata() == {"v": "5" * 1000}
        assert handle.data_start % 8 == 0


def test_a_streamed_file_with_header_padding_is_edited_in_place(tmp_path):
    path = tmp_path / "padded.safetensors"
    fastst.save_file_from({"a": ("F32", (3,))}, [("a", np.ones(3, np.float32))], path,
                          header_padding=256)
    assert fastst.update_metadata(path, {"step": "1000"}) is True
    assert fastst.load_file(path)["a"].tolist() == [1, 1, 1]


def test_save_file_reserves_room_for_edits_in_place(tmp_path):
    path = tmp_path / "saved.safetensors"
    tensors = {"w": np.arange(6, dtype=np.float64).reshape(2, 3)}
    fastst.save_file(tensors, path, metadata={"a": "b"}, header_padding=512)
    inode, size = os.stat(path).st_ino, os.stat(path).st_size
    assert size == len(fastst.save(tensors, metadata={"a": "b"})) + 512
    assert fastst.update_metadata(path, {"a": "b" * 400}) is True
    assert (os.stat(path).st_ino, os.stat(path).st_size) == (inode, size)
    assert fastst.load_file(path)["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="header_padding"):
        fastst.save_file(tensors, tmp_path, max_shard_size=100, header_padding=8)


def test_serialize_file_reserves_room_for_edits_in_place(tmp_path):
    path = tmp_path / "room.safetensors"
    specs = [WriteSpec("w", "F32", (4,), np.arange(4, dtype=np.float32))]
    fastst.serialize_file(specs, path, {"a": "b"}, header_padding=512)
    assert path.read_bytes() == fastst.serialize(specs, {"a": "b"}, header_padding=512)
    assert fastst.update_metadata(path, {"a": "b" * 400}) is True
    assert fastst.load_file(path)["w"].tolist() == [0, 1, 2, 3]


def test_a_file_whose_tensors_are_not_in_writer_order_keeps_its_layout(tmp_path):
    # Another writer put the small tensor first; the edit must not move any byte.
    a, b = np.arange(4, dtype=np.uint8), np.arange(3, dtype=np.float64)
    data = fastst.writer.plan_write([WriteSpec("u", "U8", (4,), a),
                                     WriteSpec("f", "F64", (3,), b)], None,
                                    keep_order=True, header_padding=64).to_bytes()
    path = tmp_path / "foreign.safetensors"
    path.write_bytes(data)
    with fastst.safe_open(path) as handle:
        assert handle.offset_keys() == ["u", "f"]
    for metadata in ({"k": "v"}, {"k": "v" * 500}):
        fastst.update_metadata(path, metadata)
        loaded = safetensors.numpy.load_file(path)
        assert loaded["u"].tolist() == a.tolist() and loaded["f"].tolist() == b.tolist()
        assert safetensors.safe_open(str(path), "np").metadata() == metadata


def test_a_symlink_is_edited_through(model, tmp_path):
    path, _ = model
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    fastst.update_metadata(link, {"k": "v" * 3000})
    assert link.is_symlink()
    with fastst.safe_open(path) as handle:
        assert handle.metadata() == {"k": "v" * 3000}


@pytest.mark.parametrize("metadata, error", [
    ({"k": 1}, TypeError), ({1: "v"}, TypeError), ([("k", "v")], TypeError),
])
def test_invalid_metadata_is_refused_and_the_file_untouched(model, metadata, error):
    path, _ = model
    before = path.read_bytes()
    with pytest.raises(error):
        fastst.update_metadata(path, metadata)
    assert path.read_bytes() == before


def test_a_malformed_file_is_refused_and_untouched(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10" + bytes(7) + b'{"a":1}         ')
    with pytest.raises(fastst.SafetensorError, match="bad.safetensors"):
        fastst.update_metadata(path, {"k": "v"})
    assert path.read_bytes() == b"\x10" + bytes(7) + b'{"a":1}         '


def test_a_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastst.update_metadata(tmp_path / "nope.safetensors", {})


def test_the_rewrite_copies_in_bounded_memory(tmp_path, monkeypatch):
    # Without a kernel copy, the data goes through one buffer of COPY_BLOCK bytes.
    from fastst._io import files as _files
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    monkeypatch.setattr(_files, "COPY_BLOCK", 1000)
    sizes = []
    original = os.preadv

    def preadv(fd, buffers, offset):
        sizes.append(sum(len(buffer) for buffer in buffers))
        return original(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    path = tmp_path / "m.safetensors"
    array = np.arange(10_000, dtype=np.float32)
    fastst.save_file({"a": array}, path)
    assert fastst.update_metadata(path, {"k": "v" * 100}) is False
    assert max(sizes) == 1000 and len(sizes) == 40
    assert fastst.load_file(path)["a"].tobytes() == array.tobytes()


@pytest.mark.parametrize("in_place", [True, False])
def test_an_edit_keeps_the_tensors_checksums(tmp_path, in_place):
    path = tmp_path / "summed.safetensors"
    fastst.save_file({"w": np.arange(8, dtype=np.float32)}, path, metadata={"a": "b"},
                     checksum="xxh3_64", header_padding=128)
    fastst.update_metadata(path, {"a": "c"}, in_place=in_place)
    with fastst.safe_open(path, verify=True) as f:
        assert f.metadata()["a"] == "c"
        assert f.get_tensor("w").tolist() == list(range(8))
    fastst.update_metadata(path, None)
    assert set(fastst.safe_open(path).metadata()) == {"fastst.checksums"}
