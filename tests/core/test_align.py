"""Aligned files (``align=N``): the data, and as many tensors as can, start at multiples
of N in the file; the file stays one that every reader (the reference too) reads as the
same tensors; the default layout is untouched."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings, strategies as st

import fastst
from fastst import SafetensorError
from fastst.writer import MAX_ALIGN, StreamWriter, WriteSpec, plan_write, save_file_from

from conftest import WRITABLE_DTYPES, random_array

SUB_BYTE = [row for row in fastst.DTYPES if row.bits < 8]


def header_of(data: bytes):
    """(data start, {name: entry}) of a file's bytes, parsed here, not by fastst."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return 8 + length, header


def aligned_names(data: bytes, align: int):
    """The tensors of a file's bytes that start at a multiple of `align` in it."""
    start, header = header_of(data)
    return {name for name, entry in header.items()
            if (start + entry["data_offsets"][0]) % align == 0}


def reference_tensors(data: bytes):
    """name -> (dtype, shape, raw bytes), as the reference reads them."""
    return {name: (entry["dtype"], list(entry["shape"]), bytes(entry["data"]))
            for name, entry in safetensors.deserialize(data)}


def expected_tensors(specs):
    return {spec.name: (spec.dtype, list(spec.shape), spec.data.tobytes()) for spec in specs}


ELEMENT_BYTES = {row.code: min(8, max(1, row.bits // 8)) for row in fastst.DTYPES}


def check_aligned_file(data: bytes, specs, align: int) -> None:
    """What an aligned file promises, checked from its bytes."""
    start, header = header_of(data)
    assert start % align == 0
    assert reference_tensors(data) == expected_tensors(specs)
    assert {name: (list(array.shape), array.tobytes()) for name, array in
            fastst.load(data).items()} == {spec.name: (list(spec.data.shape),
                                                       spec.data.tobytes()) for spec in specs}
    for entry in header.values():       # each still at a multiple of its element's size
        assert entry["data_offsets"][0] % ELEMENT_BYTES[entry["dtype"]] == 0
    # at least as many aligned as in the format's order, its header padded alike
    by_name = {spec.name: spec for spec in specs}
    padded = plan_write([by_name[name] for name in plan_write(specs, None).names()], None,
                        align=align, keep_order=True)
    assert len(aligned_names(data, align)) >= len(aligned_names(padded.to_bytes(), align))


def specs_of_every_dtype(rng, rows=(1, 3, 17, 64)):
    specs = []
    for code, dtype in WRITABLE_DTYPES.items():
        for n in rows:
            specs.append(WriteSpec(f"{code}.{n}", code, (n, 3), random_array(rng, dtype, (n, 3))))
    for row in SUB_BYTE:                   # packed bytes: element counts that fill whole bytes
        per_byte = 8 // np.gcd(8, row.bits)    # elements whose bits fill whole bytes
        for n in (per_byte, 3 * per_byte, 25 * per_byte):
            nbytes = n * row.bits // 8
            specs.append(WriteSpec(f"{row.code}.{n}", row.code, (n,),
                                   rng.integers(0, 256, nbytes, dtype=np.uint8)))
    return specs


# -- the plan -----------------------------------------------------------------------


@pytest.mark.parametrize("align", [2, 8, 64, 256, 4096, MAX_ALIGN])
def test_every_dtype_reads_back_the_same_from_an_aligned_file(rng, align):
    specs = specs_of_every_dtype(rng)
    data = plan_write(specs, {"format": "np"}, align=align).to_bytes()
    check_aligned_file(data, specs, align)


def test_sub_byte_tensors_of_odd_byte_sizes_stay_readable(rng):
    specs = [WriteSpec("f4", "F4", (2,), np.array([0x21], np.uint8)),
             WriteSpec("f6", "F6_E3M2", (4,), np.array([1, 2, 3], np.uint8)),
             WriteSpec("w", "F32", (64,), np.ones(64, np.float32)),
             WriteSpec("b", "F32", (14,), np.ones(14, np.float32))]
    data = plan_write(specs, None, align=64).to_bytes()
    check_aligned_file(data, specs, 64)
    start, header = header_of(data)
    # the whole-block tensor first; sizes that are not multiples of 8 last
    assert list(header) == ["w", "b", "f6", "f4"]


def test_tensors_whose_size_is_a_multiple_of_n_all_start_aligned(rng):
    specs = [WriteSpec(f"t{i}", "F32", (size,), np.zeros(size, np.float32))
             for i, size in enumerate([3, 1024, 7, 2048, 10, 4096, 1])]
    data = plan_write(specs, None, align=4096).to_bytes()
    assert {"t1", "t3", "t5"} <= aligned_names(data, 4096)


def test_small_tensors_fill_the_gaps_between_large_ones():
    """A 3072-byte gap after a tensor is filled by tensors whose sizes sum to it: the
    next large one starts aligned."""
    sizes = {"big": 4096 * 5 + 1024, "next": 4096 * 3 + 1024, "a": 1024, "b": 2048,
             "c": 3072, "d": 1024}
    specs = [(name, "U8", (size,)) for name, size in sizes.items()]
    plan = plan_write(specs, None, align=4096)
    starts = {name: plan.data_start + plan.info(name).data_offsets[0] for name in sizes}
    assert plan.names()[:2] == ["big", "c"]        # the one size that closes the gap
    assert starts["big"] % 4096 == starts["next"] % 4096 == 0
    # big+c; next+a+b (1024 + 2048, a before d of the same size, by name); then d
    assert plan.names() == ["big", "c", "next", "a", "b", "d"]
    assert sorted(name for name in sizes if starts[name] % 4096 == 0) == ["big", "d", "next"]


def test_the_format_order_is_kept_when_it_aligns_as_many():
    """Shapes of a Llama-like layer: every tensor a multiple of 4096 bytes, so the
    file is the reference's but for the header's padding."""
    specs = [(f"layers.{i}.{part}", "BF16", shape) for i in range(3)
             for part, shape in [("q", (256, 256)), ("mlp", (688, 256)), ("norm", (2048,))]]
    default, aligned = plan_write(specs, None), plan_write(specs, None, align=4096)
    assert aligned.names() == default.names()
    assert aligned.prefix.rstrip(b" ")[8:] == default.prefix.rstrip(b" ")[8:]
    assert aligned.data_start % 4096 == 0


def gpt2_small_layout():
    """The state dict of GPT-2 small as saved (the tied lm_head once): 148 F32 tensors."""
    layout = [("transformer.wte.weight", (50257, 768)), ("transformer.wpe.weight", (1024, 768))]
    for i in range(12):
        layer = f"transformer.h.{i}."
        layout += [(layer + "ln_1.weight", (768,)), (layer + "ln_1.bias", (768,)),
                   (layer + "attn.c_attn.weight", (768, 2304)),
                   (layer + "attn.c_attn.bias", (2304,)),
                   (layer + "attn.c_proj.weight", (768, 768)),
                   (layer + "attn.c_proj.bias", (768,)),
                   (layer + "ln_2.weight", (768,)), (layer + "ln_2.bias", (768,)),
                   (layer + "mlp.c_fc.weight", (768, 3072)), (layer + "mlp.c_fc.bias", (3072,)),
                   (layer + "mlp.c_proj.weight", (3072, 768)),
                   (layer + "mlp.c_proj.bias", (768,))]
    layout += [("transformer.ln_f.weight", (768,)), ("transformer.ln_f.bias", (768,))]
    return [(name, "F32", shape) for name, shape in layout]


def test_gpt2_small_counts_as_the_benchmark_reports():
    """bench/RESULTS.md's table, for GPT-2 small. At 4096 the count is the most any
    order gets: 61 tensors are multiples of 4096 bytes; of the other 87, 12 leave 1024
    bytes (c_attn.bias) and 75 leave 3072 (wte, norms, biases), and a run of tensors
    ends at a multiple of 4096 only as 1024 + 3072 (12 times) or 4 x 3072 (15 times
    with the 63 left), each run's first aligned, plus the first of the 3 left: 28."""
    layout = gpt2_small_layout()
    assert len(layout) == 148
    default = plan_write(layout, {"format": "pt"}).prefix
    for align, expected in [(64, 148), (256, 148), (4096, 89)]:
        plan = plan_write(layout, {"format": "pt"}, align=align)
        starts = [plan.data_start + plan.info(name).data_offsets[0] for name, _, _ in layout]
        assert sum(start % align == 0 for start in starts) == expected
        assert plan.data_start - len(default) == {64: 64, 256: 128, 4096: 1408}[align]


def test_the_order_depends_on_the_tensors_only(rng):
    specs = specs_of_every_dtype(rng)
    data = plan_write(specs, None, align=256).to_bytes()
    for seed in range(3):
        shuffled = [specs[i] for i in np.random.default_rng(seed).permutation(len(specs))]
        assert plan_write(shuffled, None, align=256).to_bytes() == data
    tensors = {spec.name: spec.data for spec in specs if spec.dtype in WRITABLE_DTYPES}
    reordered = dict(reversed(list(tensors.items())))
    assert fastst.save(tensors, align=4096) == fastst.save(reordered, align=4096)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from(sorted(WRITABLE_DTYPES)),
                                st.lists(st.integers(0, 40), min_size=0, max_size=3)),
                      min_size=0, max_size=24),
       align=st.sampled_from([1, 2, 4, 8, 16, 64, 256, 1024, 4096]),
       seed=st.integers(0, 2**16))
def test_random_tensors_read_back_from_aligned_files(sizes, align, seed):
    rng = np.random.default_rng(seed)
    specs = [WriteSpec(f"t{i}", code, tuple(shape),
                       random_array(rng, WRITABLE_DTYPES[code], tuple(shape)))
             for i, (code, shape) in enumerate(sizes)]
    data = plan_write(specs, {"k": "v"}, align=align).to_bytes()
    check_aligned_file(data, specs, align)
    shuffled = [specs[i] for i in rng.permutation(len(specs))]
    assert plan_write(shuffled, {"k": "v"}, align=align).to_bytes() == data
    # every tensor whose size is a multiple of both 8 and `align` starts aligned (an
    # empty one has no bytes to align: the format's order is kept where it starts as
    # many tensors aligned, and may leave it anywhere)
    start, header = header_of(data)
    assert {spec.name for spec in specs
            if spec.data.nbytes and spec.data.nbytes % max(align, 8) == 0} <= \
        aligned_names(data, align)


@pytest.mark.parametrize("align", [None, 0, 1])
def test_no_alignment_is_the_reference_layout(rng, align):
    tensors = {"b": np.arange(3, dtype=np.float32), "a": np.ones((5, 7)), "c": np.array(3, np.int8)}
    reference = safetensors.numpy.save(tensors, metadata={"format": "np"})
    assert fastst.save(tensors, {"format": "np"}, align=align) == reference
    specs = specs_of_every_dtype(rng)
    assert plan_write(specs, None, align=align).to_bytes() == plan_write(specs, None).to_bytes()


@pytest.mark.parametrize("align", [3, 12, -64, MAX_ALIGN * 2, 1.5, "64", True, np.float64(8)])
def test_alignments_that_are_not_powers_of_two_are_refused(align, tmp_path):
    with pytest.raises(SafetensorError, match=r"align must be a power of two from 1 to 1048576"):
        plan_write([("x", "F32", (2,))], None, align=align)
    with pytest.raises(SafetensorError, match=r"align must be a power of two"):
        fastst.save_file({"x": np.zeros(2)}, tmp_path / "x.safetensors", align=align)
    assert not os.listdir(tmp_path)


def test_numpy_integer_alignments_are_taken():
    plan = plan_write([("x", "F32", (2,))], None, align=np.int64(512))
    assert plan.data_start == 512


def test_a_header_size_that_unaligns_the_data_is_refused():
    with pytest.raises(SafetensorError, match="cannot start the data at a multiple of 64"):
        plan_write([("x", "F32", (2,))], None, header_size=64, align=64)
    assert plan_write([("x", "F32", (2,))], None, header_size=120, align=64).data_start == 128


# -- the writers --------------------------------------------------------------------


def gpt2_like_arrays(rng, layers=2):
    """A small model of GPT-2's proportions: sizes that leave gaps at 4096."""
    arrays = {"wte": rng.standard_normal((129, 24)).astype(np.float32),
              "ln_f.weight": np.ones(768, np.float32), "ln_f.bias": np.zeros(768, np.float32)}
    for i in range(layers):
        arrays.update({f"h.{i}.attn.weight": rng.standard_normal((64, 128)).astype(np.float32),
                       f"h.{i}.attn.bias": rng.standard_normal(2304).astype(np.float32),
                       f"h.{i}.ln.weight": np.ones(768, np.float32),
                       f"h.{i}.ln.bias": np.zeros(768, np.float32),
                       f"h.{i}.step": np.int64(i)})
    return arrays


def test_save_file_writes_the_bytes_of_save(tmp_path, rng):
    arrays = gpt2_like_arrays(rng)
    path = tmp_path / "m.safetensors"
    fastst.save_file(arrays, path, metadata={"format": "np"}, align=4096)
    data = path.read_bytes()
    assert data == fastst.save(arrays, {"format": "np"}, align=4096)
    assert header_of(data)[0] % 4096 == 0
    assert len(aligned_names(data, 4096)) > len(aligned_names(fastst.save(arrays), 4096))
    loaded = safetensors.numpy.load_file(path)
    assert all(np.array_equal(loaded[name], np.asarray(arrays[name])) for name in arrays)


def test_checksums_with_alignment(tmp_path, rng):
    from fastst.integrity import verify_file

    arrays = gpt2_like_arrays(rng)
    path = tmp_path / "m.safetensors"
    fastst.save_file(arrays, path, checksum="xxh3_64", align=4096)
    data = path.read_bytes()
    assert header_of(data)[0] % 4096 == 0
    assert verify_file(path)["ok"]
    # the same order as without checksums: the metadata does not move tensors
    plain = fastst.save(arrays, align=4096)
    assert list(header_of(data)[1]) == list(header_of(plain)[1])
    with fastst.safe_open(path, verify=True) as f:
        assert all(np.array_equal(f.get_tensor(name), arrays[name]) for name in arrays)


def test_stream_writer_and_save_file_from_write_the_bytes_of_save_file(tmp_path, rng):
    arrays = gpt2_like_arrays(rng)
    specs = {name: (np.asarray(array).dtype, np.shape(array)) for name, array in arrays.items()}
    expected = fastst.save(arrays, {"k": "v"}, align=4096)
    path = tmp_path / "stream.safetensors"
    with StreamWriter(path, specs, {"k": "v"}, align=4096) as writer:
        for name in reversed(list(arrays)):
            writer.write(name, np.asarray(arrays[name]))
    assert path.read_bytes() == expected
    save_file_from(specs, list(arrays.items()), path, {"k": "v"}, align=4096)
    assert path.read_bytes() == expected
    with StreamWriter(path, specs, {"k": "v"}, align=4096, checksum="xxh3_128") as writer:
        for name, array in arrays.items():
            writer.write(name, np.asarray(array))
    assert path.read_bytes() == fastst.save(arrays, {"k": "v"}, checksum="xxh3_128",
                                            align=4096)


def test_stream_writer_refuses_a_bad_alignment_and_writes_nothing(tmp_path):
    with pytest.raises(SafetensorError, match="align must be a power of two"):
        StreamWriter(tmp_path / "x.safetensors", {"x": ("F32", (2,))}, align=100)
    assert os.listdir(tmp_path) == []


def test_header_padding_and_metadata_edits_keep_the_alignment(tmp_path, rng):
    arrays = gpt2_like_arrays(rng)
    path = tmp_path / "m.safetensors"
    fastst.save_file(arrays, path, header_padding=300, align=4096, checksum="xxh3_64")
    start, _ = header_of(path.read_bytes())
    assert start % 4096 == 0
    aligned = aligned_names(path.read_bytes(), 4096)
    assert fastst.update_metadata(path, {"step": "1"}) is True         # in place
    assert header_of(path.read_bytes())[0] == start
    assert fastst.update_metadata(path, {"notes": "x" * 5000}) is False  # rewritten
    data = path.read_bytes()
    assert header_of(data)[0] % 4096 == 0 and header_of(data)[0] > start
    assert aligned_names(data, 4096) == aligned
    assert reference_tensors(data) == reference_tensors(fastst.save(arrays, align=4096))
    from fastst.integrity import verify_file
    assert verify_file(path)["ok"]


@pytest.mark.parametrize("align", [16, 64, 4096])
def test_every_edit_of_an_aligned_file_keeps_it_aligned(tmp_path, align):
    """Whatever room the header had (its JSON ending anywhere before the boundary), an
    edit in place or a rewrite, larger or smaller, keeps the data aligned."""
    path = tmp_path / "m.safetensors"
    tensors = {"w": np.arange(24, dtype=np.float32), "b": np.ones(3, np.float32)}
    for length in range(0, 80, 3):
        fastst.save_file(tensors, path, metadata={"p": "x" * length}, align=align)
        assert path.read_bytes()[header_of(path.read_bytes())[0] - 8:
                                 header_of(path.read_bytes())[0]] == b" " * 8
        for edit in (length + 5, length + 1, 3 * length + 200, align + 100, 0):
            fastst.update_metadata(path, {"p": "y" * edit})
            data = path.read_bytes()
            assert header_of(data)[0] % align == 0, (length, edit)
            assert fastst.load(data)["w"].tolist() == list(range(24))


def test_a_file_in_the_format_layout_is_rewritten_as_save_writes_it(tmp_path):
    path = tmp_path / "m.safetensors"
    tensors = {"x": np.zeros(3, np.float32), "y": np.ones(5, np.int16)}
    for length in range(0, 40):
        fastst.save_file(tensors, path, metadata={"p": "x" * length})
        assert fastst.update_metadata(path, {"notes": "z" * (length + 50)}) is False
        assert path.read_bytes() == fastst.save(tensors, {"notes": "z" * (length + 50)})


def test_sharded_saves_align_each_shard(tmp_path, rng):
    arrays = gpt2_like_arrays(rng, layers=4)
    fastst.save_file(arrays, tmp_path / "plain", max_shard_size=40_000)
    fastst.save_file(arrays, tmp_path / "aligned", max_shard_size=40_000, align=4096)
    plain = json.loads((tmp_path / "plain" / "model.safetensors.index.json").read_text())
    aligned = json.loads((tmp_path / "aligned" / "model.safetensors.index.json").read_text())
    assert aligned == plain                   # the same shards, each with the same tensors
    shards = sorted(set(aligned["weight_map"].values()))
    assert len(shards) > 1
    for shard in shards:
        data = (tmp_path / "aligned" / shard).read_bytes()
        assert header_of(data)[0] % 4096 == 0
        assert reference_tensors(data) == reference_tensors((tmp_path / "plain" /
                                                             shard).read_bytes())
    loaded = fastst.load_file(tmp_path / "aligned")
    assert all(np.array_equal(loaded[name], arrays[name]) for name in arrays)


def test_torch_savers_align(tmp_path):
    import torch
    import fastst.torch as fastst_torch

    tensors = {"w": torch.randn(24, 33), "b": torch.randn(33), "h": torch.ones(5).half()}
    data = fastst_torch.save(tensors, align=256)
    assert header_of(data)[0] % 256 == 0
    assert data == fastst.save({name: t.numpy() for name, t in tensors.items()}, align=256)
    path = tmp_path / "t.safetensors"
    fastst_torch.save_file(tensors, path, align=256)
    assert path.read_bytes() == data
    fastst_torch.save_file(tensors, tmp_path / "shards", max_shard_size=1000, align=256)
    for shard in (tmp_path / "shards").glob("*.safetensors"):
        assert header_of(shard.read_bytes())[0] % 256 == 0
    model = torch.nn.Linear(33, 17)
    fastst_torch.save_model(model, path, align=4096)
    assert header_of(path.read_bytes())[0] % 4096 == 0
    from safetensors.torch import load_file
    assert all(torch.equal(load_file(path)[name], value)
               for name, value in model.state_dict().items())


def test_flax_savers_align(tmp_path):
    import jax.numpy as jnp
    import fastst.flax as fastst_flax

    arrays = {"w": jnp.ones((3, 5)), "b": jnp.arange(7)}
    data = fastst_flax.save(arrays, align=128)
    assert header_of(data)[0] % 128 == 0
    fastst_flax.save_file(arrays, tmp_path / "f.safetensors", align=128)
    assert (tmp_path / "f.safetensors").read_bytes() == data


def test_dask_writes_an_aligned_file(tmp_path, rng):
    import dask.array as da
    from fastst.dask import to_safetensors

    arrays = gpt2_like_arrays(rng)
    chunked = {name: da.from_array(np.asarray(array), chunks=(max(1, np.shape(array)[0] // 3),)
                                   + np.shape(array)[1:]) if np.ndim(array) else array
               for name, array in arrays.items()}
    path = tmp_path / "d.safetensors"
    to_safetensors(chunked, path, align=4096, scheduler="synchronous")
    assert path.read_bytes() == fastst.save(arrays, align=4096)


def test_converter_aligns(tmp_path):
    import torch
    from fastst.cli import main
    from fastst.convert import numpy_to_safetensors, torch_to_safetensors

    state = {"w": torch.randn(40, 33), "b": torch.randn(33), "n": torch.arange(5)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch_to_safetensors(tmp_path / "pytorch_model.bin", tmp_path / "a.safetensors", align=4096)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert header_of(data)[0] % 4096 == 0
    expected = fastst.save({name: t.numpy() for name, t in state.items()}, {"format": "pt"},
                           align=4096)
    assert data == expected
    assert main(["convert", str(tmp_path / "pytorch_model.bin"), str(tmp_path / "c"),
                 "--align", "256", "--max-shard-size", "4000", "--no-progress"]) == 0
    shards = sorted((tmp_path / "c").glob("*.safetensors"))
    assert len(shards) > 1
    assert all(header_of(shard.read_bytes())[0] % 256 == 0 for shard in shards)
    np.savez(tmp_path / "a.npz", x=np.ones(7), y=np.zeros((3, 3), np.float32))
    numpy_to_safetensors(tmp_path / "a.npz", tmp_path / "n.safetensors", align=64)
    assert header_of((tmp_path / "n.safetensors").read_bytes())[0] % 64 == 0


@pytest.mark.parametrize("value", ["100", "0x40", "big", "4194304"])
def test_convert_refuses_a_bad_alignment_as_a_usage_error(tmp_path, value, capsys):
    from fastst.cli import main

    np.save(tmp_path / "a.npy", np.ones(3))
    assert main(["convert", str(tmp_path / "a.npy"), "--align", value]) == 2
    assert "--align" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["a.npy"]


# -- inspect ------------------------------------------------------------------------


def test_inspect_counts_the_aligned_tensors(tmp_path, rng, capsys):
    from fastst.cli import main

    arrays = gpt2_like_arrays(rng)
    path = tmp_path / "m.safetensors"
    fastst.save_file(arrays, path, align=4096)
    assert main(["inspect", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    data = path.read_bytes()
    assert report["aligned"] == {str(n): len(aligned_names(data, n)) for n in (64, 256, 4096)}
    assert main(["inspect", str(path)]) == 0
    line = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("aligned")]
    counts = [len(aligned_names(data, align)) for align in (64, 256, 4096)]
    assert counts == [11, 11, 6]       # the two 8-byte step tensors last, unaligned
    assert line == ["aligned      11/13 at 64 B, 11/13 at 256 B, 6/13 at 4.0 KiB "
                    "(tensors starting at multiples of it)"]


def test_inspect_counts_aligned_tensors_of_every_shard(tmp_path, rng, capsys):
    from fastst.cli import main

    arrays = gpt2_like_arrays(rng, layers=4)
    fastst.save_file(arrays, tmp_path, max_shard_size=40_000, align=4096)
    assert main(["inspect", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    shards = {path.name: path.read_bytes() for path in tmp_path.glob("*.safetensors")}
    assert len(shards) > 1
    assert report["aligned"] == {str(n): sum(len(aligned_names(data, n))
                                             for data in shards.values())
                                 for n in (64, 256, 4096)}
