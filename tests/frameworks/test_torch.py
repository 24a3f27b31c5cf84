"""fastst.torch: a drop-in for safetensors.torch whose CPU tensors view the file.

Cross-checked against the reference's torch module: the same bytes written, the
same tensors read both ways, the same model-saving rules for tied weights.
"""
from __future__ import annotations

import gc
import json
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import fastst  # noqa: E402
from conftest import mapping_ranges  # noqa: E402
import fastst.torch as ft  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# torch dtype -> header code, for every code torch has a dtype for
DTYPES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
    torch.uint16: "U16", torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64",
    torch.uint64: "U64", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float32: "F32", torch.float64: "F64", torch.complex64: "C64",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("safetensors")
    import safetensors.torch
    return safetensors.torch


def random_tensor(gen: torch.Generator, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` holding random bit patterns (NaNs and all)."""
    width = torch.empty((), dtype=dtype).element_size()
    count = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (count * width,), generator=gen, dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> bytes:
    """The tensor's elements in C order, as raw bytes (NaN-safe comparison)."""
    tensor = tensor.detach().cpu().contiguous()
    width = tensor.element_size()
    return tensor.view(INTEGER_OF_WIDTH[width]).numpy().tobytes()


def assert_same(got: torch.Tensor, want: torch.Tensor):
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert bits(got) == bits(want)


def inside(pointer: int, ranges) -> bool:
    return any(start <= pointer < end for start, end in ranges)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    ft.save_file({
        "w": torch.randn(64, 32, generator=gen),
        "h": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "q": torch.randn(8, 8, generator=gen).to(torch.float8_e4m3fn),
        "step": torch.tensor(7),
    }, path)
    return path


# ---------------------------------------------------------------------------
# Same bytes as the reference, same tensors both ways
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_each_dtype_matches_the_reference(tmp_path, reference, dtype):
    gen = torch.Generator().manual_seed(1)
    tensors = {"x": random_tensor(gen, dtype, (3, 5)), "s": random_tensor(gen, dtype, ())}
    data = ft.save(tensors)
    assert data == reference.save(tensors)
    header = data[8:8 + struct.unpack("<Q", data[:8])[0]]
    assert f'"dtype":"{DTYPES[dtype]}"'.encode() in header
    path = tmp_path / "x.safetensors"
    ft.save_file(tensors, path)
    assert path.read_bytes() == data
    for loaded in (ft.load_file(path), ft.load(data), reference.load_file(str(path))):
        for name, tensor in tensors.items():
            assert_same(loaded[name], tensor)


@st.composite
def tensor_dicts(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    tensors = {}
    for name in draw(st.lists(st.text("abcxyz._é", min_size=1, max_size=6), unique=True,
                              max_size=5)):
        dtype = draw(st.sampled_from(list(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        tensor = random_tensor(gen, dtype, shape)
        layout = draw(st.sampled_from(["plain", "transposed", "strided", "slice"]))
        if layout == "transposed" and tensor.dim() >= 2:
            tensor = random_tensor(gen, dtype, shape[::-1]).transpose(0, -1)
        elif layout == "strided" and tensor.dim() >= 1:
            tensor = random_tensor(gen, dtype, (shape[0] * 2,) + shape[1:])[::2]
        elif layout == "slice" and tensor.dim() >= 1:
            tensor = random_tensor(gen, dtype, (shape[0] + 3,) + shape[1:])[1:1 + shape[0]]
        tensors[name] = tensor
    return tensors


@SETTINGS
@given(tensors=tensor_dicts(),
       metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5),
                                            min_size=1, max_size=1))
def test_save_matches_the_reference(reference, tensors, metadata):
    data = ft.save(tensors, metadata=metadata)
    # the reference takes contiguous tensors only
    assert data == reference.save({k: v.contiguous() for k, v in tensors.items()},
                                  metadata=metadata)
    ours = ft.load(data)
    assert sorted(ours) == sorted(tensors)
    for name, tensor in tensors.items():
        assert_same(ours[name], tensor)
    # the reference's load() has no F8_E8M0 (its load_file has)
    if all(t.dtype != torch.float8_e8m0fnu for t in tensors.values()):
        theirs = reference.load(data)
        for name, tensor in tensors.items():
            assert_same(theirs[name], tensor)


def test_files_written_by_either_read_the_same(tmp_path, reference, checkpoint):
    theirs_path = tmp_path / "theirs.safetensors"
    reference.save_file(reference.load_file(str(checkpoint)), str(theirs_path))
    assert theirs_path.read_bytes() == checkpoint.read_bytes()
    for path in (checkpoint, theirs_path):
        ours, theirs = ft.load_file(path), reference.load_file(str(path))
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            assert_same(ours[name], theirs[name])
        with fastst.safe_open(path, framework="pt") as f, \
                __import__("safetensors").safe_open(str(path), framework="pt") as g:
            assert f.keys() == sorted(g.keys())
            assert f.metadata() == g.metadata()
            for name in g.keys():
                assert_same(f.get_tensor(name), g.get_tensor(name))
                assert f.get_slice(name).get_shape() == g.get_slice(name).get_shape()
                assert f.get_slice(name).get_dtype() == g.get_slice(name).get_dtype()
            assert_same(f.get_slice("w")[3:9], g.get_slice("w")[3:9])
            assert_same(f.get_slice("w")[1:20:3, 4:], g.get_slice("w")[1:20:3, 4:])
            assert_same(f.get_slice("h")[1, 2], g.get_slice("h")[1, 2])   # 0-d


# ---------------------------------------------------------------------------
# Zero-copy loading
# ---------------------------------------------------------------------------

def test_cpu_tensors_view_the_files_mapping(checkpoint):
    with fastst.safe_open(checkpoint, framework="pt") as f:
        ranges = mapping_ranges(checkpoint)
        assert ranges
        for name in ("w", "h", "q", "step"):
            first, second = f.get_tensor(name), f[name]
            assert first.data_ptr() == second.data_ptr()
            assert inside(first.data_ptr(), ranges)
        w = f.get_tensor("w")
        part = f.get_slice("w")[2:5, ::2]
        assert inside(part.data_ptr(), ranges)
        assert part.data_ptr() == w[2:5, ::2].data_ptr() and part.stride() == (32, 2)
        assert torch.equal(part, w[2:5, ::2])
    loaded = ft.load_file(checkpoint)
    assert all(inside(t.data_ptr(), mapping_ranges(checkpoint)) for t in loaded.values())


def test_a_whole_files_tensors_ask_the_header_only_where_torch_needs_it(tmp_path, monkeypatch):
    """get_tensors (load_file) on the CPU makes each array torch takes as it is a tensor
    at once; a TensorInfo is asked for only for a uint8 array (a packed dtype's
    bytes?), an ml_dtypes one (bfloat16) and one NumPy gives unaligned (copied)."""
    from fastst._handles.handle import NumpyHandle

    layout = [("a", "F32", [4], 16), ("e", "I64", [2], 16), ("b", "U8", [3], 3),
              ("c", "F32", [2], 8), ("d", "BF16", [2], 4)]
    entries, offset = {}, 0
    for name, code, shape, size in layout:
        entries[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)     # "c" starts at 35: unaligned in the file
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(range(offset)))
    asked = []
    info = NumpyHandle.info
    monkeypatch.setattr(NumpyHandle, "info", lambda self, name: asked.append(name) or info(self, name))
    loaded = ft.load_file(path)
    assert sorted(asked) == ["b", "c", "d"]
    monkeypatch.undo()
    with fastst.safe_open(path, framework="pt") as f:
        for name in entries:
            assert_same(loaded[name], f.get_tensor(name))
    assert loaded["c"].data_ptr() % 4 == 0 and bits(loaded["c"]) == bytes(range(35, 43))


def test_tensors_are_writable_without_touching_the_file(checkpoint):
    before = checkpoint.read_bytes()
    with fastst.safe_open(checkpoint, framework="pt") as f:
        w = f.get_tensor("w")
        h = f.get_tensor("h")
        w.fill_(-1.0)
        h.mul_(2)
        assert (f.get_tensor("w") == -1.0).all()
    tensors = ft.load_file(checkpoint)
    tensors["step"] += 1
    assert checkpoint.read_bytes() == before
    assert ft.load_file(checkpoint)["step"].item() == 7


def test_tensors_outlive_the_handle(checkpoint):
    want = ft.load_file(checkpoint, backend="pread")
    f = fastst.safe_open(checkpoint, framework="pt")
    tensors = f.get_tensors()
    piece = f.get_slice("h")[4:]
    f.close()
    del f
    gc.collect()
    for name, tensor in want.items():
        assert_same(tensors[name], tensor)
    assert_same(piece, want["h"][4:])
    with pytest.raises(fastst.SafetensorError, match="closed"):
        handle = fastst.safe_open(checkpoint, framework="pt")
        handle.close()
        handle.get_tensor("w")


def test_pread_backend_and_slices(checkpoint):
    mapped = ft.load_file(checkpoint)
    with fastst.safe_open(checkpoint, framework="pt", backend="pread") as f:
        for name in f.keys():
            assert_same(f.get_tensor(name), mapped[name])
        assert_same(f.get_slice("w")[10:12], mapped["w"][10:12])
        assert_same(f.get_slice("q")[::-1], mapped["q"].flip(0))   # negative step: a copy
        assert_same(f.get_slice("h")[[3, 1]], mapped["h"][[3, 1]])


def test_load_of_bytes_copies_and_of_a_bytearray_shares(checkpoint):
    data = checkpoint.read_bytes()
    tensors = ft.load(data)   # no warning may escape: read-only arrays are copied
    tensors["w"].fill_(0)
    assert ft.load(data)["w"].abs().sum() > 0
    buffer = bytearray(data)
    shared = ft.load(buffer)
    shared["step"].fill_(9)
    assert ft.load(bytes(buffer))["step"].item() == 9


# ---------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu")], ids=str)
def test_cpu_device_spellings(checkpoint, device):
    with fastst.safe_open(checkpoint, framework="pt", device=device) as f:
        assert inside(f.get_tensor("w").data_ptr(), mapping_ranges(checkpoint))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, torch.device("cuda", 0)], ids=str)
def test_unavailable_cuda_is_a_clear_error(checkpoint, device):
    with pytest.raises(RuntimeError, match="is not available"):
        fastst.safe_open(checkpoint, framework="pt", device=device)
    with pytest.raises(RuntimeError, match="is not available"):
        ft.load_file(checkpoint, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device(checkpoint):
    want = ft.load_file(checkpoint)
    for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
        got = ft.load_file(checkpoint, device=device)
        for name, tensor in want.items():
            assert got[name].device.type == "cuda"
            assert_same(got[name].cpu(), tensor)


def test_meta_device_and_bad_devices(checkpoint):
    meta = ft.load_file(checkpoint, device="meta")
    assert meta["h"].is_meta and meta["h"].dtype == torch.bfloat16 and meta["h"].shape == (16, 8)
    for bad in ("nonsense", "cuda:x", 1.5, None, True):
        with pytest.raises(fastst.SafetensorError, match="device"):
            fastst.safe_open(checkpoint, framework="pt", device=bad)


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------

def test_slices_write_only_themselves(tmp_path, reference):
    big = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    part = big[20:30]
    path = tmp_path / "slice.safetensors"
    ft.save_file({"part": part}, path)
    assert path.read_bytes() == reference.save({"part": part.clone()})
    assert os.path.getsize(path) < 100 * 10 * 4
    assert torch.equal(ft.load_file(path)["part"], part)


def test_saves_any_layout_and_autograd_state(reference):
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(4, 6, generator=gen))
    z = torch.randn(3, 2, dtype=torch.complex64, generator=gen)
    tensors = {
        "param": weight,                                   # requires grad
        "t": torch.randn(6, 4, generator=gen).t(),         # transposed
        "expanded": torch.arange(3.0).expand(4, 3),        # zero stride
        "conj": z.conj(),                                  # lazily conjugated view
        "neg": z.clone()._neg_view(),                      # lazily negated view
        "empty": torch.empty(0, 3),
    }
    data = ft.save(tensors)
    resolved = {k: v.detach().resolve_conj().resolve_neg().contiguous()
                for k, v in tensors.items()}
    assert data == reference.save(resolved)
    for name, tensor in ft.load(data).items():
        assert_same(tensor, resolved[name])


def test_failed_save_keeps_the_old_file_and_fsync_is_taken(tmp_path, checkpoint):
    before = checkpoint.read_bytes()
    with pytest.raises(TypeError, match="complex128"):
        ft.save_file({"ok": torch.ones(3), "z": torch.zeros(2, dtype=torch.complex128)},
                     checkpoint)
    assert checkpoint.read_bytes() == before
    ft.save_file({"w": torch.ones(3)}, checkpoint, metadata={"k": "v"}, fsync=True)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    assert ft.load_file(checkpoint)["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", ["q", "qq", "abcdefg", "n" * 37])
def test_float4_of_every_size_matches_the_reference_bytes(name, reference):
    # A header that grows past the next 8-byte boundary once the F4 shape is
    # written must still give the reference's bytes, and a file that loads.
    generator = torch.Generator().manual_seed(len(name))
    for nbytes in range(1, 301):
        packed = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        tensors = {name: packed.view(torch.float4_e2m1fn_x2), "scale": torch.ones(3)}
        data = ft.save(tensors)
        assert data == reference.save(tensors), nbytes
        assert torch.equal(ft.load(data)[name].view(torch.uint8), packed)


def test_float4_packed_as_the_reference_does(tmp_path, reference):
    packed = torch.randint(0, 256, (3, 4), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    tensors = {"f4": packed, "w": torch.ones(2, dtype=torch.bfloat16), "b": torch.ones(1) > 0}
    data = ft.save(tensors, metadata={"k": "v"})
    assert data == reference.save(tensors, metadata={"k": "v"})
    assert b'"f4":{"dtype":"F4","shape":[3,8]' in data
    path = tmp_path / "f4.safetensors"
    ft.save_file(tensors, path)
    with fastst.safe_open(path, framework="pt") as f:
        got = f.get_tensor("f4")
        assert got.dtype == torch.float4_e2m1fn_x2 and got.shape == (3, 4)
        assert bits(got) == bits(packed)
        assert bits(f.get_slice("f4")[1:]) == bits(packed[1:])
        assert f.get_slice("f4").get_shape() == [3, 8]
    theirs = reference.load_file(str(path))["f4"]
    assert theirs.dtype == got.dtype and bits(theirs) == bits(packed)
    with pytest.raises(ValueError, match="0-d"):
        ft.save({"x": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})


def _handmade(tmp_path, code: str, shape: list, payload: bytes):
    header = ('{"x":{"dtype":"%s","shape":%s,"data_offsets":[0,%d]}}'
              % (code, shape, len(payload))).replace(" ", "").encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / f"{code}.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)
    return path


def test_sub_byte_tensors_torch_cannot_hold(tmp_path):
    odd = _handmade(tmp_path, "F4", [2, 3], b"\x12\x34\x56")
    with fastst.safe_open(odd, framework="pt") as f:
        with pytest.raises(fastst.SafetensorError, match="packs two values a byte along the last dim"):
            f.get_tensor("x")
        with pytest.raises(fastst.SafetensorError, match=f"^{odd}: tensor 'x': F4"):
            f.get_tensors()
        with pytest.raises(fastst.SafetensorError, match=f"^{odd}: tensor 'x': F4"):
            f.get_slice("x")[...]
    f6 = _handmade(tmp_path, "F6_E2M3", [2, 4], bytes(range(6)))
    with fastst.safe_open(f6, framework="pt") as f:
        got = f.get_tensor("x")
        assert got.dtype == torch.uint8 and got.shape == (2, 3)   # packed, as in NumPy
        assert got.flatten().tolist() == list(range(6))


def test_shared_memory_is_refused_with_the_references_error(tmp_path, reference):
    x = torch.zeros(6)
    shared = {"a": x, "b": x[:2]}
    for save in (lambda d: ft.save(d), lambda d: ft.save_file(d, tmp_path / "s.safetensors"),
                 lambda d: reference.save(d)):
        with pytest.raises(RuntimeError, match="Some tensors share memory, this will lead to "
                                               "duplicate memory on disk") as error:
            save(shared)
        assert "use `save_model`" in str(error.value)
    assert not os.path.exists(tmp_path / "s.safetensors")
    apart = {"a": x[:3], "b": x[3:]}     # one storage, no overlap: allowed
    assert ft.save(apart) == reference.save(apart)


def test_invalid_inputs_fail_as_in_the_reference(reference):
    cases = [[torch.zeros(2)], {"a": np.zeros(2)},
             {"s": torch.zeros(3, 3).to_sparse()}]
    for tensors in cases:
        with pytest.raises(ValueError) as ours:
            ft.save(tensors)
        with pytest.raises(ValueError) as theirs:
            reference.save(tensors)
        assert str(ours.value).split(" ")[:3] == str(theirs.value).split(" ")[:3]
    with pytest.raises(TypeError, match="complex128"):
        ft.save({"z": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(ValueError, match="meta"):
        ft.save({"m": torch.zeros(2, device="meta")})


@pytest.mark.parametrize("make", [
    lambda x: {"A": x, "B": x[:1]},
    lambda x: {"A": x, "B": x[:1], "C": x},
    lambda x: {"B": x[:2], "C": x[2:]},
    lambda x: {"B": x[:2], "C": x[1:]},
    lambda x: {"B": x[:2], "C": x[2:], "D": x[:1]},
    lambda x: {"A": x, "E": torch.zeros(2), "F": torch.zeros(2, device="meta")},
])
def test_shared_tensor_grouping_matches_the_reference(reference, make):
    tensors = make(torch.zeros(4))

    def norm(groups):
        return sorted(sorted(group) for group in groups)

    assert norm(ft._find_shared_tensors(tensors)) == norm(reference._find_shared_tensors(tensors))
    try:
        want = reference._remove_duplicate_names(tensors)
    except RuntimeError:
        with pytest.raises(RuntimeError, match="None is covering the entire storage"):
            ft._remove_duplicate_names(tensors)
    else:
        assert ft._remove_duplicate_names(tensors) == dict(want)


# ---------------------------------------------------------------------------
# Models: tied weights
# ---------------------------------------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, dim_feedforward=64, dropout=0.0,
                                             batch_first=True) for _ in range(layers))
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight          # tied

    def forward(self, tokens):
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(hidden)


def _model(seed):
    torch.manual_seed(seed)
    return TinyLM().eval()


def test_model_round_trip_with_tied_weights(tmp_path, reference):
    model = _model(0)
    tokens = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(5))
    path = tmp_path / "model.safetensors"
    ft.save_model(model, path)
    with fastst.safe_open(path, framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "embed.weight" in f.keys()
        assert f.metadata() == {"lm_head.weight": "embed.weight"}
    reference_path = tmp_path / "reference.safetensors"
    reference.save_model(model, str(reference_path))
    assert path.read_bytes() == reference_path.read_bytes()

    fresh = _model(1)
    with torch.no_grad():
        before = fresh(tokens)
    assert ft.load_model(fresh, path) == (set(), [])
    with torch.no_grad():
        assert not torch.equal(before, fresh(tokens))
        assert torch.equal(fresh(tokens), model(tokens))
    assert fresh.lm_head.weight is fresh.embed.weight
    assert fresh.lm_head.weight.data_ptr() == fresh.embed.weight.data_ptr()
    assert not inside(fresh.embed.weight.data_ptr(), mapping_ranges(path))
    assert path.read_bytes() == reference_path.read_bytes()

    # each library loads what the other saved
    theirs_loaded = _model(2)
    missing, unexpected = reference.load_model(theirs_loaded, str(path))
    assert not missing and not unexpected
    ours_loaded = _model(3)
    assert ft.load_model(ours_loaded, reference_path) == (set(), [])
    with torch.no_grad():
        want = model(tokens)
        assert torch.equal(theirs_loaded(tokens), want)
        assert torch.equal(ours_loaded(tokens), want)


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = self.a


class Separate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)


def test_load_model_reports_missing_and_unexpected_as_the_reference(tmp_path, reference):
    shared_path = tmp_path / "shared.safetensors"
    ft.save_model(Shared(), shared_path, metadata={"user": "kept"})
    with fastst.safe_open(shared_path, framework="pt") as f:
        assert f.metadata() == {"b.bias": "a.bias", "b.weight": "a.weight", "user": "kept"}
    for load_model in (ft.load_model, reference.load_model):
        with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "b.bias", '
                                               '"b.weight"'):
            load_model(Separate(), str(shared_path))
    missing, unexpected = ft.load_model(Separate(), shared_path, strict=False)
    assert sorted(missing) == ["b.bias", "b.weight"] and unexpected == []

    separate_path = tmp_path / "separate.safetensors"
    ft.save_model(Separate(), separate_path)
    for load_model in (ft.load_model, reference.load_model):
        with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: '
                                               '"b.bias", "b.weight"'):
            load_model(Shared(), str(separate_path))
    missing, unexpected = ft.load_model(Shared(), separate_path, strict=False)
    assert missing == set() and sorted(unexpected) == ["b.bias", "b.weight"]


def test_load_model_returns_what_the_reference_returns(tmp_path, reference):
    """A set of missing names and a list of unexpected ones, as the reference's."""
    path = tmp_path / "partial.safetensors"
    ft.save_file({"a.weight": torch.zeros(4, 4), "extra": torch.ones(1)}, path)
    ours = ft.load_model(Separate(), path, strict=False)
    theirs = reference.load_model(Separate(), str(path), strict=False)
    assert ours == theirs == ({"a.bias", "b.weight", "b.bias"}, ["extra"])
    assert [type(part) for part in ours] == [type(part) for part in theirs] == [set, list]


def test_save_model_of_non_contiguous_weights(tmp_path):
    model = torch.nn.Linear(5, 3)
    model.weight = torch.nn.Parameter(torch.randn(5, 3).t())
    for force in (True, False):
        path = tmp_path / f"nc{force}.safetensors"
        ft.save_model(model, path, force_contiguous=force)
        fresh = torch.nn.Linear(5, 3)
        assert ft.load_model(fresh, path) == (set(), [])
        assert torch.equal(fresh.weight, model.weight)
