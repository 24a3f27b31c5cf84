"""The streaming writer: declare every tensor, then fill the file in any order,
in pieces or in place; atomic, bounded in memory, identical to save_file."""
import array as array_module
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import fastst
from conftest import WRITABLE_DTYPES, cpu_beside, random_array
from fastst.writer import WriteSpec
from test_hardening import check_kills_leave_a_whole_file


def declared(tensors):
    return {name: (array.dtype, array.shape) for name, array in tensors.items()}


def temp_files(directory):
    return [name for name in os.listdir(directory) if name.endswith(".fastst-tmp")]


@pytest.fixture
def tensors(rng):
    out = {f"t_{code}": random_array(rng, dtype, (7, 3)) for code, dtype in WRITABLE_DTYPES.items()}
    out["scalar"] = np.float32(2.5).reshape(())
    out["empty"] = np.zeros((0, 4), np.int16)
    return out


@pytest.mark.parametrize("spec", [("x", "F32"), ("x", "F32", (1,), None, 5), "xyz", 3])
def test_a_spec_of_the_wrong_form_is_refused(spec):
    with pytest.raises(fastst.SafetensorTypeError, match=r"a spec is \(name, dtype code"):
        fastst.writer.plan_write([spec], None)


def test_a_declared_plan_has_its_layout_but_no_data_to_write_whole():
    plan = fastst.writer.plan_write([("w", "F32", (2, 3)), ("b", "U8", (4,), None)], {"k": "v"})
    assert plan.names() == ["w", "b"]
    assert plan.info("b") == ("U8", [4], (24, 28), (4,))
    assert plan.total_size == plan.data_start + 28
    with pytest.raises(fastst.SafetensorError, match="no data to write whole"):
        plan.to_bytes()


def test_chunks_in_any_order_write_the_bytes_save_file_writes(tmp_path, tensors):
    path = tmp_path / "stream.safetensors"
    pieces = [(name, start, array[start:start + 2]) for name, array in tensors.items()
              if array.ndim for start in range(0, len(array), 2)]
    random.Random(3).shuffle(pieces)
    with fastst.StreamWriter(path, declared(tensors), {"k": "v"}) as writer:
        writer.write("scalar", tensors["scalar"])
        for name, start, piece in pieces:
            writer.write(name, piece, start_row=start)
    assert path.read_bytes() == fastst.save(tensors, {"k": "v"})
    # the reference's reader, on raw bytes (its NumPy loader lacks some 8-bit floats)
    reference = dict(safetensors.deserialize(path.read_bytes()))
    for name, array in tensors.items():
        assert bytes(reference[name]["data"]) == array.tobytes()
        assert reference[name]["shape"] == list(array.shape)
    assert temp_files(tmp_path) == []


def test_views_filled_in_place_write_the_same_bytes(tmp_path, tensors):
    path = tmp_path / "views.safetensors"
    with fastst.StreamWriter(path, declared(tensors)) as writer:
        for name in reversed(writer.names()):
            view = writer.view(name)
            view[...] = tensors[name]
            del view
    assert path.read_bytes() == fastst.save(tensors)


def test_views_and_chunks_mix_and_a_view_survives_close(tmp_path, rng):
    big = rng.standard_normal((300, 500)).astype(np.float32)
    small = np.arange(10, dtype=np.int64)
    path = tmp_path / "mixed.safetensors"
    writer = fastst.StreamWriter(path, {"big": ("F32", big.shape), "small": ("I64", (10,))},
                                 fsync=True)
    view = writer.view("big")
    view[:150] = big[:150]
    writer.write("small", small)
    view[150:] = big[150:]
    writer.close()   # the view is still held: close flushes it and leaves it valid
    assert view.sum() == big.sum()
    assert path.read_bytes() == fastst.save({"big": big, "small": small})


def test_sub_byte_dtypes_are_written_as_packed_bytes(tmp_path, rng):
    packed = {"f4": ("F4", (6, 4), 12), "f6a": ("F6_E2M3", (8, 4), 24),
              "f6b": ("F6_E3M2", (4, 1), None), "f4odd": ("F4", (2, 3), 3)}
    data = {name: rng.integers(0, 256, size=fastst.writer.plan_write(
        [(name, code, shape, None)], None).info(name).data_offsets[1], dtype=np.uint8)
        for name, (code, shape, _) in packed.items()}
    path = tmp_path / "packed.safetensors"
    with fastst.StreamWriter(path, [(name, code, shape)
                                    for name, (code, shape, _) in packed.items()]) as writer:
        writer.write_bytes("f4", data["f4"][6:], start=6)     # bytes in two pieces
        writer.write_bytes("f4", data["f4"][:6])
        rows = data["f6a"].reshape(8, 3)                      # packed rows of 4 x 6 bits
        writer.write("f6a", rows[4:], start_row=4)
        writer.view("f6a")[:4] = rows[:4]
        writer.write_bytes("f6b", data["f6b"].tobytes())      # rows of 6 bits: packed flat
        writer.write_bytes("f4odd", bytearray(data["f4odd"]))
    expected = fastst.writer.serialize([WriteSpec(name, code, shape, data[name])
                                        for name, (code, shape, _) in packed.items()])
    assert path.read_bytes() == expected
    assert {name: bytes(entry["data"]) for name, entry in safetensors.deserialize(expected)} \
        == {name: array.tobytes() for name, array in data.items()}
    with fastst.safe_open(path) as handle:
        assert handle.get_tensor("f4").tobytes() == data["f4"].tobytes()


def test_a_tensor_written_in_resumed_pieces_with_rewrites(tmp_path, rng):
    full = rng.standard_normal((100, 8)).astype(np.float64)
    path = tmp_path / "resumed.safetensors"
    with fastst.StreamWriter(path, {"x": ("F64", full.shape), "y": ("U8", (3,))}) as writer:
        writer.write("x", full[50:60], start_row=50)
        writer.write("x", np.zeros((30, 8)), start_row=40)        # overwritten below
        writer.write("y", np.arange(3, dtype=np.uint8))
        writer.write("x", full[:55])
        writer.write("x", full[55:], start_row=np.int64(55))
        assert writer.unwritten() == {}
    assert path.read_bytes() == fastst.save({"x": full, "y": np.arange(3, dtype=np.uint8)})


def test_pieces_from_buffers_torch_and_other_layouts(tmp_path):
    torch = pytest.importorskip("torch")
    import fastst.torch
    values = np.arange(24, dtype=np.float32).reshape(6, 4)
    bf16 = torch.arange(6, dtype=torch.bfloat16)
    path = tmp_path / "sources.safetensors"
    specs = [("a", torch.float32, (6, 4)), ("b", "float32", (3,)), ("c", "F64", (2, 2)),
             ("bf", torch.bfloat16, (6,)), ("u", np.uint8, (5,)),
             ("f4", torch.float4_e2m1fn_x2, (2, 3))]   # torch's shape: pairs of 4-bit floats
    with fastst.StreamWriter(path, specs) as writer:
        writer.write("a", torch.from_numpy(values[:3]))
        writer.write("a", values[3:].astype(">f4"), start_row=3)        # big-endian rows
        writer.write("b", array_module.array("f", [1, 2, 3]))           # buffer protocol
        writer.write("c", np.asfortranarray([[1.0, 2.0], [3.0, 4.0]]))  # a transposed matrix
        writer.write("bf", bf16[:4])                                 # bfloat16 rows, as ml_dtypes
        writer.write_bytes("bf", bf16[4:].view(torch.uint8).numpy(), start=8)
        writer.write("u", b"\x01\x02\x03\x04\x05")
        assert writer.info("f4").shape == [2, 6]
        writer.write_bytes("f4", bytes(range(6)))
    loaded = fastst.torch.load_file(path)
    assert torch.equal(loaded["a"], torch.from_numpy(values))
    assert loaded["b"].tolist() == [1, 2, 3]
    assert loaded["c"].tolist() == [[1, 2], [3, 4]]
    assert torch.equal(loaded["bf"], bf16)
    assert loaded["u"].tolist() == [1, 2, 3, 4, 5]


def test_torch_pieces_of_dtypes_numpy_lacks_are_written_as_they_are(tmp_path):
    torch = pytest.importorskip("torch")
    import fastst.torch
    tensors = {"bf": torch.randn(8, 4).to(torch.bfloat16),
               "f8": torch.randn(6).to(torch.float8_e4m3fn),
               "t": torch.randn(4, 3).t()}                       # not contiguous
    path = tmp_path / "torch.safetensors"
    with fastst.StreamWriter(path, {name: (t.dtype, tuple(t.shape))
                                    for name, t in tensors.items()}) as writer:
        writer.write("bf", tensors["bf"][4:], start_row=4)
        writer.write("bf", tensors["bf"][:4])
        writer.write("f8", tensors["f8"])
        writer.write("t", tensors["t"])
        with pytest.raises(fastst.SafetensorTypeError):
            writer.write("f8", torch.zeros(6, dtype=torch.float8_e5m2))   # another dtype
    assert path.read_bytes() == fastst.torch.save(tensors)


def misuse_cases():
    ok = np.zeros((2, 3), np.float32)
    return [
        (lambda w: w.write("m", ok.astype(np.float64)), fastst.SafetensorTypeError,
         "'m' is F32: its pieces must be float32 arrays, got float64"),
        (lambda w: w.write("m", np.zeros((2, 4), np.float32)), fastst.SafetensorError,
         r"a piece must have shape \(rows,\) \+ \(3,\), got \(2, 4\)"),
        (lambda w: w.write("m", np.zeros(3, np.float32)), fastst.SafetensorError,
         "a piece must have shape"),
        (lambda w: w.write("m", ok, start_row=3), fastst.SafetensorIndexError,
         r"rows \[3, 5\) lie outside its 4 rows"),
        (lambda w: w.write("m", ok, start_row=-1), fastst.SafetensorError,
         "start_row must be an integer >= 0"),
        (lambda w: w.write("m", ok, start_row=True), fastst.SafetensorError,
         "start_row must be an integer >= 0"),
        (lambda w: w.write("m", ok, start_row=1.0), fastst.SafetensorError,
         "start_row must be an integer >= 0"),
        (lambda w: w.write("s", np.zeros(1, np.float32)), fastst.SafetensorError,
         "'s' is 0-d: write it whole"),
        (lambda w: w.write("nope", ok), fastst.TensorNotFoundError,
         "no tensor named 'nope' was declared"),
        (lambda w: w.write("m", [[1.0]]), fastst.SafetensorTypeError,
         "expected an array or a buffer, got list"),
        (lambda w: w.write_bytes("m", bytes(49)), fastst.SafetensorIndexError,
         r"bytes \[0, 49\) lie outside its 48 bytes"),
        (lambda w: w.write_bytes("m", bytes(8), start=44), fastst.SafetensorIndexError,
         r"bytes \[44, 52\) lie outside"),
        (lambda w: w.write_bytes("m", np.zeros((4, 4), np.uint8)[:, ::2]), fastst.SafetensorError,
         "must be C-contiguous"),
        (lambda w: w.write_bytes("m", 12), fastst.SafetensorTypeError,
         "expected a buffer of bytes, got int"),
        (lambda w: w.write_bytes("m", bytes(4), start=-4), fastst.SafetensorError,
         "start must be an integer >= 0, got -4"),
        (lambda w: w.write_bytes("m", bytes(4), start=2**64), fastst.SafetensorIndexError,
         "lie outside its 48 bytes"),
        (lambda w: w.view("nope"), fastst.TensorNotFoundError,
         "no tensor named 'nope' was declared"),
    ]


@pytest.mark.parametrize("misuse, error, message", misuse_cases())
def test_misuse_is_refused_before_any_byte_is_written(tmp_path, misuse, error, message):
    path = tmp_path / "m.safetensors"
    writer = fastst.StreamWriter(path, {"m": ("F32", (4, 3)), "s": ("F32", ())})
    with pytest.raises(error, match=message) as caught:
        misuse(writer)
    assert str(path) in str(caught.value)
    (temp,) = temp_files(tmp_path)
    assert (tmp_path / temp).read_bytes()[writer.info("m").data_offsets[0] + len(
        fastst.writer.plan_write([("m", "F32", (4, 3), None), ("s", "F32", (), None)],
                                 None).prefix):].count(0) == 52
    assert writer.unwritten() == {"m": [(0, 48)], "s": [(0, 4)]}
    writer.abort()
    assert temp_files(tmp_path) == [] and not path.exists()


def test_a_shape_numpy_cannot_hold_is_written_as_bytes(tmp_path):
    path = tmp_path / "odd.safetensors"
    with fastst.StreamWriter(path, {"z": ("U8", (0, 2**63))}) as writer:
        assert writer.info("z").array_shape is None
        with pytest.raises(fastst.SafetensorError, match="cannot be a NumPy array; write its "
                                                         "bytes with write_bytes"):
            writer.write("z", np.zeros((0, 1), np.uint8))
        with pytest.raises(fastst.SafetensorError, match="cannot be a NumPy array"):
            writer.view("z")
        writer.write_bytes("z", b"")
    assert fastst.writer.deserialize(path.read_bytes()) == [
        ("z", {"dtype": "U8", "shape": [0, 2**63], "data": bytearray()})]


def test_closing_with_tensors_unwritten_names_them_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(3)}, path)
    inode, old = path.stat().st_ino, path.read_bytes()
    writer = fastst.StreamWriter(path, {"a": ("U8", (10, 10)), "b": ("I32", (4,))})
    writer.write("a", np.ones((2, 10), np.uint8), start_row=3)
    writer.write("a", np.ones((1, 10), np.uint8), start_row=7)
    with pytest.raises(fastst.SafetensorError,
                       match=r"not written, so not saved: tensor 'b' bytes \[0, 16\); "
                             r"tensor 'a' bytes \[0, 30\), \[50, 70\), \[80, 100\)$"):
        writer.close()
    assert path.read_bytes() == old and path.stat().st_ino == inode
    assert temp_files(tmp_path) == []
    assert writer.closed
    with pytest.raises(fastst.SafetensorError, match="the writer is closed"):
        writer.write("b", np.zeros(4, np.int32))
    writer.close()   # again: nothing


def test_the_message_for_many_gaps_stays_short(tmp_path):
    specs = [(f"t{i}", "U8", (1000,)) for i in range(5000)]
    writer = fastst.StreamWriter(tmp_path / "x.safetensors", specs)
    for start in range(0, 1000, 2):
        writer.write("t0", np.zeros(1, np.uint8), start_row=start)
    with pytest.raises(fastst.SafetensorError) as caught:
        writer.close()
    message = str(caught.value)
    assert "and 496 more" in message and "and 4996 more tensors" in message
    assert len(message) < 1000


def test_an_exception_in_the_with_block_removes_the_file_and_propagates(tmp_path):
    path = tmp_path / "model.safetensors"
    fastst.save_file({"old": np.ones(3)}, path)
    old = path.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with fastst.StreamWriter(path, {"a": ("U8", (4,))}) as writer:
            writer.write("a", np.ones(4, np.uint8))
            view = writer.view("a")
            raise KeyboardInterrupt
    assert path.read_bytes() == old and temp_files(tmp_path) == []
    assert view.shape == (4,)   # a view held past an abort stays valid memory


def test_a_dropped_writer_removes_its_file(tmp_path):
    writer = fastst.StreamWriter(tmp_path / "x.safetensors", {"a": ("U8", (4,))})
    assert len(temp_files(tmp_path)) == 1
    del writer
    assert temp_files(tmp_path) == []


@pytest.mark.parametrize("specs, error, message", [
    ({"a": ("F33", (2,))}, fastst.SafetensorTypeError, "unknown dtype code 'F33'"),
    ({"a": ("float33", (2,))}, fastst.SafetensorTypeError, "has no safetensors code"),
    ({"a": ("F32", (-2,))}, fastst.SafetensorError, "shape must hold unsigned integers"),
    ({"a": ("F32", 3)}, fastst.SafetensorTypeError, "shape must be a sequence"),
    ({"a": "F32"}, fastst.SafetensorTypeError, r"declare it as \(dtype, shape\)"),
    ([("a", "F32")], fastst.SafetensorTypeError, r"as \(name, dtype, shape\)"),
    ([("a", "F32", (1,)), ("a", "F32", (1,))], fastst.SafetensorError, "given twice"),
    ({"__metadata__": ("F32", (1,))}, fastst.SafetensorError, "reserved"),
])
def test_invalid_declarations_are_refused_and_create_nothing(tmp_path, specs, error, message):
    with pytest.raises(error, match=message) as caught:
        fastst.StreamWriter(tmp_path / "x.safetensors", specs)
    assert str(caught.value).startswith(str(tmp_path / "x.safetensors") + ": ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("padding", [-1, 1.5, True, 10**9])
def test_invalid_header_padding_is_refused(tmp_path, padding):
    with pytest.raises(fastst.SafetensorError, match="header_padding must be an integer"):
        fastst.StreamWriter(tmp_path / "x.safetensors", {}, header_padding=padding)
    assert list(tmp_path.iterdir()) == []


def test_threads_fill_one_file_together(tmp_path, rng):
    import threading
    full = rng.standard_normal((64, 1000)).astype(np.float32)
    path = tmp_path / "threads.safetensors"
    with fastst.StreamWriter(path, {"x": ("F32", full.shape)}) as writer:
        def fill(first):
            for row in range(first, 64, 4):
                writer.write("x", full[row:row + 1], start_row=row)

        threads = [threading.Thread(target=fill, args=(first,)) for first in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert path.read_bytes() == fastst.save({"x": full})


def test_header_padding_leaves_aligned_room_that_both_readers_accept(tmp_path):
    path = tmp_path / "padded.safetensors"
    with fastst.StreamWriter(path, {"a": ("F32", (2,))}, header_padding=1000) as writer:
        writer.write("a", np.ones(2, np.float32))
    with fastst.safe_open(path) as handle:
        assert handle.data_start % 8 == 0
        assert handle.data_start - len(fastst.save({"a": np.ones(2, np.float32)})) + 8 >= 1000
    assert safetensors.numpy.load_file(path)["a"].tolist() == [1, 1]


def test_save_file_from_pairs_in_any_order(tmp_path, tensors):
    path = tmp_path / "pairs.safetensors"
    order = list(tensors)
    random.Random(5).shuffle(order)
    fastst.save_file_from(declared(tensors), ((name, tensors[name]) for name in order), path,
                          {"k": "v"})
    assert path.read_bytes() == fastst.save(tensors, {"k": "v"})
    with pytest.raises(fastst.SafetensorError, match="'t_U8' is produced twice"):
        fastst.save_file_from(declared(tensors), [("t_U8", tensors["t_U8"])] * 2, path)
    with pytest.raises(fastst.SafetensorError, match="not written, so not saved: tensor"):
        fastst.save_file_from(declared(tensors), [("t_U8", tensors["t_U8"])], path)
    assert path.read_bytes() == fastst.save(tensors, {"k": "v"})


def test_save_file_from_an_open_file_reads_one_tensor_at_a_time(tmp_path, tensors):
    source, copy = tmp_path / "source.safetensors", tmp_path / "copy.safetensors"
    fastst.save_file(tensors, source, {"k": "v"})

    class CountingReads:
        """A lazy mapping over an open file that records each read."""

        def __init__(self, handle):
            self.handle, self.reads = handle, []

        def keys(self):
            return self.handle.keys()

        def __getitem__(self, name):
            self.reads.append(name)
            return self.handle.get_tensor(name)

    with fastst.safe_open(source, backend="pread") as handle:
        lazy = CountingReads(handle)
        fastst.save_file_from(fastst.writer.specs_of(handle), lazy, copy, handle.metadata())
        assert lazy.reads == handle.offset_keys()
    assert copy.read_bytes() == source.read_bytes()
    with fastst.safe_open(source) as handle:   # an open file is itself a lazy mapping
        fastst.save_file_from(fastst.writer.specs_of(handle), handle, copy, {"k": "v"})
    assert copy.read_bytes() == source.read_bytes()


MEMORY_PROBE = """
import resource, sys, ml_dtypes, numpy as np, fastst, fastst._json   # all a write loads, loaded
path, mode, chunk_mib, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rows = (chunk_mib << 20) // 4096
base = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) << 10
resource.setrlimit(resource.RLIMIT_AS, (base + 6 * (chunk_mib << 20), resource.RLIM_INFINITY))
specs = {"w": ("F32", (rows * chunks, 1024))}
try:
    if mode == "stream":
        with fastst.StreamWriter(path, specs) as writer:
            chunk = np.empty((rows, 1024), np.float32)
            for i in range(chunks):
                chunk.fill(i)
                writer.write("w", chunk, start_row=i * rows)
    else:
        fastst.save_file({"w": np.ones((rows * chunks, 1024), np.float32)}, path)
    print("done")
except MemoryError:
    print("out of memory")
"""


def test_streaming_finishes_in_an_address_space_smaller_than_the_file(tmp_path):
    path, chunk_mib, chunks = tmp_path / "big.safetensors", 4, 64   # 256 MiB in 4 MiB chunks
    runs = {mode: subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(path), mode, str(chunk_mib), str(chunks)],
        capture_output=True, text=True, timeout=120) for mode in ("dict", "stream")}
    assert runs["dict"].stdout.strip() == "out of memory", runs["dict"].stderr
    assert runs["stream"].stdout.strip() == "done", runs["stream"].stderr
    header = b'{"w":{"dtype":"F32","shape":[65536,1024],"data_offsets":[0,268435456]}}'
    assert path.stat().st_size == 8 + (len(header) + 7) // 8 * 8 + (256 << 20)
    with fastst.safe_open(path) as handle:
        rows = handle.get_slice("w")
        assert rows[0, 0] == 0 and rows[-1, -1] == chunks - 1


STREAMER = """
import sys, numpy as np, fastst
path = sys.argv[1]
print("ready", flush=True)
i = 0
while True:
    version = i % 2 + 1
    with fastst.StreamWriter(path, {"w": ("F32", (8 << 20,)), "v": ("I64", (1,))}) as writer:
        writer.write("v", np.array([version]))
        for start in range(0, 8 << 20, 1 << 20):
            writer.write("w", np.full(1 << 20, version, np.float32), start_row=start)
    i += 1
"""


def test_a_stream_killed_at_random_moments_never_corrupts_the_old_file(tmp_path):
    check_kills_leave_a_whole_file(tmp_path, STREAMER, rounds=12, seed=11)


def test_chunk_writes_release_the_gil(tmp_path):
    """Another thread keeps running while a large piece is written."""
    chunk = np.ones(256 << 20, np.uint8)
    with fastst.StreamWriter(tmp_path / "x.safetensors", {"a": ("U8", chunk.shape)}) as writer:
        work_cpu, other_cpu = cpu_beside(lambda: writer.write("a", chunk))
    assert other_cpu > work_cpu / 2, (other_cpu, work_cpu)
