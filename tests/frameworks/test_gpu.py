"""Loading onto a CUDA device (fastst._frameworks.cuda, behind fastst.torch.load_file).

The plan (chunks, ring, tensor layout) and the threaded reading run here on the
CPU, through a ring that copies into host memory; the tests marked `cuda` run the
real pinned ring and need a CUDA device.
"""
from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastst  # noqa: E402
import fastst.torch as ft  # noqa: E402
from fastst._frameworks import cuda as _cuda  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MiB = 1 << 20


def write_raw(path, entries, data: bytes, metadata=None) -> None:
    """A file from a hand-made header (entries: name -> (dtype, shape, begin, end))."""
    header = {name: {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
              for name, (dtype, shape, begin, end) in entries.items()}
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text + data)


def bits(tensor):
    """The tensor's bytes (NaN-safe comparison); float4 and float8 included."""
    tensor = tensor.detach().cpu().contiguous().reshape(-1)
    return tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def load_through(target, backend, make_dest, make_ring):
    """``_cuda.load_through`` of the file (or checkpoint) `target` opened with `backend`."""
    with fastst.safe_open(target, backend=backend) as opened:
        return _cuda.load_through(opened, make_dest, make_ring)


def load_into_through(targets, path, backend, make_dest, make_ring, **options):
    """``_cuda.load_into_through`` of the file (or checkpoint) `path` opened with `backend`."""
    with fastst.safe_open(path, backend=backend) as opened:
        return _cuda.load_into_through(targets, opened, make_dest, make_ring, **options)


def load_all(path, device, **options):
    """``_cuda.load_all`` of the file (or checkpoint) at `path`."""
    with fastst.safe_open(path) as opened:
        return _cuda.load_all(opened, device, **options)


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert tuple(got[name].shape) == tuple(tensor.shape), name
        assert bits(got[name]) == bits(tensor), name


@pytest.fixture
def every_dtype(tmp_path):
    """A file with a tensor of each dtype torch has, plus packed sub-byte ones."""
    path = tmp_path / "dtypes.safetensors"
    rng = np.random.default_rng(0)
    tensors = {}
    for row in fastst.DTYPES:
        dtype = getattr(torch, row.torch or "", None)
        if dtype is None or row.code == "F4":
            continue
        raw = torch.from_numpy(rng.integers(0, 256, size=6 * 5 * dtype.itemsize, dtype=np.uint8))
        if dtype == torch.bool:
            raw &= 1
        tensors[f"t_{row.code}"] = raw.view(dtype).reshape(6, 5)
    tensors["float4"] = torch.from_numpy(rng.integers(0, 256, size=12, dtype=np.uint8)).view(
        torch.float4_e2m1fn_x2).reshape(3, 4)
    tensors["empty"] = torch.zeros(0, 3)
    tensors["scalar"] = torch.tensor(7.5, dtype=torch.float64)
    ft.save_file(tensors, path)
    return path


@pytest.fixture
def misaligned(tmp_path):
    """Tensors at offsets that are not multiples of their element size."""
    path = tmp_path / "odd.safetensors"
    values = np.arange(5, dtype=np.float32).tobytes()
    halves = np.array([1.5, -2.0, 3.25], dtype=np.float16).tobytes()
    data = b"\x01\x02\x03" + values + b"\x09" + halves + b"\x07" * 5
    entries = {"bytes": ("U8", [3], 0, 3), "f32": ("F32", [5], 3, 23),
               "byte": ("U8", [1], 23, 24), "f16": ("F16", [3], 24, 30),
               "tail": ("U8", [5], 30, 35)}
    write_raw(path, entries, data)
    return path


# ---------------------------------------------------------------------------
# The plan: pure functions
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("total, chunk", [(0, 4), (1, 4), (4, 4), (5, 4), (17, 4), (10, 100)])
def test_chunks_cover_the_tensor_buffer_once_in_order(total, chunk):
    chunks = _cuda.plan_chunks(total, chunk)
    assert [start for start, _ in chunks] == list(range(0, total, chunk))
    assert all(0 < stop - start <= chunk for start, stop in chunks)
    assert all(stop == start for (_, stop), (start, _) in zip(chunks, chunks[1:]))
    assert (chunks[-1][1] if chunks else 0) == total


def test_ring_is_never_larger_than_the_file_needs():
    assert _cuda.ring_shape(100 * MiB, 16 * MiB, 8) == (16 * MiB, 7)
    assert _cuda.ring_shape(1000 * MiB, 16 * MiB, 8) == (16 * MiB, 8)
    assert _cuda.ring_shape(1000, 16 * MiB, 8) == (1000, 1)
    for bad in ((0, 4), (4, 0), (-1, 4)):
        with pytest.raises(ValueError, match="positive"):
            _cuda.ring_shape(10, *bad)


def test_specs_view_only_where_the_offset_suits_the_element_size(misaligned):
    with fastst.safe_open(misaligned) as f:
        specs = {name: _cuda.tensor_place(name, f.info(name), f.source) for name in f.keys()}
    assert {name: spec.is_view for name, spec in specs.items()} == {
        "bytes": True, "f32": False, "byte": True, "f16": True, "tail": True}
    assert specs["f32"].dtype == torch.float32 and specs["f32"].shape == (5,)


def test_specs_of_packed_and_missing_dtypes(tmp_path):
    path = tmp_path / "packed.safetensors"
    write_raw(path, {"odd": ("F4", [2, 3], 0, 3), "six": ("F6_E2M3", [2, 4], 3, 9)}, bytes(9))
    with fastst.safe_open(path) as f:
        with pytest.raises(fastst.SafetensorError, match=r"packed\.safetensors.*'odd'.*even"):
            _cuda.tensor_place("odd", f.info("odd"), f.source)
        six = _cuda.tensor_place("six", f.info("six"), f.source)
    assert (six.dtype, six.shape) == (torch.uint8, (2, 3))   # packed bytes, as NumPy has them


# ---------------------------------------------------------------------------
# The threaded reading, through a ring that copies into host memory
# ---------------------------------------------------------------------------

class HostRing:
    """A ring whose 'device' is a CPU uint8 tensor; it checks that no buffer is
    refilled before it was handed on, and records what each thread did."""

    def __init__(self, dest, buffer_bytes, count, fail_at=None):
        self.failed = threading.Event()
        self.dest = dest
        self.buffers = [memoryview(np.empty(buffer_bytes, np.uint8)) for _ in range(count)]
        self.pending = [False] * count
        self.sent = []
        self.threads = set()
        self.finished = self.released = False
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def start_thread(self):
        self.threads.add(threading.current_thread().name)

    def wait(self, k):
        if self.fail_at is not None and k:
            self.failed.wait(timeout=10)   # the other threads start after the failure
        self.pending[k] = False

    def send(self, k, nbytes, start):
        assert not self.pending[k], "buffer handed on twice without a wait"
        if start == self.fail_at:
            self.failed.set()
            raise OSError(5, "device lost")
        data = torch.from_numpy(np.frombuffer(self.buffers[k][:nbytes], np.uint8).copy())
        if isinstance(self.dest, _cuda.Scatter):
            self.dest.copy_in(start, data)
        else:
            self.dest[start:start + nbytes] = data
        self.pending[k] = True
        with self.lock:
            self.sent.append((start, nbytes))

    def finish(self):
        self.finished = True

    def release(self):
        self.released = True


def host_load(path, chunk_bytes, buffers, truncate_to=None, fail_at=None):
    rings = []

    def make_dest(total, source):
        if truncate_to is not None:
            os.truncate(path, truncate_to)   # the file shrinks under the reader
        return torch.full((total,), 0xAB, dtype=torch.uint8)   # poisoned

    def make_ring(dest, total):
        rings.append(HostRing(dest, *_cuda.ring_shape(total, chunk_bytes, buffers),
                              fail_at=fail_at))
        return rings[0]

    try:
        return load_through(path, "mmap", make_dest, make_ring), rings
    except BaseException as error:
        error.rings = rings
        raise


@pytest.mark.parametrize("chunk_bytes, buffers", [(1, 1), (7, 3), (64, 8), (4096, 2), (MiB, 8)])
def test_threads_read_every_byte_into_place(every_dtype, misaligned, chunk_bytes, buffers):
    for path in (every_dtype, misaligned):
        got, (ring,) = host_load(path, chunk_bytes, buffers)
        assert_same(got, ft.load_file(path))
        assert sorted(ring.sent) == [(start, stop - start) for start, stop in
                                     _cuda.plan_chunks(ring.dest.numel(), len(ring.buffers[0]))]
        assert ring.finished and ring.released
        assert len(ring.threads) == len(ring.buffers)


def test_the_ring_tells_the_kernel_it_reads_in_order(every_dtype, restore_read_options):
    from fastst._core import read_counters

    before = read_counters()["hinted_plans"]
    host_load(every_dtype, 64, 2)
    assert read_counters()["hinted_plans"] == before + 1
    fastst.read_options(hints=False)
    host_load(every_dtype, 64, 2)
    assert read_counters()["hinted_plans"] == before + 1


def test_tensors_view_one_buffer_except_misaligned_ones(misaligned):
    got, (ring,) = host_load(misaligned, 8, 2)
    storage = ring.dest.untyped_storage().data_ptr()
    shares = {name: t.untyped_storage().data_ptr() == storage for name, t in got.items()}
    assert shares == {"bytes": True, "f32": False, "byte": True, "f16": True, "tail": True}
    assert got["f32"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert got["f16"].tolist() == [1.5, -2.0, 3.25]


def test_file_without_tensors_or_bytes(tmp_path):
    path = tmp_path / "empty.safetensors"
    write_raw(path, {"nothing": ("F32", [0, 4], 0, 0)}, b"", metadata={"k": "v"})
    got, rings = host_load(path, 16, 4)
    assert rings == [] and got["nothing"].shape == (0, 4)
    write_raw(path, {}, b"")
    assert host_load(path, 16, 4)[0] == {}


@pytest.mark.parametrize("cut", [0, 1, 200, 399])
def test_file_truncated_under_the_reader_names_file_and_tensor(tmp_path, cut):
    path = tmp_path / "cut.safetensors"
    ft.save_file({"a": torch.zeros(50), "b": torch.ones(50)}, path)   # 200 bytes each
    with fastst.safe_open(path) as f:
        data_start = f.data_start
        name = "a" if cut < 200 else "b"
    with pytest.raises(fastst.SafetensorError,
                       match=rf"cut\.safetensors: tensor '{name}' .* ends at byte "
                             rf"{data_start + cut}, truncated") as caught:
        host_load(path, 64, 3, truncate_to=data_start + cut)
    (ring,) = caught.value.rings
    assert ring.finished and ring.released


def test_a_failing_copy_stops_every_thread_and_frees_the_ring(tmp_path):
    path = tmp_path / "big.safetensors"
    ft.save_file({"x": torch.arange(4096, dtype=torch.int32)}, path)
    before = threading.active_count()
    with pytest.raises(OSError, match="device lost") as caught:
        host_load(path, 256, 4, fail_at=0)          # the first chunk of 64
    (ring,) = caught.value.rings
    assert ring.finished and ring.released
    assert len(ring.sent) <= 2 * 3     # each other thread stops within two chunks
    assert threading.active_count() == before


def test_short_reads_are_resumed(tmp_path, monkeypatch):
    path = tmp_path / "short.safetensors"
    want = {"x": torch.arange(1000, dtype=torch.int64)}
    ft.save_file(want, path)
    real = os.preadv

    def at_most_ten_bytes(fd, buffers, offset):
        return real(fd, [buffers[0][:10]], offset)

    monkeypatch.setattr(_cuda.os, "preadv", at_most_ten_bytes)
    got, _ = host_load(path, 512, 3)
    assert_same(got, want)


def test_cpu_loads_never_import_the_cuda_module(every_dtype):
    code = ("import sys, fastst.torch as ft; ft.load_file(sys.argv[1]); "
            "ft.load_file(sys.argv[1], device='meta'); "
            "assert 'fastst._frameworks.cuda' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code, str(every_dtype)], check=True)


# ---------------------------------------------------------------------------
# On a CUDA device
# ---------------------------------------------------------------------------

@pytest.fixture
def ring_buffers(monkeypatch):
    """Weak references to the pinned memory of every ring a load makes."""
    refs = []

    class Recording(_cuda.PinnedRing):
        def __init__(self, *args):
            super().__init__(*args)
            refs.append(weakref.ref(self.pinned))

    monkeypatch.setattr(_cuda, "PinnedRing", Recording)
    return refs


@needs_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0)], ids=str)
def test_every_dtype_on_the_device(every_dtype, device):
    got = ft.load_file(every_dtype, device=device)
    assert all(tensor.device.type == "cuda" for tensor in got.values())
    assert_same(got, ft.load_file(every_dtype))


@needs_cuda
@pytest.mark.parametrize("chunk_bytes, buffers", [(1, 1), (7, 3), (4096, 8), (16 * MiB, 8)])
def test_odd_alignments_and_chunk_sizes_on_the_device(every_dtype, misaligned, chunk_bytes,
                                                      buffers):
    for path in (every_dtype, misaligned):
        got = load_all(path, torch.device("cuda"), chunk_bytes=chunk_bytes,
                              buffers=buffers)
        assert_same(got, ft.load_file(path))
    assert got["f32"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


@needs_cuda
def test_tensors_share_one_device_allocation_and_no_ring(every_dtype, ring_buffers):
    got = ft.load_file(every_dtype, device="cuda")
    storages = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    assert len(storages) == 1
    assert len(ring_buffers) == 1 and ring_buffers[0]() is None


@needs_cuda
def test_four_gib_round_trip(tmp_path):
    path = tmp_path / "big.safetensors"
    gen = torch.Generator(device="cuda").manual_seed(1)
    written = {f"layer{i:02d}": torch.randn(4096, 8192, generator=gen, device="cuda",
                                            dtype=torch.bfloat16) for i in range(64)}
    ft.save_file(written, path)
    assert os.path.getsize(path) > 4 << 30
    got = ft.load_file(path, device="cuda")
    assert sorted(got) == sorted(written)
    for name, tensor in written.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    del got, written


@needs_cuda
def test_truncated_on_the_device_frees_the_pinned_ring(tmp_path, monkeypatch, ring_buffers):
    path = tmp_path / "cut.safetensors"
    ft.save_file({"a": torch.ones(8 * MiB), "b": torch.ones(8 * MiB)}, path)
    with fastst.safe_open(path) as f:
        cut = f.data_start + 40 * MiB
    real = _cuda.device_buffer

    def truncating(nbytes, device, source):
        os.truncate(path, cut)
        return real(nbytes, device, source)

    monkeypatch.setattr(_cuda, "device_buffer", truncating)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(fastst.SafetensorError, match=rf"tensor 'b' .* ends at byte {cut}"):
        load_all(path, torch.device("cuda"), chunk_bytes=MiB, buffers=4)
    # freed while the error and its traceback live on
    assert len(ring_buffers) == 1 and ring_buffers[0]() is None
    assert torch.cuda.memory_allocated() == allocated


@needs_cuda
def test_out_of_device_memory_is_clear_and_frees_everything(tmp_path, ring_buffers):
    path = tmp_path / "huge.safetensors"
    _, capacity = torch.cuda.mem_get_info()
    nbytes = capacity + (1 << 30)
    write_raw(path, {"huge": ("U8", [nbytes], 0, nbytes)}, b"")
    with open(path, "r+b") as file:     # sparse: the bytes take no disk
        file.truncate(os.path.getsize(path) + nbytes)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with pytest.raises(torch.cuda.OutOfMemoryError,
                       match=rf"huge\.safetensors: its tensors need {nbytes} bytes"):
        ft.load_file(path, device="cuda")
    assert torch.cuda.memory_allocated() == allocated
    assert ring_buffers == []     # the device buffer comes first: no ring was pinned


@needs_cuda
def test_per_tensor_handle_and_load_model_on_the_device(tmp_path, every_dtype):
    want = ft.load_file(every_dtype)
    with fastst.safe_open(every_dtype, framework="pt", device="cuda") as f:
        assert_same(f.get_tensors(), want)
        assert f.get_tensor("t_BF16").device.type == "cuda"
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    path = tmp_path / "model.safetensors"
    ft.save_model(model, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)).cuda()
    assert ft.load_model(fresh, path, device="cuda") == (set(), [])
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name].cpu(), tensor)


@needs_cuda
@pytest.mark.parametrize("nbytes, chunk_bytes, buffers", [
    (16 * MiB, 16 * MiB, 16), (16 * MiB + 12, 16 * MiB, 16), (40 * MiB + 4, MiB, 3)])
def test_large_tensors_go_to_the_device_through_the_ring(nbytes, chunk_bytes, buffers,
                                                         ring_buffers):
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).view(torch.bfloat16)
    host = host.reshape(2, -1)
    got = _cuda.to_device(host, torch.device("cuda"), chunk_bytes=chunk_bytes, buffers=buffers)
    assert got.device.type == "cuda" and got.dtype == torch.bfloat16 and got.shape == host.shape
    assert bits(got) == bits(host)
    assert len(ring_buffers) == 1 and ring_buffers[0]() is None


@needs_cuda
def test_handle_stages_large_tensors(tmp_path, ring_buffers):
    path = tmp_path / "large.safetensors"
    gen = torch.Generator().manual_seed(3)
    want = {"big": torch.randn(4096, 2048, generator=gen).to(torch.bfloat16),   # 16 MiB
            "fp8": torch.randn(5000, 4000, generator=gen).to(torch.float8_e4m3fn),
            "small": torch.randn(10, generator=gen)}
    ft.save_file(want, path)
    with fastst.safe_open(path, framework="pt", device="cuda") as f:
        got = f.get_tensors()
    assert len(ring_buffers) == 2      # the two large ones
    assert_same(got, {name: want[name] for name in got})


def test_a_sharded_checkpoint_streams_shard_by_shard(tmp_path):
    tensors = {f"layer.{k}": np.arange(k, k + 300, dtype=np.float32) for k in range(5)}
    fastst.save_file(tensors, tmp_path, max_shard_size=2500)
    rings, allocations = [], []

    def make_dest(total, source):
        allocations.append(source)
        return torch.full((total,), 0xAB, dtype=torch.uint8)

    def make_ring(dest, total):
        rings.append(HostRing(dest, *_cuda.ring_shape(total, 256, 3)))
        return rings[-1]

    for opened in (tmp_path, tmp_path / "model.safetensors.index.json"):
        rings.clear(), allocations.clear()
        got = load_through(opened, "pread", make_dest, make_ring)
        assert list(got) == list(tensors)
        for name, array in tensors.items():
            np.testing.assert_array_equal(got[name].numpy(), array)
        assert [os.path.basename(source) for source in allocations] == [
            f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
        assert all(ring.finished and ring.released for ring in rings)


def test_a_broken_checkpoint_is_refused_before_any_shard_is_streamed(tmp_path):
    tensors = {f"layer.{k}": np.full(300, k, dtype=np.float32) for k in range(4)}
    fastst.save_file(tensors, tmp_path, max_shard_size=2500)
    fastst.save_file({"layer.2": tensors["layer.2"]}, tmp_path / "model-00002-of-00002.safetensors")
    streamed = []

    def make_dest(total, source):
        streamed.append(source)
        return torch.empty(total, dtype=torch.uint8)

    with pytest.raises(fastst.SafetensorError, match="'layer.3' is absent from its shard"):
        load_through(tmp_path, "mmap", make_dest, None)
    assert streamed == []


def test_a_directory_of_one_file_streams_that_file(tmp_path):
    fastst.save_file({"w": np.arange(6, dtype=np.int16)}, tmp_path / "model.safetensors")
    def make_dest(total, source):
        return torch.empty(total, dtype=torch.uint8)

    def make_ring(dest, total):
        return HostRing(dest, *_cuda.ring_shape(total, 4, 2))

    got = load_through(tmp_path, "mmap", make_dest, make_ring)
    assert got["w"].tolist() == list(range(6))


@needs_cuda
def test_a_sharded_checkpoint_and_its_model_on_the_device(tmp_path, ring_buffers):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    ft.save_model(model, tmp_path, max_shard_size=4000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    got = ft.load_file(tmp_path, device="cuda")
    assert len(ring_buffers) >= 2                     # one ring per shard
    assert_same(got, ft.load_file(tmp_path))
    assert all(tensor.device.type == "cuda" for tensor in got.values())
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).cuda()
    assert ft.load_model(fresh, tmp_path, device="cuda") == (set(), [])
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name].cpu(), tensor)


def host_stand_ins(chunk_bytes=64, buffers=3):
    rings = []

    def make_dest(total, source):
        return torch.full((total,), 0xAB, dtype=torch.uint8)

    def make_ring(dest, total):
        rings.append(HostRing(dest, *_cuda.ring_shape(total, chunk_bytes, buffers)))
        return rings[-1]

    return make_dest, make_ring, rings


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_an_open_handle_streams_its_file_through_one_ring(every_dtype, backend):
    make_dest, make_ring, rings = host_stand_ins()
    with fastst.safe_open(every_dtype, backend=backend) as f:
        got = _cuda.load_opened_through(f, make_dest, make_ring)
    assert len(rings) == 1 and rings[0].finished and rings[0].released
    assert_same(got, ft.load_file(every_dtype))


def test_an_open_handle_refuses_a_file_replaced_since(tmp_path):
    path = tmp_path / "w.safetensors"
    fastst.save_file({"w": np.arange(8, dtype=np.float32)}, path)
    make_dest, make_ring, rings = host_stand_ins()
    with fastst.safe_open(path) as f:
        fastst.save_file({"w": np.zeros(8, dtype=np.float32)}, path)
        with pytest.raises(fastst.SafetensorError, match="changed since it was opened"):
            _cuda.load_opened_through(f, make_dest, make_ring)
    assert rings == []


class FileConverter:
    """A converter that, like CUDA's, can take a whole file at once."""

    def __init__(self):
        self.files = []

    def __call__(self, array, name, info):
        return ("one", name)

    def convert_file(self, reader):
        self.files.append(reader.source)
        return {name: ("file", name) for name in reader.offset_keys()}


def test_get_tensors_hands_the_whole_file_to_a_converter_that_takes_one(tmp_path):
    from fastst._handles.handle import open_handle
    from fastst._io.source import FileObject, LocalFile

    path = tmp_path / "w.safetensors"
    fastst.save_file({"a": np.ones(3), "b": np.zeros(2)}, path, checksum="xxh3_64")
    convert = FileConverter()
    for backend in ("mmap", "pread"):
        with open_handle(LocalFile(path, backend), convert) as f:
            assert f.get_tensors() == {"a": ("file", "a"), "b": ("file", "b")}
            assert f.get_tensor("a") == ("one", "a")
    assert convert.files == [str(path)] * 2
    with open_handle(LocalFile(path), convert, verify=True) as f:   # checked tensor by tensor
        assert f.get_tensors() == {"a": ("one", "a"), "b": ("one", "b")}
    with open(path, "rb") as file, open_handle(FileObject(file), convert) as f:   # by ranges
        assert f.get_tensors() == {"a": ("one", "a"), "b": ("one", "b")}
    assert len(convert.files) == 2


@needs_cuda
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_cuda_handle_gets_every_tensor_through_one_ring(every_dtype, ring_buffers, backend):
    with fastst.safe_open(every_dtype, framework="pt", device="cuda", backend=backend) as f:
        got = f.get_tensors()
    assert len(ring_buffers) == 1
    assert all(tensor.device.type == "cuda" for tensor in got.values())
    assert_same(got, ft.load_file(every_dtype))


# ---------------------------------------------------------------------------
# Straight into a model's parameters
# ---------------------------------------------------------------------------

def small_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 3, bias=False))
    return model.to(dtype)


@pytest.mark.parametrize("chunk_bytes, buffers", [(7, 3), (64, 2), (MiB, 4)])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_model_state_streams_into_its_own_memory(tmp_path, chunk_bytes, buffers, sharded):
    saved = small_model()
    ft.save_model(saved, tmp_path if sharded else tmp_path / "m.safetensors",
                  **({"max_shard_size": 200} if sharded else {}))
    fresh = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.Linear(7, 3, bias=False))
    state = fresh.state_dict()
    addresses = {name: tensor.data_ptr() for name, tensor in state.items()}
    make_dest, make_ring, rings = host_stand_ins(chunk_bytes, buffers)
    sizes = []

    def counted_dest(total, source):
        sizes.append(total)
        return make_dest(total, source)

    placed, rest = load_into_through(
        state, tmp_path if sharded else tmp_path / "m.safetensors", "mmap", counted_dest,
        make_ring)
    assert sorted(placed) == sorted(saved.state_dict()) and rest == {}
    assert sizes == [0] * len(sizes) and len(sizes) == (len(os.listdir(tmp_path)) - 1
                                                         if sharded else 1)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
        assert fresh.state_dict()[name].data_ptr() == addresses[name]
    assert all(ring.finished and ring.released for ring in rings)


def test_tensors_that_do_not_fit_their_target_go_to_one_allocation(tmp_path, misaligned):
    saved = small_model()
    path = tmp_path / "m.safetensors"
    ft.save_model(saved, path)
    fresh = small_model(torch.float64)            # another dtype: cast by load_state_dict
    state = dict(fresh.state_dict())
    state["0.weight"] = torch.zeros(13, 7).t()    # not contiguous
    del state["2.weight"]                         # no target at all
    state["1.running_mean"] = torch.zeros(7)      # the one that fits
    make_dest, make_ring, _ = host_stand_ins(5, 3)
    placed, rest = load_into_through(state, path, "pread", make_dest, make_ring)
    fitting = {"1.running_mean", "1.num_batches_tracked"}   # int64 in both models
    assert sorted(placed) == sorted(fitting)
    for name in fitting:
        assert torch.equal(state[name], saved.state_dict()[name])
    assert sorted(rest) == sorted(set(saved.state_dict()) - fitting)
    base = min(tensor.data_ptr() for tensor in rest.values())
    for name, tensor in rest.items():
        assert torch.equal(tensor, saved.state_dict()[name])
        assert (tensor.data_ptr() - base) % _cuda.PACKED_ALIGNMENT == 0
    # tensors at offsets their element size does not divide, packed apart and aligned
    placed, rest = load_into_through({}, misaligned, "mmap", make_dest, make_ring)
    assert placed == []
    assert_same(rest, ft.load_file(misaligned))


def test_scatter_puts_each_byte_in_its_piece():
    targets = [torch.zeros(n, dtype=torch.uint8) for n in (3, 0, 5, 4)]
    pieces, offset = [], 0
    for target in targets:
        pieces.append((offset, offset + len(target), target))
        offset += len(target)
    scatter = _cuda.Scatter(torch.device("cpu"), reversed(pieces))
    data = torch.arange(1, offset + 1, dtype=torch.uint8)
    for start in range(0, offset, 5):
        scatter.copy_in(start, data[start:start + 5])
    assert torch.equal(torch.cat(targets), data)


@needs_cuda
def test_load_model_on_the_device_makes_no_second_copy(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024))
    path = tmp_path / "m.safetensors"
    ft.save_model(model, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()
    addresses = {name: tensor.data_ptr() for name, tensor in fresh.state_dict().items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    assert ft.load_model(fresh, path, device="cuda") == (set(), [])
    assert torch.cuda.max_memory_allocated() - before < 1 * MiB      # the file is 32 MiB
    for name, tensor in model.state_dict().items():
        assert fresh.state_dict()[name].data_ptr() == addresses[name]
        assert torch.equal(fresh.state_dict()[name].cpu(), tensor)


# ---------------------------------------------------------------------------
# JAX on a CUDA GPU: the ring's one allocation, reaching JAX through DLPack
# ---------------------------------------------------------------------------

@pytest.fixture
def odd_float4(tmp_path):
    """F4 tensors whose last dim is odd: no torch float4 tensor, but NumPy's and
    JAX's packed bytes."""
    path = tmp_path / "f4.safetensors"
    write_raw(path, {"odd": ("F4", [2, 3], 0, 3), "even": ("F4", [2, 4], 3, 7)},
              bytes(range(1, 8)))
    return path


def assert_same_as_jax_loads(arrays, path, tensors=None):
    """`arrays` are what fastst.flax loads from `path` on the CPU; with `tensors`
    (the torch tensors they came from), each shares its tensor's memory where the
    element sizes agree."""
    flax = pytest.importorskip("fastst.flax")
    expected = flax.load_file(path)
    assert sorted(arrays) == sorted(expected)
    for name, array in arrays.items():
        assert (array.dtype, array.shape) == (expected[name].dtype, expected[name].shape), name
        assert np.asarray(array).tobytes() == np.asarray(expected[name]).tobytes(), name
        if tensors is not None and array.size and (array.dtype.itemsize
                                                   == tensors[name].element_size()):
            assert array.unsafe_buffer_pointer() == tensors[name].data_ptr(), name   # no copy


# random 64-bit values that 32 bits cannot hold: JAX's own cast, on either path
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("fixture", ["every_dtype", "misaligned", "odd_float4"])
def test_jax_takes_the_packed_allocation_as_the_numpy_arrays_are(request, fixture, backend, x64):
    fj = pytest.importorskip("fastst.jax")
    with pytest.importorskip("jax").enable_x64(x64):
        check_jax_takes_the_packed_allocation(fj, request.getfixturevalue(fixture), backend)


def check_jax_takes_the_packed_allocation(fj, path, backend):
    make_dest, make_ring, rings = host_stand_ins(5, 3)
    _, tensors = load_into_through({}, path, backend, make_dest, make_ring,
                                         place=_cuda.numpy_place)
    assert all(ring.finished and ring.released for ring in rings)
    base = min(tensor.data_ptr() for tensor in tensors.values())
    assert all((tensor.data_ptr() - base) % _cuda.PACKED_ALIGNMENT == 0
               for tensor in tensors.values())
    arrays = fj.from_torch(tensors)
    assert_same_as_jax_loads(arrays, path, tensors)
    expected = {name: np.asarray(array).tobytes() for name, array in arrays.items()}
    del tensors
    gc.collect()    # the arrays keep the allocation
    assert {name: np.asarray(array).tobytes() for name, array in arrays.items()} == expected


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_jax_converter_for_cuda_takes_whole_files(every_dtype, backend):
    from fastst._handles.handle import open_handle
    from fastst._io.source import LocalFile

    fj = pytest.importorskip("fastst._frameworks.jax")    # the adapter itself
    make_dest, make_ring, rings = host_stand_ins(7, 2)
    convert = fj.JaxCudaConverter(None, make_dest, make_ring)
    with open_handle(LocalFile(every_dtype, backend), convert) as f:
        arrays = f.get_tensors()
    assert len(rings) == 1 and rings[0].finished and rings[0].released
    assert_same_as_jax_loads(arrays, every_dtype)


def test_a_jax_converter_off_cuda_puts_each_view():
    fj = pytest.importorskip("fastst.jax")
    convert = fj.converter("cpu")
    assert not hasattr(convert, "convert_file")


def jax_gpus():
    try:
        jax = pytest.importorskip("jax")
        return jax.devices("gpu")
    except RuntimeError:
        return []


@needs_cuda
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("sharded", [False, True])
def test_jax_loads_a_file_onto_the_gpu_through_one_ring(tmp_path, every_dtype, ring_buffers,
                                                        sharded):
    if not jax_gpus():
        pytest.skip("needs JAX with a CUDA GPU")
    flax = pytest.importorskip("fastst.flax")
    source = every_dtype
    if sharded:
        flax.save_file(flax.load_file(every_dtype), tmp_path / "ckpt", max_shard_size=300)
        source = tmp_path / "ckpt"
    arrays = flax.load_file(source, device="gpu")
    assert len(ring_buffers) == (len(os.listdir(source)) - 1 if sharded else 1)
    assert all(array.devices() == {jax_gpus()[0]} for array in arrays.values())
    assert_same_as_jax_loads(arrays, source)
