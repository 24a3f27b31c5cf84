"""Hostile checkpoints: each is refused with a SafetensorError naming the file and
what was refused, and none runs any code (the marker file never appears)."""
from __future__ import annotations

import collections
import io
import os
import pickle
import re
import zipfile

import pytest

import fastst
from fastst.convert import torch_to_safetensors
from fastst.convert._torch_files import MAX_COMPRESSION_RATIO
from fastst.convert._torch_pickle import loads

torch = pytest.importorskip("torch")


class FakeStorage:
    """Pickled as torch's persistent storage reference."""

    def __init__(self, key, kind, numel):
        self.key, self.kind, self.numel = key, kind, numel


class FakeTensor:
    """Pickled as torch pickles a tensor: _rebuild_tensor_v2 over a storage."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride)

    def __reduce__(self):
        storage, offset, size, stride = self.args
        return (torch._utils._rebuild_tensor_v2,
                (storage, offset, torch.Size(size), stride, False, collections.OrderedDict()))


class CheckpointPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            return ("storage", obj.kind, obj.key, "cpu", obj.numel)
        return None


def pickled(tree) -> bytes:
    buffer = io.BytesIO()
    CheckpointPickler(buffer, protocol=2).dump(tree)
    return buffer.getvalue()


def write_archive(path, data_pkl: bytes, storages=(), extra=(), compress=(), order="little"):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", order)
        for key, data in storages:
            method = zipfile.ZIP_DEFLATED if key in compress else zipfile.ZIP_STORED
            archive.writestr(f"archive/data/{key}", data, compress_type=method)
        for name, data in extra:
            archive.writestr(name, data)
    return path


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "marker"
    yield path
    assert not path.exists(), "the checkpoint ran code"


def refused(tmp_path, src, match):
    with pytest.raises(fastst.SafetensorError, match=match) as info:
        torch_to_safetensors(src, tmp_path / "out.safetensors")
    assert str(src) in str(info.value)
    assert not (tmp_path / "out.safetensors").exists()


def write_marker(path):
    with open(path, "w") as fh:
        fh.write("ran")


class Reduces:
    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)


def test_a_valid_crafted_checkpoint_converts(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 0, (2, 2), (2, 1))})
    src = write_archive(tmp_path / "ok.pt", data, [("0", bytes(range(16)))])
    torch_to_safetensors(src, tmp_path / "out.safetensors")
    assert fastst.load_file(tmp_path / "out.safetensors")["w"].tobytes() == bytes(range(16))


def test_a_compressed_member_is_read_as_a_stream(tmp_path):
    payload = os.urandom(4096)
    data = pickled({"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 1024), 0, (32, 32),
                                    (1, 32)),
                    "tail": FakeTensor(FakeStorage("0", torch.FloatStorage, 1024), 1000, (24,),
                                       (1,))})
    src = write_archive(tmp_path / "deflated.pt", data, [("0", payload)], compress={"0"})
    torch_to_safetensors(src, tmp_path / "out.safetensors")
    import numpy as np
    loaded = fastst.load_file(tmp_path / "out.safetensors")
    values = np.frombuffer(payload, np.float32)
    assert loaded["w"].tobytes() == values.reshape(32, 32).T.tobytes()
    assert loaded["tail"].tobytes() == values[1000:].tobytes()


def test_a_big_endian_checkpoint_is_written_little_endian(tmp_path):
    import numpy as np
    values = np.arange(6, dtype=">f4").reshape(2, 3)
    complex_values = np.array([1 + 2j, -3.5j], dtype=">c8")
    data = pickled({"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 6), 0, (3, 2), (1, 3)),
                    "c": FakeTensor(FakeStorage("1", torch.ComplexFloatStorage, 2), 0, (2,),
                                    (1,))})
    src = write_archive(tmp_path / "big.pt", data, [("0", values.tobytes()),
                                                    ("1", complex_values.tobytes())],
                        order="big")
    torch_to_safetensors(src, tmp_path / "out.safetensors")
    loaded = fastst.load_file(tmp_path / "out.safetensors")
    assert loaded["w"].dtype == np.dtype("<f4") and np.array_equal(loaded["w"], values.T)
    assert np.array_equal(loaded["c"], complex_values)


@pytest.mark.parametrize("func,args", [
    (os.system, ("touch {marker}",)),
    (eval, ("open({marker!r}, 'w')",)),
    (exec, ("open({marker!r}, 'w')",)),
    (write_marker, ("{marker}",)),
], ids=["os.system", "eval", "exec", "marker-writing function"])
def test_reduce_of_a_global_is_refused(tmp_path, marker, func, args):
    args = tuple(arg.format(marker=str(marker)) for arg in args)
    # protocol 2 spells builtins as Python 2 did
    name = f"{func.__module__}.{func.__qualname__}".replace("builtins.", "__builtin__.")
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "evil": Reduces(func, args)}, src)
    refused(tmp_path, src, f"refusing the global '{name}'")


def test_global_through_copyreg_is_refused(tmp_path, marker):
    # copyreg._reconstructor(os.system-like class, object, state)
    payload = (b"\x80\x02ccopyreg\n_reconstructor\ncos\nsystem\nc__builtin__\nobject\n"
               + b"X" + len(f"touch {marker}").to_bytes(4, "little")
               + f"touch {marker}".encode() + b"\x87R.")
    src = write_archive(tmp_path / "copyreg.pt", payload)
    refused(tmp_path, src, "refusing the global 'copyreg._reconstructor'")


def test_stack_global_of_a_disallowed_name_is_refused(tmp_path, marker):
    payload = pickle.dumps(Reduces(os.system, (f"touch {marker}",)), protocol=4)
    assert b"\x93" in payload     # STACK_GLOBAL
    src = write_archive(tmp_path / "stack.pt", payload)
    refused(tmp_path, src, "refusing the global 'posix.system'")


@pytest.mark.parametrize("opcode", [
    b"(cbuiltins\nobject\no.",                        # OBJ
    b"(ibuiltins\nobject\n.",                         # INST
    b"\x80\x02ccollections\nOrderedDict\n)\x81.",      # NEWOBJ
    b"\x80\x02\x82\x01.",                              # EXT1
], ids=["OBJ", "INST", "NEWOBJ", "EXT1"])
def test_object_building_opcodes_are_refused(opcode):
    with pytest.raises(fastst.SafetensorError, match="refusing|opcode"):
        loads(opcode)


def test_build_on_an_allowed_callable_is_refused():
    # BUILD on the stand-in of torch._utils._rebuild_tensor_v2
    payload = b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n}b."
    with pytest.raises(fastst.SafetensorError, match="BUILD on torch._utils._rebuild_tensor_v2"):
        loads(payload)


def test_reduce_of_a_non_global_is_refused():
    with pytest.raises(fastst.SafetensorError, match="REDUCE of"):
        loads(b"\x80\x02X\x02\x00\x00\x00ab)R.")


def test_storage_outside_the_archive_is_refused(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 2, (2, 2), (2, 1))})
    src = write_archive(tmp_path / "far.pt", data, [("0", bytes(16))])
    refused(tmp_path, src, "tensor 'w'.*reaches byte 24 of storage '0', which holds 16")


def test_storage_claiming_more_than_its_member_is_refused(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 1 << 40)
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,))})
    src = write_archive(tmp_path / "big.pt", data, [("0", bytes(16))])
    refused(tmp_path, src, "storage '0' holds 16 bytes")


def test_missing_storage_is_refused(tmp_path):
    storage = FakeStorage("7", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,))})
    src = write_archive(tmp_path / "missing.pt", data, [("0", bytes(16))])
    refused(tmp_path, src, "storage '7' is not in the file")


def test_storage_with_conflicting_dtypes_is_refused(tmp_path):
    as_float = FakeStorage("0", torch.FloatStorage, 4)
    as_long = FakeStorage("0", torch.LongStorage, 2)
    data = pickled({"a": FakeTensor(as_float, 0, (4,), (1,)),
                    "b": FakeTensor(as_long, 0, (2,), (1,))})
    src = write_archive(tmp_path / "conflict.pt", data, [("0", bytes(16))])
    refused(tmp_path, src, "storage '0' is referenced as 2 x I64 and as 4 x F32")


def test_zip_bomb_is_refused(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 1 << 22)
    data = pickled({"w": FakeTensor(storage, 0, (1 << 22,), (1,))})
    src = write_archive(tmp_path / "bomb.pt", data, [("0", bytes(16 << 20))], compress={"0"})
    info = zipfile.ZipFile(src).getinfo("archive/data/0")
    assert info.file_size > MAX_COMPRESSION_RATIO * info.compress_size
    refused(tmp_path, src, "zip bomb")


def test_member_leaving_the_archive_is_refused(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,))})
    src = write_archive(tmp_path / "slip.pt", data, [("0", bytes(16))],
                        extra=[("../x", b"owned")])
    refused(tmp_path, src, "refusing the archive member '../x'")
    assert not (tmp_path.parent / "x").exists()


@pytest.mark.parametrize("payload,match", [
    (b"\x80\x02\x8e" + (1 << 40).to_bytes(8, "little") + b".", "truncated"),   # BINBYTES8
    (b"\x80\x02r\xff\xff\xff\xff.", "malformed"),     # LONG_BINPUT with an empty stack
    (b"\x80\x02]r\xff\xff\xff\xff.", ""),              # a huge memo index: a dict, no array
    (b"(" * 100000 + b".", "malformed"),
    (b"\x80\x02", "truncated"),
    (b"\x80\x02I" + b"9" * 10000 + b"\n.", "malformed"),
    (b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b".", "truncated"),   # BYTEARRAY8
    (b"\x80\x02cbuiltins\nbytearray\n\x8a\x06\x00\x00\x00\x00\x00\x01\x85R.",
     r"bytearray\(\) of \(1099511627776,\)"),            # bytearray(2**40) by REDUCE
], ids=["binbytes8", "put-empty", "memo-index", "marks", "truncated", "long-int",
        "bytearray8", "bytearray-of-an-int"])
def test_pickle_bombs_are_bounded(payload, match):
    try:
        loads(payload)
    except fastst.SafetensorError as error:
        assert re.search(match, str(error)), str(error)
    else:
        assert match == ""


def test_a_container_referred_to_from_everywhere_is_refused_not_expanded(tmp_path):
    """A pickle's memo lets 40 small lists stand for 2**40 paths: written out as a
    tree they would never end."""
    node = [1.5]
    for _ in range(40):
        node = [node, node]
    storage = FakeStorage("0", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,)), "log": node})
    assert len(data) < 1000
    src = write_archive(tmp_path / "shared.pt", data, [("0", bytes(16))])
    refused(tmp_path, src, "would repeat over 1000000 entries")


def test_a_container_referred_to_from_a_few_places_is_repeated(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 4)
    config = {"lr": 0.1, "betas": [0.9, 0.99]}
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,)), "train": config, "eval": config})
    src = write_archive(tmp_path / "config.pt", data, [("0", bytes(range(16)))])
    torch_to_safetensors(src, tmp_path / "out.safetensors")
    state = fastst.load_state(tmp_path / "out.safetensors")
    assert state["train"] == state["eval"] == config


def test_sizes_and_strides_are_checked(tmp_path):
    storage = FakeStorage("0", torch.FloatStorage, 4)
    for size, stride, match in [((2, 2), (1,), "has stride"), ((-1,), (1,), "integer from 0"),
                                ((2,) * 65, (1,) * 65, "at most 64")]:
        data = pickled({"w": FakeTensor(storage, 0, size, stride)})
        src = write_archive(tmp_path / "bad.pt", data, [("0", bytes(16))])
        refused(tmp_path, src, match)


def test_not_a_checkpoint(tmp_path):
    src = tmp_path / "text.bin"
    src.write_bytes(b"hello")
    refused(tmp_path, src, "not a torch checkpoint")
    plain = tmp_path / "plain.pkl"
    plain.write_bytes(pickle.dumps({"a": 1}, protocol=2))
    refused(tmp_path, plain, "magic number")
