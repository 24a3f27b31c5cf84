"""fastst.convert: checkpoints written by real torch, converted without it, equal
byte for byte to what torch.load + fastst.torch.save_file writes."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

import fastst
from helpers import run_bounded
from fastst.convert import convert, numpy_to_safetensors, torch_to_safetensors

torch = pytest.importorskip("torch")
import fastst.torch as fastst_torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PT_FORMAT = {"format": "pt"}

# Every torch dtype the format has a code for, from THE dtype table.
TORCH_DTYPES = {row.code: getattr(torch, row.torch) for row in fastst.DTYPES
                if row.torch and hasattr(torch, row.torch)}


def random_tensor(dtype, shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (count * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def file_bytes(path):
    with open(path, "rb") as fh:
        return fh.read()


def assert_same_as_reference(tmp_path, state, converted, metadata=PT_FORMAT):
    reference = tmp_path / "reference.safetensors"
    fastst_torch.save_file(state, reference, metadata=dict(metadata))
    assert file_bytes(converted) == file_bytes(reference)


def transformer_state(layers=2, width=16, vocab=32):
    state = {"embed.weight": torch.randn(vocab, width)}
    for k in range(layers):
        prefix = f"layers.{k}."
        state[prefix + "attn.qkv.weight"] = torch.randn(3 * width, width)
        state[prefix + "attn.qkv.bias"] = torch.randn(3 * width)
        state[prefix + "mlp.up.weight"] = torch.randn(4 * width, width).to(torch.bfloat16)
        state[prefix + "norm.weight"] = torch.ones(width, dtype=torch.float16)
    state["step"] = torch.tensor(7)
    return state


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_transformer_state_dict_is_byte_identical(tmp_path, legacy):
    state = transformer_state()
    src = tmp_path / "pytorch_model.bin"
    torch.save(state, src, _use_new_zipfile_serialization=not legacy)
    report = torch_to_safetensors(src, tmp_path / "model.safetensors")
    assert report.tensors == len(state) and report.verified and not report.dropped
    assert report.bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert_same_as_reference(tmp_path, state, tmp_path / "model.safetensors")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_every_dtype(tmp_path, legacy):
    state = {code.lower(): random_tensor(dtype, (3, 4), seed=k)
             for k, (code, dtype) in enumerate(TORCH_DTYPES.items())}
    src = tmp_path / "all.pt"
    torch.save(state, src, _use_new_zipfile_serialization=not legacy)
    torch_to_safetensors(src, tmp_path / "all.safetensors")
    with fastst.safe_open(tmp_path / "all.safetensors") as reader:
        assert {reader.info(name).dtype for name in reader.keys()} == set(TORCH_DTYPES)
    assert_same_as_reference(tmp_path, state, tmp_path / "all.safetensors")


def test_views_are_written_compactly_in_c_order(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {"transposed": torch.randn(5, 7).t(), "offset": base[2:4],
             "strided": base[::2, 1::3], "expanded": torch.randn(3, 1).expand(3, 4),
             "scalar_view": base[1, 2], "empty": base[:0], "bf16_t": torch.randn(4, 6).to(
                 torch.bfloat16).t()}
    src = tmp_path / "views.pt"
    torch.save(state, src)
    torch_to_safetensors(src, tmp_path / "views.safetensors")
    loaded = fastst_torch.load_file(tmp_path / "views.safetensors")
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor.contiguous()), name
    contiguous = {name: tensor.contiguous() for name, tensor in state.items()}
    assert_same_as_reference(tmp_path, contiguous, tmp_path / "views.safetensors")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_tied_weights_are_kept_once_and_recorded(tmp_path, legacy):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    src = tmp_path / "tied.bin"
    torch.save(model.state_dict(), src, _use_new_zipfile_serialization=not legacy)
    report = torch_to_safetensors(src, tmp_path / "tied.safetensors")
    assert report.dropped == {"1.weight": "0.weight"}
    reference = tmp_path / "reference.safetensors"
    fastst_torch.save_model(model, reference, metadata=dict(PT_FORMAT))
    assert file_bytes(tmp_path / "tied.safetensors") == file_bytes(reference)


def test_tied_gpt2_embeddings_keep_the_name_both_models_load(tmp_path, caplog):
    """GPT-2 ties lm_head.weight to transformer.wte.weight: the converted folder
    keeps wte, as ``save_pretrained`` does, so that the base model (which has no
    head) loads its embeddings instead of initialising them at random."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    source, out = tmp_path / "source", tmp_path / "converted"
    source.mkdir()
    config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    (report,) = convert(source, out)
    assert report.dropped == {"lm_head.weight": "transformer.wte.weight"}
    caplog.set_level("WARNING")
    base, base_info = transformers.GPT2Model.from_pretrained(out, output_loading_info=True)
    head, head_info = transformers.GPT2LMHeadModel.from_pretrained(out,
                                                                   output_loading_info=True)
    assert base_info["missing_keys"] == set() == head_info["missing_keys"]
    assert "newly initialized" not in caplog.text
    expected = model.transformer.wte.weight
    assert torch.equal(base.wte.weight, expected) and torch.equal(head.lm_head.weight, expected)
    for name, tensor in model.transformer.state_dict().items():
        assert torch.equal(base.state_dict()[name], tensor), name


def test_views_sharing_a_storage_that_differ_are_each_written(tmp_path):
    base = torch.randn(4, 4)
    state = {"whole": base, "row": base[1], "rows": base[1:3]}
    src = tmp_path / "shared.pt"
    torch.save(state, src)
    report = torch_to_safetensors(src, tmp_path / "shared.safetensors")
    assert report.dropped == {}
    loaded = fastst_torch.load_file(tmp_path / "shared.safetensors")
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor)


def test_nested_checkpoint_flattened_or_picked(tmp_path):
    inner = transformer_state(layers=1)
    checkpoint = {"model": inner, "epoch": 3, "optimizer": {"lr": 0.5}, "note": "x/y"}
    src = tmp_path / "nested.ckpt"
    torch.save(checkpoint, src)

    torch_to_safetensors(src, tmp_path / "picked.safetensors", key="model")
    assert_same_as_reference(tmp_path, inner, tmp_path / "picked.safetensors")

    torch_to_safetensors(src, tmp_path / "all.safetensors")
    with fastst.safe_open(tmp_path / "all.safetensors") as reader:
        assert set(reader.keys()) == {f"model/{name}" for name in inner}
    state = fastst.load_state(tmp_path / "all.safetensors", framework="pt")
    assert {key: state[key] for key in ("epoch", "optimizer", "note")} == {
        "epoch": 3, "optimizer": {"lr": 0.5}, "note": "x/y"}
    assert list(state["model"]) == list(inner)
    assert all(torch.equal(state["model"][name], tensor) for name, tensor in inner.items())

    with pytest.raises(fastst.SafetensorError, match="no key 'state_dict'"):
        torch_to_safetensors(src, tmp_path / "x.safetensors", key="state_dict")


def test_optimizer_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    src = tmp_path / "optim.pt"
    torch.save(optimizer.state_dict(), src)
    torch_to_safetensors(src, tmp_path / "optim.safetensors")
    loaded = fastst_torch.load_file(tmp_path / "optim.safetensors")
    state = optimizer.state_dict()["state"]
    assert set(loaded) == {f"state/{k}/{field}" for k in state for field in state[k]}
    for k in state:
        for field, tensor in state[k].items():
            assert torch.equal(loaded[f"state/{k}/{field}"], tensor)


def test_parameters_and_big_endian_marker(tmp_path):
    state = {"p": torch.nn.Parameter(torch.randn(3, 3))}
    src = tmp_path / "param.pt"
    torch.save(state, src)
    torch_to_safetensors(src, tmp_path / "param.safetensors")
    assert torch.equal(fastst_torch.load_file(tmp_path / "param.safetensors")["p"], state["p"])


def test_converter_runs_where_torch_cannot_be_imported(tmp_path):
    state = transformer_state()
    src = tmp_path / "pytorch_model.bin"
    torch.save(state, src)
    fastst_torch.save_file(state, tmp_path / "reference.safetensors", metadata=dict(PT_FORMAT))
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None          # `import torch` raises ImportError
        from fastst.convert import torch_to_safetensors
        torch_to_safetensors({str(src)!r}, {str(tmp_path / "out.safetensors")!r})
        try:
            import torch
        except ImportError:
            print("no torch")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no torch"
    assert file_bytes(tmp_path / "out.safetensors") == file_bytes(
        tmp_path / "reference.safetensors")


def test_npy_and_npz(tmp_path, rng):
    arrays = {"a": rng.standard_normal((3, 4)).astype(np.float32),
              "fortran": np.asfortranarray(rng.standard_normal((5, 6))),
              "big": np.arange(6, dtype=">i4").reshape(2, 3), "flags": np.array([True, False])}
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)
    expected = {name: np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")))
                for name, a in arrays.items()}
    for name in ("plain", "packed"):
        numpy_to_safetensors(tmp_path / f"{name}.npz", tmp_path / f"{name}.safetensors")
        assert file_bytes(tmp_path / f"{name}.safetensors") == fastst.save(expected)
    np.save(tmp_path / "one.npy", arrays["fortran"])
    convert(tmp_path / "one.npy")
    loaded = fastst.load_file(tmp_path / "one.safetensors")
    assert np.array_equal(loaded["array"], arrays["fortran"])


def test_npz_with_objects_is_refused(tmp_path):
    np.savez(tmp_path / "objects.npz", o=np.array([{"x": 1}], dtype=object))
    with pytest.raises(fastst.SafetensorError, match="Python objects"):
        numpy_to_safetensors(tmp_path / "objects.npz", tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_directory_with_sharded_index(tmp_path):
    src, dst = tmp_path / "hub", tmp_path / "out"
    src.mkdir()
    first = {"a.weight": torch.randn(4, 4), "a.bias": torch.randn(4)}
    second = {"b.weight": torch.randn(2, 4)}
    torch.save(first, src / "pytorch_model-00001-of-00002.bin")
    torch.save(second, src / "pytorch_model-00002-of-00002.bin")
    index = {"metadata": {"total_size": 96},
             "weight_map": {**{n: "pytorch_model-00001-of-00002.bin" for n in first},
                            **{n: "pytorch_model-00002-of-00002.bin" for n in second}}}
    import json
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text('{"hidden": 4}')
    reports = convert(src, dst)
    assert len(reports) == 2
    assert sorted(os.listdir(dst)) == ["config.json", "model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"]
    written = json.loads((dst / "model.safetensors.index.json").read_text())
    assert written["weight_map"] == {
        **{n: "model-00001-of-00002.safetensors" for n in first},
        **{n: "model-00002-of-00002.safetensors" for n in second}}
    assert_same_as_reference(tmp_path, second, dst / "model-00002-of-00002.safetensors")
    with fastst.safe_open(dst) as checkpoint:       # the folder opens as one checkpoint
        assert sorted(checkpoint.keys()) == sorted([*first, *second])
        assert np.array_equal(checkpoint.get_tensor("b.weight"), second["b.weight"].numpy())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_a_1_gib_checkpoint_converts_in_bounded_memory(tmp_path):
    """Peak RSS stays near the largest tensor (16 MiB) plus the interpreter, far
    from the 1 GiB the checkpoint holds."""
    src = tmp_path / "big.bin"
    state = {f"layer.{k}": torch.full((4 << 20,), float(k)) for k in range(64)}
    state["transposed"] = torch.randn(1024, 1024).t()
    torch.save(state, src)
    del state
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        from fastst.convert import torch_to_safetensors
        report = torch_to_safetensors({str(src)!r}, {str(tmp_path / "big.safetensors")!r})
        # VmHWM: this process's own peak (ru_maxrss carries the parent's over exec)
        with open("/proc/self/status") as status:
            peak = [line for line in status if line.startswith("VmHWM:")][0].split()[1]
        print(report.bytes, int(peak) // 1024)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    written, peak_mib = map(int, result.stdout.split())
    assert written == (64 << 24) + (4 << 20)
    assert peak_mib < 300, f"peak RSS {peak_mib} MiB"
    with fastst.safe_open(tmp_path / "big.safetensors") as reader:
        assert float(reader.get_tensor("layer.63")[-1]) == 63.0


def test_verification_names_a_tensor_that_differs_from_its_source(tmp_path):
    from fastst.convert._npz import declared_arrays
    from fastst.convert._output import Reporter, verify_written

    np.savez(tmp_path / "a.npz", x=np.arange(1000, dtype=np.int32), y=np.ones(3))
    numpy_to_safetensors(tmp_path / "a.npz", tmp_path / "a.safetensors")
    data = bytearray(file_bytes(tmp_path / "a.safetensors"))
    data[-100] ^= 1                        # a byte of x, the last tensor in the file
    (tmp_path / "a.safetensors").write_bytes(bytes(data))
    with declared_arrays(str(tmp_path / "a.npz")) as declared:
        with pytest.raises(fastst.SafetensorError, match="tensor 'x' differs from its source"):
            verify_written(str(tmp_path / "a.safetensors"), declared, Reporter())


def test_tied_weights_in_a_nest_are_each_written(tmp_path):
    weight = torch.randn(3, 2)
    src = tmp_path / "nested_tied.pt"
    torch.save({"model": {"embed": weight, "head": weight}, "step": 5}, src)
    report = torch_to_safetensors(src, tmp_path / "out.safetensors")
    assert report.dropped == {} and report.tensors == 2
    state = fastst.load_state(tmp_path / "out.safetensors", framework="pt")
    assert state["step"] == 5
    assert torch.equal(state["model"]["embed"], weight) and torch.equal(state["model"]["head"],
                                                                         weight)


def zeros_npz(path, count, name="z"):
    """An .npz of `count` float32 zeros, deflated, written a MiB at a time."""
    header = {"descr": "<f4", "fortran_order": False, "shape": (count,)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, header)
            block = bytes(1 << 20)
            for start in range(0, 4 * count, len(block)):
                member.write(block[:4 * count - start])
    return path


def test_an_npz_of_zeros_is_refused_past_the_expansion_bound(tmp_path):
    """972 kB of .npz converted to 1 GB (at 1 GB of RSS), no question asked."""
    src = zeros_npz(tmp_path / "zeros.npz", 1 << 28)
    assert src.stat().st_size < 1_100_000
    outcome = run_bounded(f"""
        from fastst.convert import convert
        try:
            convert({str(src)!r}, {str(tmp_path / "out.safetensors")!r})
        except fastst.SafetensorError as error:
            print(error)
    """)
    assert outcome.startswith(f"{src}: converting it would write 1073741"), outcome
    assert "'z' (shape [268435456], dtype <f4" in outcome
    assert os.listdir(tmp_path) == ["zeros.npz"]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_an_npz_converts_when_allowed_in_bounded_memory(tmp_path):
    """Allowed past the bound, a compressed member is streamed: peak RSS stays far
    below the 200 MB it holds (it was read whole, then copied)."""
    src = zeros_npz(tmp_path / "zeros.npz", 50 << 20)
    dst = tmp_path / "zeros.safetensors"
    outcome = run_bounded(f"""
        from fastst.convert import numpy_to_safetensors
        numpy_to_safetensors({str(src)!r}, {str(dst)!r}, max_expansion=None)
        with open("/proc/self/status") as status:
            print([line for line in status if line.startswith("VmHWM:")][0].split()[1])
    """, file_size=1 << 30)
    assert int(outcome) >> 10 < 150, f"peak RSS {int(outcome) >> 10} MiB"
    with fastst.safe_open(dst) as reader:
        assert reader.info("z").shape == [50 << 20]
        assert not reader.get_slice("z")[-1000:].any()


def test_npy_and_npz_whose_headers_claim_more_than_they_hold_are_refused(tmp_path):
    header = {"descr": "<f4", "fortran_order": False, "shape": (10 ** 12,)}
    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(npy, header)
    npy.write(bytes(16))
    (tmp_path / "short.npy").write_bytes(npy.getvalue())
    with zipfile.ZipFile(tmp_path / "short.npz", "w") as archive:
        archive.writestr("a.npy", npy.getvalue())
    for name, message in [("short.npy", "its header declares 4000000000000 bytes of array"),
                          ("short.npz", "member 'a.npy' holds 144 bytes, but its header "
                                        "declares 128 and 4000000000000")]:
        outcome = run_bounded(f"""
            from fastst.convert import numpy_to_safetensors
            try:
                numpy_to_safetensors({str(tmp_path / name)!r}, {str(tmp_path / "o")!r})
            except fastst.SafetensorError as error:
                print(error)
        """)
        assert outcome.startswith(f"{tmp_path / name}: ") and message in outcome, outcome
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("kind", ["npy", "npz"])
def test_a_npy_header_length_is_checked_before_it_is_read(tmp_path, kind):
    """A version 2 header may declare a length of up to 4 GiB, which NumPy reads
    before it compares it with its bound: 64 bytes made a 4 GiB allocation
    (found by fuzz/fuzz_unpickler.py)."""
    data = b"\x93NUMPY\x02\x00" + (0xFFFFFFF0).to_bytes(4, "little") + bytes(50)
    path = tmp_path / f"huge_header.{kind}"
    if kind == "npy":
        path.write_bytes(data)
    else:
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("a.npy", data)
    outcome = run_bounded(f"""
        from fastst.convert import convert
        try:
            convert({str(path)!r}, {str(tmp_path / "o.safetensors")!r})
        except fastst.SafetensorError as error:
            print(error)
    """, memory=1 << 30)
    assert outcome.startswith(f"{path}: ") and \
        "a .npy header of 4294967280 bytes (at most 10000 are read)" in outcome, outcome


def test_npz_members_stored_and_compressed_big_endian_and_fortran_stream_alike(tmp_path, rng):
    """Each way a member can be laid out, over more than one chunk of 16 MiB."""
    from fastst.convert import _npz

    arrays = {"c": np.arange(5 << 20, dtype=">i4").reshape(1 << 10, 5 << 10),
              "f": np.asfortranarray(rng.standard_normal((1 << 9, 5 << 10))),
              "b": np.array([True, False, True])}
    expected = {name: np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<")))
                for name, a in arrays.items()}
    np.savez(tmp_path / "stored.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)
    for name in ("stored", "packed"):
        with _npz.declared_arrays(str(tmp_path / f"{name}.npz")) as declared:
            for tensor in declared:
                chunks = [bytes(chunk) for chunk in tensor.chunks()]
                assert max(map(len, chunks)) <= 16 << 20
                assert b"".join(chunks) == expected[tensor.name].tobytes(), (name, tensor.name)


# ---------------------------------------------------------------------------
# Symbolic links in a folder
# ---------------------------------------------------------------------------

@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    (folder / "config.json").write_text("{}")
    secret = tmp_path / "private_key.txt"
    secret.write_text("PRIVATE")
    torch.save({"s": torch.zeros(3)}, tmp_path / "elsewhere.bin")
    return folder


@pytest.mark.parametrize("links", [
    {"tokenizer.json": "../private_key.txt"},
    {"tokenizer.json": "{tmp}/private_key.txt"},
    {"extra.bin": "../elsewhere.bin"},
    {"vocab.txt": "sub/../../private_key.txt"},
    {"hop": "../private_key.txt", "chained.json": "hop"},
], ids=["relative", "absolute", "checkpoint", "through-a-subfolder", "through-a-link"])
def test_a_link_out_of_the_folder_is_refused_before_anything_is_written(
        tmp_path, model_folder, links):
    (model_folder / "sub").mkdir()
    for name, target in links.items():
        os.symlink(target.format(tmp=tmp_path), model_folder / name)
    out = tmp_path / "out"
    with pytest.raises(fastst.SafetensorError, match=r"a symbolic link to .*(private_key.txt|"
                       r"elsewhere.bin), outside .*: refused") as info:
        convert(model_folder, out)
    assert str(model_folder) in str(info.value)
    assert not out.exists()


def test_links_inside_the_folder_count_as_the_files_they_point_to(tmp_path, model_folder):
    (model_folder / "sub").mkdir()
    (model_folder / "sub" / "tokenizer.json").write_text('{"v": 1}')
    os.replace(model_folder / "pytorch_model.bin", model_folder / "sub" / "weights.bin")
    os.symlink("sub/weights.bin", model_folder / "pytorch_model.bin")
    os.symlink("sub/tokenizer.json", model_folder / "tokenizer.json")
    os.symlink(model_folder / "sub", model_folder / "linked_dir")
    out = tmp_path / "out"
    reports = convert(model_folder, out)
    assert [os.path.basename(r.destination) for r in reports] == ["model.safetensors"]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not (out / "tokenizer.json").is_symlink()
    assert (out / "tokenizer.json").read_text() == '{"v": 1}'
    assert fastst.load_file(out / "model.safetensors")["w"].tolist() == [1.0, 1.0]


def test_a_snapshot_of_the_hub_cache_converts_through_its_blob_links(tmp_path):
    """The hub's cache keeps files in models--org--name/blobs and links to them
    from snapshots/<revision>: those links leave the snapshot, into its blobs."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, repo / "blobs" / "aa11")
    (repo / "blobs" / "bb22").write_text("{}")
    os.symlink("../../blobs/aa11", snapshot / "pytorch_model.bin")
    os.symlink("../../blobs/bb22", snapshot / "config.json")
    convert(snapshot, tmp_path / "out")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    (tmp_path / "secret").write_text("PRIVATE")
    os.symlink("../../../secret", snapshot / "tokenizer.json")
    with pytest.raises(fastst.SafetensorError, match="outside"):
        convert(snapshot, tmp_path / "out2")


# --- a conversion killed between its shards -------------------------------------------

KILLED_CONVERSION = """
import os, signal, sys
from fastst.convert import convert, torch_to_safetensors

src, dst, kill_at, folder = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
steps = [0]

def counted(call):
    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)
    return step

for name in ("replace", "rename", "link", "unlink"):
    setattr(os, name, counted(getattr(os, name)))
if folder:
    convert(src, dst)
else:
    torch_to_safetensors(src, dst, max_shard_size=1000)
"""


def layer_state(base):
    return {f"layer.{k}": torch.full((100,), float(base + k)) for k in range(6)}


def loaded_as(target):
    """'old' or 'new' as the converted checkpoint at `target` loads, or what it gives."""
    loaded = fastst.load_file(target)
    for name, base in (("old", 0), ("new", 100)):
        expected = {key: tensor.numpy() for key, tensor in layer_state(base).items()}
        if sorted(loaded) == sorted(expected) and all(
                np.array_equal(loaded[key], expected[key]) for key in expected):
            return name
    return {key: float(value[0]) for key, value in loaded.items()}    # a mix


def write_bin_checkpoint(folder, state):
    """`state` as a sharded PyTorch checkpoint: three .bin shards and their index."""
    import json
    folder.mkdir(exist_ok=True)
    names = sorted(state)
    weight_map = {}
    for k in range(3):
        shard = f"pytorch_model-0000{k + 1}-of-00003.bin"
        part = {name: state[name] for name in names[2 * k:2 * k + 2]}
        torch.save(part, folder / shard)
        weight_map.update({name: shard for name in part})
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_a_killed_conversion_leaves_the_old_checkpoint_or_the_new(tmp_path, folder):
    """Converting over an earlier conversion, killed at any step, leaves the earlier
    checkpoint (its index intact) or the new one, never a mix."""
    outcomes = []
    for kill_at in range(1, 60):
        src, out = tmp_path / f"src-{kill_at}", tmp_path / f"out-{kill_at}"
        if folder:
            write_bin_checkpoint(src, layer_state(0))
            convert(src, out)
            write_bin_checkpoint(src, layer_state(100))
            target, index = out, out / "model.safetensors.index.json"
        else:
            src.mkdir()
            torch.save(layer_state(0), src / "model.pt")
            torch_to_safetensors(src / "model.pt", out / "model.safetensors", max_shard_size=1000)
            torch.save(layer_state(100), src / "model.pt")
            target, index = out / "model.safetensors.index.json", None
            src = src / "model.pt"
        old_index = (index or target).read_bytes()
        child = subprocess.run([sys.executable, "-c", KILLED_CONVERSION, str(src),
                                str(out if folder else out / "model.safetensors"),
                                str(kill_at), "1" if folder else "0"],
                               capture_output=True, text=True, timeout=300)
        assert child.returncode in (0, -9), child.stderr
        outcome = loaded_as(target)
        assert outcome in ("old", "new"), f"killed at step {kill_at}: loads {outcome}"
        outcomes.append(outcome)
        if outcome == "old" and child.returncode != 0 and kill_at == 1:
            assert (index or target).read_bytes() == old_index   # nothing touched yet
        if child.returncode == 0:
            break
    else:
        pytest.fail("the conversion never finished")
    assert outcomes[0] == "old" and outcomes[-1] == "new"
    assert len(outcomes) > 6    # the shards set aside and renamed, one step at a time
