"""Hostile checkpoints: each is refused with a SafetensorError naming the file and
what was refused, and none runs any code (the marker file never appears)."""
from __future__ import annotations

import collections
import io
import os
import pickle
import re
import struct
import sys
import zipfile

import numpy as np
import pytest

import fastst
from helpers import run_bounded
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
    tree they would never end. The entries a tree may repeat follow the size of
    its pickle, so that its walk does too."""
    node = [1.5]
    for _ in range(40):
        node = [node, node]
    storage = FakeStorage("0", torch.FloatStorage, 4)
    data = pickled({"w": FakeTensor(storage, 0, (4,), (1,)), "log": node})
    assert len(data) < 1000
    src = write_archive(tmp_path / "shared.pt", data, [("0", bytes(16))])
    # 100,000 entries, and 16 more per byte of the pickle (1,000,000 at most)
    from fastst.convert._torch import max_repeated_entries
    assert max_repeated_entries(len(data)) == 100_000 + 16 * len(data)
    refused(tmp_path, src, f"would repeat over {100_000 + 16 * len(data)} entries")


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


# ---------------------------------------------------------------------------
# Denial of service: a few hundred bytes (or a few MB) that cost hours, or gigabytes
# of memory or of disk. Each runs in a child process with its address space, the
# size of its files and its time bounded (see helpers.run_bounded).
# ---------------------------------------------------------------------------

def convert_bounded(src, dst, **options) -> str:
    """The outcome of converting `src` in a bounded child: "converted", or
    "refused: <message>"."""
    return run_bounded(f"""
        from fastst.convert import convert
        try:
            convert({str(src)!r}, {str(dst)!r}, **{options!r})
            print("converted")
        except fastst.SafetensorError as error:
            print("refused:", error)
    """)


def loads_bounded(payload: bytes) -> str:
    """The outcome of unpickling `payload` in a bounded child."""
    return run_bounded(f"""
        from fastst.convert._torch_pickle import loads
        try:
            loads({payload!r})
            print("loaded")
        except fastst.SafetensorError as error:
            print("refused:", error)
    """)


def dag(levels: int) -> bytes:
    """The pickle of a tuple of two tuples of two ... of 1, `levels` deep, each
    level shared by the memo (DUP): 2 bytes a level, 2**levels leaves."""
    return b"K\x01" + b"2\x86" * levels


def test_a_tuple_dag_as_a_dict_key_is_refused_before_it_is_hashed(tmp_path):
    """489 bytes that never finished: hashing the key walks 2**64 tuples."""
    src = write_archive(tmp_path / "hash_bomb.pt", b"\x80\x02}" + dag(64) + b"K\x00s.")
    outcome = convert_bounded(src, tmp_path / "out.safetensors")
    assert outcome.startswith(f"refused: {src}: a dict key or set item of type tuple"), outcome
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("payload,message", [
    (b"\x80\x02c__builtin__\nset\n" + dag(64) + b"\x85R.", "set item of type tuple"),
    (b"\x80\x04(" + dag(64) + b"\x91.", "set item of type tuple"),                 # FROZENSET
    (b"\x80\x02(" + dag(64) + b"Nd.", "dict key or set item of type tuple"),       # DICT
    (b"\x80\x02ccollections\nOrderedDict\n(" + dag(64) + b"N\x86l\x85R.",
     "dict key or set item of type tuple"),
    (b"\x80\x02ctorch\ndevice\nX\x03\x00\x00\x00cpu" + dag(64) + b"\x86R.",
     r"torch.device\('cpu', \(\(\(\("),                                   # str() of the DAG
    (b"\x80\x02ctorch\nSize\n" + dag(64) + b"\x85R.",
     r"torch.Size must be an integer .*, got \(\(\(\(.*\.\.\.$"),       # repr() in a message
], ids=["set", "frozenset", "dict", "OrderedDict", "device", "message"])
def test_a_tuple_dag_is_neither_hashed_nor_printed(payload, message):
    outcome = loads_bounded(payload)
    assert re.search(message, outcome.strip()), outcome


def collisions(count: int):
    """`count` ints past 2**61 with the same hash (an int hashes modulo 2**61 - 1)."""
    modulus = sys.hash_info.modulus
    return [modulus * k + 7 for k in range(1, count + 1)]


@pytest.mark.parametrize("kind", ["dict keys", "memo indices"])
def test_keys_that_share_a_hash_are_refused(kind):
    """100,000 such keys made each insertion probe all the others: 1.4 MB that took
    minutes."""
    if kind == "dict keys":
        payload = b"\x80\x02}(" + b"".join(b"\x8a\x0b" + k.to_bytes(11, "little") + b"N"
                                           for k in collisions(100_000)) + b"u."
        message = "an int dict key or set item of 62 bits"
    else:        # PUT with a text index (protocol 0)
        payload = b"(l" + b"".join(b"p%d\n" % k for k in collisions(50_000)) + b"."
        message = "memo index b'2305843009213693958'"
    outcome = loads_bounded(payload)
    assert outcome.startswith("refused: <pickle>: " + message), outcome


@pytest.mark.parametrize("kind", ["OrderedDict", "bytearray"])
def test_a_value_handed_to_calls_over_and_over_is_refused(kind):
    """The memo lets 5 bytes hand the same large value to an allowed call again:
    10,000 OrderedDicts of 100,000 pairs, each dropped once made (hours), or 4,000
    copies of 1 MB, kept on the stack (4 GB)."""
    if kind == "OrderedDict":
        value = b"(" + b"".join(b"X\x06\x00\x00\x00%06dN\x86" % k for k in range(100_000)) + b"l"
        call, repeat = b"ccollections\nOrderedDict\n", b"h\x00h\x01R0" * 10_000
    else:
        value = b"B" + struct.pack("<I", 1 << 20) + bytes(1 << 20)
        call, repeat = b"c__builtin__\nbytearray\n", b"h\x00h\x01R" * 4000
    payload = b"\x80\x02" + call + b"q\x00" + value + b"\x85q\x01" + repeat + b"N."
    outcome = loads_bounded(payload)
    assert re.match(r"refused: <pickle>: the pickle asks for more than \d+ units of work",
                    outcome), outcome


def test_tied_weights_are_found_without_hashing_layouts_a_pickle_chose(monkeypatch):
    """Offsets and strides can be chosen so that every tensor's layout tuple has
    one hash: finding tied weights in a dict of layouts then compared each with
    all the others (quadratic). Counted here: the layouts' comparisons."""
    from fastst.convert._torch import tied_names
    from fastst.convert._torch_pickle import StorageRef, TensorRef

    compared = []

    class Layout(tuple):
        __hash__ = tuple.__hash__

        def __eq__(self, other):
            compared.append(1)
            return tuple.__eq__(self, other)

    storage = StorageRef("0", "F32", 10_000)
    refs = colliding_refs(storage, 500)
    assert len({hash(ref.layout()) for ref in refs}) == 1 and len(refs) == 500
    monkeypatch.setattr(TensorRef, "layout", lambda self: Layout(
        (self.storage.key, self.code, self.offset, self.shape, self.stride)))
    assert tied_names([(f"t{k}", ref) for k, ref in enumerate(refs)]) == {}
    assert len(compared) < len(refs)


MASK = (1 << 64) - 1
PRIME_1, PRIME_2, PRIME_5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def colliding_refs(storage, count):
    """1-element tensors of `storage` at offsets 0, 1, 2... whose strides are
    chosen so that their layouts (key, dtype, offset, shape, stride) share one
    hash, by inverting CPython's tuple hash (xxHash's round, 64-bit)."""
    from fastst.convert._torch_pickle import TensorRef

    def step(acc, lane):
        acc = (acc + lane * PRIME_2) & MASK
        return (((acc << 31) | (acc >> 33)) & MASK) * PRIME_1 & MASK

    def unstep(acc):        # the value before the rotation and the multiplication
        acc = acc * pow(PRIME_1, -1, 1 << 64) & MASK
        return ((acc >> 31) | (acc << 33)) & MASK

    def unsigned(value):
        return value & MASK

    head = step(step(PRIME_5, unsigned(hash(storage.key))), unsigned(hash("F32")))
    shape_hash = unsigned(hash((1,)))
    target = unstep(step(step(step(head, 0), shape_hash), unsigned(hash((1,)))))
    refs = []
    for offset in range(storage.numel):
        before = step(step(head, offset), shape_hash)
        stride_hash = (target - before) * pow(PRIME_2, -1, 1 << 64) & MASK
        accumulated = (stride_hash - (1 ^ (PRIME_5 ^ 3527539))) & MASK
        stride = (unstep(accumulated) - PRIME_5) * pow(PRIME_2, -1, 1 << 64) & MASK
        if stride < sys.hash_info.modulus and unsigned(hash((stride,))) == stride_hash:
            refs.append(TensorRef(storage, "F32", offset, (1,), (stride,)))
            if len(refs) == count:
                break
    return refs


def test_an_expanded_tensor_is_refused_before_anything_is_reserved(tmp_path):
    """1,570 bytes for a 40 GB tensor: the conversion reserved 40 GB of disk."""
    src = tmp_path / "expanded.pt"
    torch.save({"w": torch.zeros(1).expand(100_000, 100_000)}, src)
    outcome = convert_bounded(src, tmp_path / "out.safetensors")
    assert outcome.startswith(f"refused: {src}: converting it would write 40000000"), outcome
    assert "'w' (shape [100000, 100000], stride [0, 0]" in outcome
    assert "max_expansion=None" in outcome
    assert os.listdir(tmp_path) == ["expanded.pt"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_an_expanded_tensor_converts_when_allowed_in_bounded_memory(tmp_path):
    """With max_expansion=None the 100 MB view is written a block of rows at a
    time: it was made whole in memory first (and copied again)."""
    src = tmp_path / "expanded.pt"
    torch.save({"w": torch.arange(5000.0).expand(5000, 5000)}, src)
    dst = tmp_path / "out.safetensors"
    assert convert_bounded(src, dst).startswith("refused:")
    outcome = run_bounded(f"""
        from fastst.convert import torch_to_safetensors
        torch_to_safetensors({str(src)!r}, {str(dst)!r}, max_expansion=None)
        with open("/proc/self/status") as status:
            print([line for line in status if line.startswith("VmHWM:")][0].split()[1])
    """, file_size=1 << 30)
    assert int(outcome) >> 10 < 150, f"peak RSS {int(outcome) >> 10} MiB"
    with fastst.safe_open(dst) as reader:
        assert reader.info("w").shape == [5000, 5000]
        assert reader.get_slice("w")[4999].tolist() == list(range(5000))


def lying_zip(path, claimed: int, data: bytes, numel: int):
    """A checkpoint whose storage member (deflated) holds `data`, and whose central
    directory says it holds `claimed` bytes, `claimed` // 50 compressed (within
    the ratio a checkpoint may have); its tensor reads `numel` floats."""
    tree = {"w": FakeTensor(FakeStorage("0", torch.FloatStorage, numel), 0, (numel,), (1,))}
    write_archive(path, pickled(tree), [("0", data)], compress={"0"})
    archive = bytearray(path.read_bytes())
    entry = archive.rindex(b"PK\x01\x02")       # the storage's entry, written last
    struct.pack_into("<II", archive, entry + 20, claimed // 50, claimed)
    path.write_bytes(bytes(archive))
    return path


def test_a_central_directory_that_lies_about_sizes_is_refused_before_planning(tmp_path):
    """A few hundred bytes whose directory claims 3.6 GB for a 4 KB member: 3.6 GB
    were reserved before the read failed."""
    src = lying_zip(tmp_path / "lying.pt", 3_600_000_000, bytes(4096), 900_000_000)
    assert src.stat().st_size < 1000
    outcome = convert_bounded(src, tmp_path / "out.safetensors")
    assert re.match(rf"refused: {re.escape(str(src))}: member 'archive/data/0' declares "
                    rf"72000000 stored bytes from byte \d+, past the end of the \d+-byte "
                    rf"archive", outcome), outcome
    assert os.listdir(tmp_path) == ["lying.pt"]


def test_a_member_that_ends_early_is_named_with_its_file(tmp_path):
    """A deflated member of 4 KiB whose entry says 8 KiB (sizes that fit the file):
    the read ends early, and the message names the checkpoint and the member."""
    data = np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes()
    tree = {"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 2048), 0, (2048,), (1,))}
    src = write_archive(tmp_path / "short.pt", pickled(tree), [("0", data)], compress={"0"})
    archive = bytearray(src.read_bytes())
    entry = archive.rindex(b"PK\x01\x02")       # the storage's entry, written last
    struct.pack_into("<I", archive, entry + 24, 8192)       # its uncompressed size
    src.write_bytes(bytes(archive))
    refused(tmp_path, src, "member 'archive/data/0' ends at byte 4096, before the 8192")


def test_a_corrupt_compressed_member_is_refused_naming_it(tmp_path):
    data = np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes()
    tree = {"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 1024), 0, (1024,), (1,))}
    src = write_archive(tmp_path / "corrupt.pt", pickled(tree), [("0", data)], compress={"0"})
    archive = bytearray(src.read_bytes())
    start = archive.index(b"archive/data/0") + len("archive/data/0")
    archive[start + 100:start + 200] = bytes(100)       # into the deflate stream
    src.write_bytes(bytes(archive))
    refused(tmp_path, src, r"member 'archive/data/0' cannot be read \((error|BadZipFile)")


def test_a_storage_cut_short_while_it_is_read_is_named_with_its_file(tmp_path):
    from fastst.convert._torch_files import ByteRange

    path = tmp_path / "cut.pt"
    path.write_bytes(bytes(100))
    with open(path, "rb") as fh:
        byte_range = ByteRange(fh.fileno(), 50, 100, str(path), "storage '3'")
        with pytest.raises(fastst.SafetensorError, match=rf"^{re.escape(str(path))}: the file "
                           rf"ends at byte 100, inside storage '3'"):
            byte_range.read_into(0, memoryview(bytearray(100)))


def test_names_and_values_repeated_past_the_output_bound_are_refused(tmp_path):
    """A 100 kB str referred to 2,000 times by the memo (4 bytes each) is 200 MB of
    metadata once written out: it was built, then written."""
    text = "x" * 100_000
    data = pickled({"w": FakeTensor(FakeStorage("0", torch.FloatStorage, 4), 0, (4,), (1,)),
                    "log": [text] * 2000})
    assert len(data) < 110_000
    src = write_archive(tmp_path / "log.pt", data, [("0", bytes(16))])
    outcome = convert_bounded(src, tmp_path / "out.safetensors")
    assert re.match(rf"refused: {re.escape(str(src))}: the checkpoint's names and values "
                    rf"other than tensors, written out as a tree, would take over \d+ bytes",
                    outcome), outcome
    assert not (tmp_path / "out.safetensors").exists()
