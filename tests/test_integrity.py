"""Per-tensor checksums on write, safe_open(verify=True), and `fastst verify`."""
from __future__ import annotations

import json
import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest

import fastst
import fastst.integrity
from fastst._format import checksums as _checksums
from conftest import modules_loaded_by
from fastst import SafetensorError, safe_open
from fastst.cli import main
from fastst.integrity import CHECKSUM_KEY, digest_of, verify_file, verify_path

xxhash = pytest.importorskip("xxhash")

ARRAYS = {
    "c_order": np.arange(24, dtype=np.float32).reshape(4, 6),
    "fortran": np.asfortranarray(np.arange(35, dtype=np.int16).reshape(5, 7)),
    "big_endian": np.arange(6, dtype=">f8").reshape(2, 3),
    "strided": np.arange(40, dtype=np.int32)[::3],
    "bf16": np.arange(5).astype(ml_dtypes.bfloat16),
    "empty": np.zeros((0, 3), np.uint8),
    "scalar": np.array(7, np.int64),
}


def stored_digests(path, algorithm="xxh3_64"):
    """Each tensor's digest computed from the file's own bytes, without fastst."""
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:start])
    return {name: getattr(xxhash, f"{algorithm}_hexdigest")(
        data[start + entry["data_offsets"][0]:start + entry["data_offsets"][1]])
        for name, entry in header.items() if name != "__metadata__"}


def recorded(path):
    return json.loads(safe_open(path).metadata()[CHECKSUM_KEY])


@pytest.mark.parametrize("algorithm", ["xxh3_64", "xxh3_128"])
def test_checksums_are_of_the_bytes_as_stored(tmp_path, algorithm):
    path = tmp_path / "c.safetensors"
    fastst.save_file(ARRAYS, path, metadata={"kept": "yes"}, checksum=algorithm)
    entry = recorded(path)
    assert entry == {"algorithm": algorithm, "tensors": stored_digests(path, algorithm)}
    assert safe_open(path).metadata()["kept"] == "yes"
    assert fastst.save(ARRAYS, {"kept": "yes"}, checksum=algorithm) == path.read_bytes()


def test_threads_give_the_digests_one_thread_gives(tmp_path, monkeypatch):
    monkeypatch.setattr(_checksums, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(_checksums, "usable_cpus", lambda: 4)
    path = tmp_path / "c.safetensors"
    fastst.save_file(ARRAYS, path, checksum="xxh3_64")
    assert recorded(path)["tensors"] == stored_digests(path)


def test_other_readers_ignore_the_checksums(tmp_path):
    path = tmp_path / "c.safetensors"
    fastst.save_file(ARRAYS, path, checksum="xxh3_64")
    import safetensors.numpy
    loaded = safetensors.numpy.load_file(path)
    for name, array in ARRAYS.items():
        np.testing.assert_array_equal(loaded[name], array)


def test_torch_and_state_writers_write_checksums(tmp_path):
    torch = pytest.importorskip("torch")
    from fastst import torch as fastst_torch
    tensors = {"bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
               "transposed": torch.arange(12.0).reshape(3, 4).t()}
    path = tmp_path / "t.safetensors"
    fastst_torch.save_file(tensors, path, checksum="xxh3_128")
    assert recorded(path)["tensors"] == stored_digests(path, "xxh3_128")
    assert fastst_torch.save(tensors, checksum="xxh3_128") == path.read_bytes()
    fastst_torch.save_file(tensors, tmp_path / "shards", max_shard_size=30,
                           checksum="xxh3_64")
    written = sorted((tmp_path / "shards").glob("*.safetensors"))
    assert len(written) == 2
    for shard in written:
        assert recorded(shard)["tensors"] == stored_digests(shard)
        assert safe_open(shard).metadata()["format"] == "pt"
    with safe_open(tmp_path / "shards", framework="pt", verify=True) as f:
        assert torch.equal(f.get_tensor("transposed"), tensors["transposed"])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    fastst_torch.save_model(model, tmp_path / "model", max_shard_size=300, checksum="xxh3_64")
    report = verify_path(str(tmp_path / "model"))
    assert report["ok"] and len(report["files"]) >= 2
    assert all(file["checked"] == file["tensors"] for file in report["files"])
    state_path = tmp_path / "s.safetensors"
    fastst.save_state(state_path, {"opt": {0: tensors["bf16"]}, "step": 2}, checksum="xxh3_64")
    assert recorded(state_path)["tensors"] == stored_digests(state_path)
    assert fastst.load_state(state_path, framework="pt", verify=True)["step"] == 2


def test_flax_and_spec_writers_write_checksums(tmp_path):
    specs = [fastst.writer.WriteSpec(name, fastst.writer.spec_of_array(name, array).dtype,
                                     array.shape, array) for name, array in ARRAYS.items()]
    path = tmp_path / "w.safetensors"
    fastst.writer.serialize_file(specs, path, checksum="xxh3_64", header_padding=64)
    assert recorded(path)["tensors"] == stored_digests(path)
    assert fastst.writer.serialize(specs, checksum="xxh3_64", header_padding=64) == \
        path.read_bytes()
    pytest.importorskip("jax")
    import jax.numpy as jnp
    from fastst import flax
    arrays = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.zeros(3, jnp.bfloat16)}
    flax.save_file(arrays, path, checksum="xxh3_128")
    assert recorded(path)["tensors"] == stored_digests(path, "xxh3_128")
    assert flax.save(arrays, checksum="xxh3_128") == path.read_bytes()


def test_checksum_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="checksum must be one of"):
        fastst.save({"a": np.zeros(1)}, checksum="md5")
    with pytest.raises(ValueError, match="reserved"):
        fastst.save({"a": np.zeros(1)}, {CHECKSUM_KEY: "x"}, checksum="xxh3_64")


def test_specs_are_checked_before_they_are_hashed():
    spec = fastst.writer.WriteSpec("a", "F32", (3,), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="needs 12 bytes but the data holds 8"):
        fastst.integrity.plan_with_checksums([spec], None, "xxh3_64")
    declared = fastst.writer.WriteSpec("a", "F32", (2,), None)
    with pytest.raises(ValueError, match="checksums need each tensor's data"):
        fastst.integrity.plan_with_checksums([declared], None, "xxh3_64")


def test_hashing_converts_one_block_at_a_time(monkeypatch):
    monkeypatch.setattr(_checksums, "BLOCK_BYTES", 64)
    array = np.asfortranarray(np.arange(400, dtype=">i4").reshape(20, 20))
    sizes = [block.nbytes for block in _checksums._stored_bytes(array)]
    assert max(sizes) <= 80 and sum(sizes) == array.nbytes    # one 80-byte row at most
    assert digest_of(array, "xxh3_64") == xxhash.xxh3_64_hexdigest(
        np.ascontiguousarray(array).astype("<i4").tobytes())


def test_hashing_releases_the_gil(monkeypatch):
    """Another thread keeps running while a large tensor is hashed, each time in one
    call. Eight times: a third of a second of CPU, over which the scheduler shares
    the processors evenly while other processes load the machine (one call, 40 ms,
    once left the other thread 0.4 of its time beside a second test run)."""
    from conftest import cpu_beside
    monkeypatch.setattr(_checksums, "BLOCK_BYTES", 1 << 40)
    big = np.ones(512 << 20, dtype=np.uint8)

    def hash_eight_times():
        for _ in range(8):
            digest_of(big, "xxh3_64")

    work_cpu, other_cpu = cpu_beside(hash_eight_times)
    assert other_cpu > work_cpu / 2, (other_cpu, work_cpu)


def test_saving_imports_no_hashing_or_progress_library_nor_the_verifier():
    loaded = modules_loaded_by("import fastst, numpy as np; fastst.save({'a': np.zeros(1)})",
                               ("xxhash", "tqdm", "fastst.integrity", "fastst._format.checksums"))
    assert loaded == []


# ---------------------------------------------------------------------------
# Corruption
# ---------------------------------------------------------------------------


def corrupt(path, name):
    """Flip one byte in the middle of tensor `name`."""
    with safe_open(path) as f:
        begin, end = f.info(name).data_offsets
        position = f.data_start + (begin + end) // 2
    data = bytearray(path.read_bytes())
    data[position] ^= 0x40
    path.write_bytes(bytes(data))


NONEMPTY = [name for name, array in ARRAYS.items() if array.nbytes]


@pytest.mark.parametrize("name", NONEMPTY)
def test_a_corrupt_byte_is_reported_with_its_tensor(tmp_path, name):
    path = tmp_path / "c.safetensors"
    fastst.save_file(ARRAYS, path, checksum="xxh3_64")
    corrupt(path, name)
    report = verify_file(str(path))
    assert not report["ok"] and report["checked"] == len(ARRAYS)
    assert [error["tensor"] for error in report["errors"]] == [name]
    assert "checksum mismatch" in report["errors"][0]["error"]
    with safe_open(path, verify=True) as f:
        for other in NONEMPTY:
            if other != name:
                f.get_tensor(other)
        with pytest.raises(SafetensorError, match=f"{path}: tensor '{name}': checksum mismatch"):
            f.get_tensor(name)


def test_verify_true_checks_every_way_of_reading(tmp_path):
    path = tmp_path / "c.safetensors"
    fastst.save_file({"m": np.arange(12.0).reshape(4, 3), "ok": np.ones(2)}, path,
                     checksum="xxh3_128")
    corrupt(path, "m")
    reads = [lambda f: f["m"], lambda f: f.get_slice("m")[1:2], lambda f: f.get_tensors(),
             lambda f: f.copy_tensors(), lambda f: f.read_rows("m", 0, 1),
             lambda f: f.gather_rows("m", np.array([0], np.intp)),
             lambda f: f.read_into({"m": np.empty((4, 3))})]
    for backend in ("mmap", "pread"):
        for read in reads:
            with safe_open(path, backend=backend, verify=True) as f:
                np.testing.assert_array_equal(f.get_tensor("ok"), np.ones(2))
                with pytest.raises(SafetensorError, match="tensor 'm': checksum mismatch"):
                    read(f)
    torch = pytest.importorskip("torch")
    with safe_open(path, framework="pt", verify=True) as f:
        assert torch.equal(f.get_tensor("ok"), torch.ones(2, dtype=torch.float64))
        with pytest.raises(SafetensorError, match="tensor 'm': checksum mismatch"):
            f.get_tensor("m")


def test_verify_true_refuses_a_file_without_checksums(tmp_path):
    path = tmp_path / "plain.safetensors"
    fastst.save_file({"a": np.zeros(1)}, path)
    with pytest.raises(SafetensorError, match="has no checksums"):
        safe_open(path, verify=True)
    report = verify_file(str(path))
    assert report["ok"] and report["checksum"] is None and report["checked"] == 0


@pytest.mark.parametrize("entry, match", [
    ("{", "not valid JSON"),
    ('{"algorithm":"xxh3_64"}', "must be an object of 'algorithm' and 'tensors'"),
    ('{"algorithm":"md5","tensors":{}}', "algorithm 'md5' is not known"),
    ('{"algorithm":"xxh3_64","tensors":{"a":"0123456789abcdef","b":"00"}}', "'b' has a checksum but is not"),
    ('{"algorithm":"xxh3_64","tensors":{"a":"0123456789ABCDEF"}}', "16 lowercase hex"),
    ('{"algorithm":"xxh3_64","tensors":{"a":7}}', "16 lowercase hex"),
])
def test_malformed_checksum_metadata_is_a_clear_error(tmp_path, entry, match):
    path = tmp_path / "bad.safetensors"
    fastst.save_file({"a": np.zeros(1)}, path, metadata={CHECKSUM_KEY: entry})
    with pytest.raises(SafetensorError, match=match):
        safe_open(path, verify=True)
    report = verify_file(str(path))
    assert not report["ok"] and report["errors"][0]["tensor"] is None
    assert match.split("'")[0] in report["errors"][0]["error"]


def partly_checksummed(path, covered):
    """A file of tensors a, b, c whose checksums cover only `covered`, and whose
    tensor c is corrupt."""
    fastst.save_file({name: np.full(8, k, np.float32) for k, name in enumerate("abc")}, path,
                     checksum="xxh3_64")
    entry = recorded(path)
    entry["tensors"] = {name: entry["tensors"][name] for name in covered}
    fastst.update_metadata(path, {CHECKSUM_KEY: json.dumps(entry, separators=(",", ":"))})
    corrupt(path, "c")


@pytest.mark.parametrize("covered, message", [
    ("ac", "tensor 'b' has no checksum (the file's checksums cover 2 of its 3 tensors)"),
    ("", "tensors 'a', 'b', 'c' have no checksum (the file's checksums cover 0 of its 3"),
])
def test_verify_true_names_the_tensors_that_checksums_leave_out(tmp_path, covered, message):
    path = tmp_path / "part.safetensors"
    partly_checksummed(path, covered)
    with pytest.raises(SafetensorError, match=re.escape(f"{path}: verify=True, but {message}")):
        safe_open(path, verify=True)


def test_verify_names_the_tensors_that_checksums_leave_out_and_checks_the_others(
        tmp_path, capsys):
    path = tmp_path / "part.safetensors"
    partly_checksummed(path, "ac")
    report = verify_file(str(path))
    assert not report["ok"] and report["checksum"] == "xxh3_64" and report["checked"] == 2
    assert [(error["tensor"], error["error"].split(" (")[0]) for error in report["errors"]] == [
        ("b", "has no checksum"), ("c", "checksum mismatch, the data is corrupt")]
    code, out, _ = run_cli(capsys, path)
    assert code == 1
    assert f"{path}: FAILED: 3 tensors, 96 bytes, 2 checksums (xxh3_64)" in out
    assert "tensor 'b': has no checksum (the file's checksums cover 2 of its 3" in out
    assert "the file has no checksums" not in out


# ---------------------------------------------------------------------------
# fastst verify
# ---------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = main(["verify", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_says_what_a_file_is_when_it_is_no_safetensors_file_and_nothing_of_checksums(
        tmp_path, capsys):
    npy, text, garbled = (tmp_path / name for name in
                          ("weights.npy", "notes.safetensors", "garbled.safetensors"))
    np.save(npy, np.arange(10))
    text.write_text("these are notes, not tensors\n")
    fastst.save_file({"a": np.zeros(2)}, garbled, {CHECKSUM_KEY: "garbage"})
    code, out, _ = run_cli(capsys, npy, text, garbled)
    assert code == 1
    lines = out.splitlines()
    assert lines[:5] == [
        f"{npy}: FAILED", f"  {npy}: not a safetensors file: it is a NumPy .npy file: convert "
                          f"it with `fastst convert {npy}`",
        f"{text}: FAILED", f"  {text}: not a safetensors file: it is text",
        f"{garbled}: FAILED"]
    assert lines[5].startswith(f"  {garbled}: metadata '{CHECKSUM_KEY}' is not valid JSON")
    assert len(lines) == 6


def test_cli_verifies_files_and_names_the_corrupt_tensor(tmp_path, capsys):
    good, bad, plain = (tmp_path / f"{n}.safetensors" for n in ("good", "bad", "plain"))
    fastst.save_file(ARRAYS, good, checksum="xxh3_64")
    fastst.save_file(ARRAYS, bad, checksum="xxh3_64")
    fastst.save_file(ARRAYS, plain)
    corrupt(bad, "fortran")
    code, out, _ = run_cli(capsys, good, plain)
    assert code == 0
    assert f"{good}: ok: 7 tensors" in out and "7 checksums (xxh3_64)" in out
    assert f"{plain}: ok" in out and "the file has no checksums" in out
    code, out, _ = run_cli(capsys, good, bad)
    assert code == 1
    assert f"{bad}: FAILED" in out and "tensor 'fortran': checksum mismatch" in out
    code, out, _ = run_cli(capsys, "--json", bad)
    (report,) = json.loads(out)
    assert code == 1 and report["ok"] is False
    assert report["files"][0]["errors"][0]["tensor"] == "fortran"


def test_cli_reports_a_broken_file_and_a_missing_one(tmp_path, capsys):
    path = tmp_path / "cut.safetensors"
    fastst.save_file({"a": np.zeros(100)}, path, checksum="xxh3_64")
    path.write_bytes(path.read_bytes()[:-10])
    code, out, _ = run_cli(capsys, "--json", path, tmp_path / "missing.safetensors")
    reports = json.loads(out)
    assert code == 1 and [r["ok"] for r in reports] == [False, False]
    assert reports[1]["files"][0]["errors"][0]["error"]


def test_cli_shows_a_progress_bar_only_on_a_terminal(tmp_path, capsys, monkeypatch):
    import fastst._io.progress
    path = tmp_path / "c.safetensors"
    fastst.save_file({"a": np.zeros(1000)}, path, checksum="xxh3_64")
    monkeypatch.setattr(fastst._io.progress, "PROGRESS_MIN_BYTES", 0)
    assert run_cli(capsys, path)[2] == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert "verify" in run_cli(capsys, path)[2]


def shards(tmp_path, weight_map, files):
    for name, tensors in files.items():
        fastst.save_file({t: np.full(2, i, np.float32) for i, t in enumerate(tensors)},
                         tmp_path / name, checksum="xxh3_64")
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return verify_path(str(tmp_path))


def test_a_sharded_folder_verifies(tmp_path, capsys):
    report = shards(tmp_path, {"a": "s1.safetensors", "b": "s2.safetensors",
                               "c": "s2.safetensors"},
                    {"s1.safetensors": ["a"], "s2.safetensors": ["b", "c"]})
    assert report["ok"] and len(report["files"]) == 2 and report["errors"] == []
    assert run_cli(capsys, tmp_path)[0] == 0


@pytest.mark.parametrize("weight_map, files, match", [
    ({"a": "s1.safetensors", "b": "s1.safetensors"}, {"s1.safetensors": ["a"]},
     "tensor 'b' is not in its shard s1.safetensors"),
    ({"a": "s1.safetensors", "b": "s2.safetensors"},
     {"s1.safetensors": ["a"], "s2.safetensors": ["a", "b"]}, "tensor 'a' is in two shards"),
    ({"a": "s1.safetensors"}, {"s1.safetensors": ["a", "x"]},
     "tensor 'x' of s1.safetensors is not in the weight_map"),
    ({"a": "s1.safetensors", "b": "gone.safetensors"}, {"s1.safetensors": ["a"]},
     "shard 'gone.safetensors' is missing"),
    ({"a": "../s1.safetensors"}, {"s1.safetensors": ["a"]},
     "is not a .safetensors file name in the index's folder"),
    ({"a": "%2e%2e%2fs1.safetensors"}, {"s1.safetensors": ["a"]},
     "is not a .safetensors file name in the index's folder"),
    ({"a": 3}, {"s1.safetensors": ["a"]}, "tensor 'a': shard must be a file name string"),
])
def test_index_and_shards_that_disagree_are_reported(tmp_path, capsys, weight_map, files,
                                                     match):
    report = shards(tmp_path, weight_map, files)
    assert not report["ok"]
    assert any(match in error["error"] for error in report["errors"]), report["errors"]
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1 and match in out


def test_a_checkpoint_saved_in_shards_verifies(tmp_path, capsys):
    arrays = {f"layer{i}": np.full(1000, i, np.float32) for i in range(6)}
    fastst.save_file(arrays, tmp_path, max_shard_size=10_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert run_cli(capsys, tmp_path)[0] == 0
    with pytest.raises(SafetensorError, match="has no checksums"):
        safe_open(tmp_path, verify=True).get_tensor("layer0")


def save_checked_shards(folder):
    arrays = {f"layer{i}": np.full(1000, i, np.float32) for i in range(6)}
    fastst.save_file(arrays, folder, max_shard_size=10_000, checksum="xxh3_64")
    return arrays, sorted(folder.glob("*-of-*.safetensors"))


def test_sharded_saves_write_each_shards_checksums(tmp_path):
    arrays, written = save_checked_shards(tmp_path)
    assert len(written) == 3
    for shard in written:
        entry = recorded(shard)
        assert entry["algorithm"] == "xxh3_64"
        assert entry["tensors"] == stored_digests(shard)
    with safe_open(tmp_path, verify=True) as f:
        for name, array in arrays.items():
            np.testing.assert_array_equal(f.get_tensor(name), array)
        np.testing.assert_array_equal(f.copy_tensors()["layer5"], arrays["layer5"])
    with pytest.raises(ValueError, match="header_padding"):
        fastst.save_file(arrays, tmp_path / "padded", max_shard_size=10_000, header_padding=64)


def corrupt_one_tensor(shard, name):
    with safe_open(shard) as f:
        start, (begin, _) = f.data_start, f.info(name).data_offsets
    data = bytearray(shard.read_bytes())
    data[start + begin + 5] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_a_corrupt_shard_is_named_on_reading_and_by_verify(tmp_path, capsys):
    arrays, written = save_checked_shards(tmp_path)
    with safe_open(written[1]) as f:
        victim = f.offset_keys()[-1]
    corrupt_one_tensor(written[1], victim)
    with safe_open(tmp_path / "model.safetensors.index.json", verify=True) as f:
        np.testing.assert_array_equal(f.get_tensor("layer0"), arrays["layer0"])
        with pytest.raises(SafetensorError, match=f"{written[1].name}: tensor '{victim}': "
                                                  f"checksum mismatch"):
            f.get_tensor(victim)
    code, out, _ = run_cli(capsys, tmp_path)
    assert code == 1
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and written[1].name in failed[0]
    assert f"tensor '{victim}': checksum mismatch" in out


def test_a_checkpoint_verifies_by_its_index(tmp_path, capsys):
    arrays, written = save_checked_shards(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    (tmp_path / "other.safetensors").write_bytes(b"not a checkpoint's file")
    report = verify_path(str(index))
    assert report["ok"] and report["errors"] == []
    assert [file["file"] for file in report["files"]] == [str(shard) for shard in written]
    assert all(file["checked"] == 2 for file in report["files"])
    with safe_open(written[2]) as f:
        victim = f.offset_keys()[0]
    corrupt_one_tensor(written[2], victim)
    code, out, _ = run_cli(capsys, index)
    assert code == 1 and f"{written[0]}: ok: 2 tensors" in out
    assert f"{written[2]}: FAILED" in out and f"tensor '{victim}': checksum mismatch" in out
    assert "header" not in out and "other.safetensors" not in out
    os.unlink(written[1])
    code, out, _ = run_cli(capsys, index)
    assert code == 1 and f"shard '{written[1].name}' is missing or unreadable" in out


def test_an_index_that_is_not_one_is_reported_as_an_index(tmp_path, capsys):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{not json")
    code, out, _ = run_cli(capsys, index)
    assert code == 1 and out.startswith(f"{index}: index is not valid JSON")
    index.write_text(" " * 200)
    report = verify_path(str(index), max_header_size=100)
    assert "index of 200 bytes exceeds the limit of 100 bytes" in report["errors"][0]["error"]


def test_an_empty_folder_fails(tmp_path, capsys):
    os.mkdir(tmp_path / "empty")
    assert run_cli(capsys, tmp_path / "empty")[0] == 1


# ---------------------------------------------------------------------------
# Writers that write the header first
# ---------------------------------------------------------------------------


STREAMED = {"c_order": ARRAYS["c_order"], "bf16": ARRAYS["bf16"], "empty": ARRAYS["empty"],
            "scalar": ARRAYS["scalar"], 'odd "name"\\/é': np.arange(9, dtype=np.uint16)}


@pytest.mark.parametrize("algorithm", ["xxh3_64", "xxh3_128"])
@pytest.mark.parametrize("padding", [0, 100])
def test_a_streamed_file_with_checksums_is_the_saved_one(tmp_path, algorithm, padding):
    path, saved = tmp_path / "streamed.safetensors", tmp_path / "saved.safetensors"
    specs = {name: (array.dtype, array.shape) for name, array in STREAMED.items()}
    with fastst.writer.StreamWriter(path, specs, {"k": "v"}, checksum=algorithm,
                                    header_padding=padding) as writer:
        for name, array in reversed(STREAMED.items()):
            if array.ndim and len(array) > 1:       # in two pieces, the last rows first
                writer.write(name, array[1:], start_row=1)
                writer.write(name, array[:1])
            else:
                writer.write(name, array)
    fastst.save_file(STREAMED, saved, {"k": "v"}, checksum=algorithm, header_padding=padding)
    assert path.read_bytes() == saved.read_bytes()
    assert recorded(path)["tensors"] == stored_digests(path, algorithm)
    assert verify_path(str(path))["ok"]


def test_a_tensor_filled_through_a_view_is_hashed(tmp_path):
    path = tmp_path / "view.safetensors"
    with fastst.writer.StreamWriter(path, {"w": ("F32", (3, 4))}, checksum="xxh3_64") as writer:
        view = writer.view("w")
        view[...] = np.arange(12, dtype=np.float32).reshape(3, 4)
        del view
    assert recorded(path)["tensors"] == stored_digests(path)
    with safe_open(path, verify=True) as f:
        assert f.get_tensor("w")[2, 3] == 11


def test_save_file_from_writes_checksums_and_corruption_is_caught(tmp_path):
    source, path = tmp_path / "source.safetensors", tmp_path / "copy.safetensors"
    fastst.save_file(STREAMED, source)
    with safe_open(source) as f:
        fastst.writer.save_file_from(fastst.writer.specs_of(f), f, path, checksum="xxh3_64")
    fastst.save_file(STREAMED, source, checksum="xxh3_64")
    assert path.read_bytes() == source.read_bytes()
    corrupt(path, "c_order")
    with safe_open(path, verify=True) as f:
        with pytest.raises(SafetensorError, match="tensor 'c_order': checksum mismatch"):
            f.get_tensor("c_order")


def test_streamed_checksums_refuse_a_reserved_key_and_leave_no_file(tmp_path):
    with pytest.raises(ValueError, match="reserved for checksums"):
        fastst.writer.StreamWriter(tmp_path / "x.safetensors", {"a": ("U8", (1,))},
                                   {CHECKSUM_KEY: "{}"}, checksum="xxh3_64")
    with pytest.raises(ValueError, match="checksum must be one of"):
        fastst.writer.StreamWriter(tmp_path / "x.safetensors", {"a": ("U8", (1,))},
                                   checksum="md5")
    with pytest.raises(SafetensorError, match="not written"):
        with fastst.writer.StreamWriter(tmp_path / "x.safetensors", {"a": ("U8", (2,))},
                                        checksum="xxh3_64") as writer:
            writer.write_bytes("a", b"\x01")
    assert os.listdir(tmp_path) == []
