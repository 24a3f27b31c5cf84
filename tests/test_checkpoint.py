"""Sharded checkpoints (fastst.checkpoint): one handle over all shards, opened
lazily and checked against the index; the greedy split, the files and the index
written by save_file(..., max_shard_size=...); stale shards removed after."""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

import fastst
from fastst.checkpoint import (ShardEntry, parse_size, read_index, save_checkpoint,
                               split_into_shards)
from conftest import mapping_ranges
from pages import descriptors_on

INDEX = "model.safetensors.index.json"


def arrays(count=6, length=100):
    return {f"layer.{k}": np.full(length, k, dtype=np.float32) for k in range(count)}


@pytest.fixture
def checkpoint(tmp_path):
    """Six 400-byte tensors in three shards of two."""
    tensors = arrays()
    fastst.save_file(tensors, tmp_path, max_shard_size=800)
    return tmp_path, tensors


def shard_names(count):
    return [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def write_index(directory, weight_map, metadata=None, name=INDEX):
    document = {"metadata": metadata or {}, "weight_map": weight_map}
    (directory / name).write_text(json.dumps(document))
    return directory / name


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("via_index", [False, True])
def test_a_checkpoint_opens_as_one_handle(checkpoint, via_index):
    directory, tensors = checkpoint
    assert sorted(os.listdir(directory)) == shard_names(3) + [INDEX]
    with fastst.safe_open(directory / INDEX if via_index else directory) as f:
        assert f.keys() == sorted(tensors)
        assert len(f) == 6 and "layer.3" in f and "nope" not in f
        assert list(f) == sorted(tensors)
        assert f.metadata() == {"total_size": 2400}
        assert f.source == str(directory / INDEX)
        for name, array in tensors.items():
            assert np.array_equal(f.get_tensor(name), array)
            assert np.array_equal(f[name], array)
        assert f.get_slice("layer.4")[10:13].tolist() == [4.0, 4.0, 4.0]
        assert f.info("layer.5").shape == [100]
        assert f.offset_keys() == list(tensors)
        assert list(f.get_tensors()) == list(tensors)
        assert f.shard_file("layer.5").endswith(shard_names(3)[2])


def test_load_file_and_load_into_read_every_shard(checkpoint):
    directory, tensors = checkpoint
    for copy in (False, True):
        loaded = fastst.load_file(directory, copy=copy)
        assert list(loaded) == list(tensors)
        assert all(np.array_equal(loaded[name], tensors[name]) for name in tensors)
    out = {name: np.empty_like(array) for name, array in tensors.items()}
    fastst.load_into(directory, out)
    assert all(np.array_equal(out[name], tensors[name]) for name in tensors)


def test_shards_open_on_first_use_and_close_with_the_handle(checkpoint):
    directory, _ = checkpoint
    shards = [directory / name for name in shard_names(3)]
    with fastst.safe_open(directory) as f:
        assert f.keys() and f.metadata()
        assert all(mapping_ranges(shard) == [] for shard in shards)
        f.get_tensor("layer.2")                     # in the second shard
        assert [bool(mapping_ranges(shard)) for shard in shards] == [False, True, False]
    assert f.closed
    assert all(mapping_ranges(shard) == [] for shard in shards)
    with pytest.raises(fastst.SafetensorError, match="closed"):
        f.get_tensor("layer.0")


def test_mapped_shards_hold_no_descriptor(checkpoint):
    directory, _ = checkpoint
    shards = [directory / name for name in shard_names(3)]
    with fastst.safe_open(directory) as f:
        f.get_tensors()
        assert descriptors_on(*shards) == 0
    with fastst.safe_open(directory, backend="pread") as f:
        f.get_tensors()
        assert descriptors_on(*shards) == 3
    assert descriptors_on(*shards) == 0


def test_a_missing_shard_is_named_with_the_tensor_on_use(checkpoint):
    directory, tensors = checkpoint
    os.unlink(directory / shard_names(3)[1])
    with fastst.safe_open(directory) as f:       # only the index is read here
        assert np.array_equal(f.get_tensor("layer.0"), tensors["layer.0"])
        with pytest.raises(fastst.SafetensorError) as error:
            f.get_tensor("layer.3")
    message = str(error.value)
    assert str(directory / INDEX) in message and "'layer.3'" in message
    assert shard_names(3)[1] in message and "missing" in message


def test_an_unknown_tensor_is_not_found_in_the_index(checkpoint):
    directory, _ = checkpoint
    with fastst.safe_open(directory) as f, pytest.raises(fastst.TensorNotFoundError) as error:
        f.get_tensor("nope")
    assert str(directory / INDEX) in str(error.value) and "'nope'" in str(error.value)


def test_a_tensor_absent_from_its_shard(checkpoint):
    directory, _ = checkpoint
    index = json.loads((directory / INDEX).read_text())
    index["weight_map"]["ghost"] = shard_names(3)[0]
    write_index(directory, index["weight_map"])
    with fastst.safe_open(directory) as f, pytest.raises(fastst.SafetensorError) as error:
        f.get_tensor("layer.0")
    assert "'ghost' is absent from its shard" in str(error.value)
    assert str(directory / INDEX) in str(error.value)


def test_a_tensor_in_two_shards(tmp_path):
    fastst.save_file({"a": np.zeros(2), "b": np.ones(2)}, tmp_path / "one.safetensors")
    fastst.save_file({"a": np.zeros(2)}, tmp_path / "two.safetensors")
    write_index(tmp_path, {"a": "two.safetensors", "b": "one.safetensors"})
    with fastst.safe_open(tmp_path / INDEX) as f, pytest.raises(fastst.SafetensorError) as error:
        f.get_tensor("b")
    assert ("tensor 'a' is in shard 'one.safetensors' and, by the index, in "
            "'two.safetensors'") in str(error.value)


def test_a_shard_holding_a_tensor_the_index_does_not_name(tmp_path):
    fastst.save_file({"a": np.zeros(2), "extra": np.ones(2)}, tmp_path / "one.safetensors")
    write_index(tmp_path, {"a": "one.safetensors"})
    with fastst.safe_open(tmp_path / INDEX) as f, pytest.raises(fastst.SafetensorError) as error:
        f.get_tensor("a")
    assert "holds tensor 'extra', which the index does not name" in str(error.value)


@pytest.mark.parametrize("text, rule", [
    (b"{not json", "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b'{"metadata": {}}', "no 'weight_map' object"),
    (b'{"weight_map": []}', "no 'weight_map' object"),
    (b'{"weight_map": {}, "metadata": "x"}', "'metadata' must be an object"),
    (b'{"weight_map": {"w": 3}}', "tensor 'w': shard must be a file name string"),
    (b'{"weight_map": {"w": "../up.safetensors"}}', "tensor 'w': shard '../up.safetensors'"),
    (b'{"weight_map": {"w": "/abs.safetensors"}}', "tensor 'w': shard '/abs.safetensors'"),
    (b'{"weight_map": {"w": "sub/x.safetensors"}}', "tensor 'w': shard 'sub/x.safetensors'"),
    (b'{"weight_map": {"w": "model.bin"}}', "tensor 'w': shard 'model.bin'"),
    (b'{"weight_map": {"w": "..%2fup.safetensors"}}', "shard '..%2fup.safetensors' is not"),
    (b'{"weight_map": {"w": "a?.safetensors"}}', "shard 'a?.safetensors' is not"),
    (b'{"weight_map": {"w": "a#.safetensors"}}', "shard 'a#.safetensors' is not"),
    (b'{"weight_map": {"w": "a\\\\b.safetensors"}}', "shard 'a\\\\b.safetensors' is not"),
    (b'{"weight_map": {"w": "a\\u0001.safetensors"}}', "shard 'a\\x01.safetensors' is not"),
    (b'{"weight_map": {"w": ".hidden.safetensors"}}', "shard '.hidden.safetensors' is not"),
    (b'{"weight_map": {"w": "a.safetensors", "w": "b.safetensors"}}', "names 'w' twice"),
    (b'{"weight_map": {}, "x": ' + b"[" * 500 + b"]" * 500 + b"}", "nests deeper than 64"),
    (b'{"weight_map": {}, "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", "not valid JSON"),
])
def test_a_malformed_index_names_the_file_and_the_rule(tmp_path, text, rule):
    (tmp_path / INDEX).write_bytes(text)
    with pytest.raises(fastst.SafetensorError) as error:
        fastst.safe_open(tmp_path)
    assert str(error.value).startswith(f"{tmp_path / INDEX}: ")
    assert rule in str(error.value)


def test_an_index_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / INDEX)
    with pytest.raises(fastst.SafetensorError, match="index is not a regular file"):
        fastst.safe_open(tmp_path / INDEX)


def test_an_index_past_the_size_limit_is_not_read(checkpoint):
    directory, _ = checkpoint
    with pytest.raises(fastst.SafetensorError, match="exceeds the limit of 100 bytes"):
        fastst.safe_open(directory, max_header_size=100)


def test_a_directory_with_one_unsharded_file(tmp_path):
    fastst.save_file({"w": np.arange(3.0)}, tmp_path / "model.safetensors")
    with fastst.safe_open(tmp_path) as f:
        assert isinstance(f, fastst.NumpyHandle) and f.get_tensor("w").tolist() == [0, 1, 2]


def test_a_directory_without_a_checkpoint_or_with_several(tmp_path):
    with pytest.raises(fastst.SafetensorError, match="no model.safetensors.index.json"):
        fastst.safe_open(tmp_path)
    for name in ("a.safetensors", "b.safetensors"):
        fastst.save_file({"w": np.zeros(1)}, tmp_path / name)
    with pytest.raises(fastst.SafetensorError, match="several checkpoints"):
        fastst.load_file(tmp_path)


def test_numpy_checkpoints_live_on_the_cpu(checkpoint):
    with pytest.raises(fastst.SafetensorError, match="device must be 'cpu'"):
        fastst.safe_open(checkpoint[0], device="cuda")


def test_framework_adapters_load_a_checkpoint(checkpoint):
    torch = pytest.importorskip("torch")
    import fastst.torch

    directory, tensors = checkpoint
    loaded = fastst.torch.load_file(directory)
    assert list(loaded) == list(tensors)
    assert all(torch.equal(loaded[n], torch.from_numpy(tensors[n])) for n in tensors)
    with fastst.safe_open(directory, framework="pt") as f:
        assert f.get_slice("layer.1")[:2].tolist() == [1.0, 1.0]
        assert isinstance(f.get_tensor("layer.5"), torch.Tensor)


def test_flax_loads_a_checkpoint(checkpoint):
    pytest.importorskip("jax")
    import fastst.flax

    directory, tensors = checkpoint
    loaded = fastst.flax.load_file(directory)
    assert all(np.array_equal(np.asarray(loaded[n]), tensors[n]) for n in tensors)


def test_flax_saves_a_checkpoint(tmp_path):
    pytest.importorskip("jax")
    import jax.numpy as jnp
    import ml_dtypes
    import fastst.flax

    tensors = {f"layer.{k}": jnp.full((10, 10), k, jnp.bfloat16) for k in range(6)}
    fastst.flax.save_file(tensors, tmp_path, {"format": "flax"}, max_shard_size=400,
                          checksum="xxh3_64")
    assert sorted(path.name for path in tmp_path.glob("*.safetensors")) == shard_names(3)
    loaded = fastst.flax.load_file(tmp_path)
    assert list(loaded) == list(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(loaded[name]).view(np.uint16),
                              np.asarray(array).view(np.uint16))
    with fastst.safe_open(tmp_path, verify=True) as f:
        assert f.metadata() == {"total_size": 6 * 200, "format": "flax"}
        assert f.get_tensor("layer.5").dtype == ml_dtypes.bfloat16


# ---------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------

def entries(*sizes, storages=None):
    storages = storages or [None] * len(sizes)
    return [ShardEntry(fastst.writer.WriteSpec(f"t{k}", "U8", (size,), np.zeros(size, np.uint8)),
                       size, storage) for k, (size, storage) in enumerate(zip(sizes, storages))]


def test_the_split_is_greedy_in_order():
    assert split_into_shards(entries(6, 6, 2, 6, 2, 2), 10) == (
        [["t0"], ["t1", "t2"], ["t3", "t4", "t5"]], 24)
    # a tensor over the limit gets a shard of its own at once; the open shard goes on
    assert split_into_shards(entries(3, 20, 3, 5), 10) == ([["t1"], ["t0", "t2"], ["t3"]], 31)
    assert split_into_shards(entries(4, 4), 100) == ([["t0", "t1"]], 8)
    assert split_into_shards([], 100) == ([], 0)


def test_tensors_of_one_storage_join_the_first_ones_shard_and_count_once():
    split = split_into_shards(entries(8, 8, 8, 8, storages=["s", None, "s", None]), 10)
    assert split == ([["t0", "t2"], ["t1"], ["t3"]], 24)


@pytest.mark.parametrize("size, expected", [
    ("5GB", 5 * 10**9), (" 1.5MB", 1_500_000), ("100kb", 100_000), ("2TB", 2 * 10**12),
    (123, 123),
])
def test_sizes_parse_as_the_hugging_face_tools_parse_them(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["5GiB", "GB", "x5GB", "5", 0, -1, True, 1.5, None])
def test_a_bad_size_is_refused(size):
    with pytest.raises(fastst.SafetensorError, match="max_shard_size"):
        parse_size(size)


def test_the_index_is_written_as_huggingface_hub_writes_it(checkpoint):
    directory, tensors = checkpoint
    expected = {"metadata": {"total_size": 2400},
                "weight_map": {name: shard_names(3)[k // 2]
                               for k, name in enumerate(tensors)}}
    assert (directory / INDEX).read_text() == json.dumps(expected, indent=2)
    with fastst.safe_open(directory / shard_names(3)[0]) as shard:
        assert shard.keys() == ["layer.0", "layer.1"] and shard.metadata() is None


def test_metadata_goes_to_the_index_or_to_the_single_file(tmp_path):
    fastst.save_file(arrays(), tmp_path / "a", max_shard_size="1KB", metadata={"k": "v"})
    assert fastst.safe_open(tmp_path / "a").metadata() == {"total_size": 2400, "k": "v"}
    fastst.save_file(arrays(), tmp_path / "b", max_shard_size="1MB", metadata={"k": "v"})
    assert os.listdir(tmp_path / "b") == ["model.safetensors"]
    assert fastst.safe_open(tmp_path / "b").metadata() == {"k": "v"}


def test_a_file_name_names_the_shards(tmp_path):
    fastst.save_file(arrays(), tmp_path / "out" / "weights.safetensors", max_shard_size=800)
    assert sorted(os.listdir(tmp_path / "out")) == [
        f"weights-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)
    ] + ["weights.safetensors.index.json"]
    assert read_index(tmp_path / "out" / "weights.safetensors.index.json").shards
    loaded = fastst.load_file(tmp_path / "out" / "weights.safetensors.index.json")
    assert list(loaded) == list(arrays())


@pytest.mark.parametrize("name", [".hidden.safetensors", "a%2f.safetensors",
                                  "a?.safetensors", "a#b.safetensors"])
def test_a_name_whose_shards_no_index_could_name_is_refused(tmp_path, name):
    with pytest.raises(fastst.SafetensorError, match="no index could name them"):
        fastst.save_file(arrays(), tmp_path / "out" / name, max_shard_size=800)
    assert not (tmp_path / "out").exists()


def test_a_new_save_removes_the_stale_files_of_the_last_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.backup").write_text("keep")
    fastst.save_file(arrays(), tmp_path, max_shard_size=800)
    fastst.save_file(arrays(), tmp_path, max_shard_size=1200)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", *shard_names(2), INDEX,
                                                   "model.safetensors.backup"])
    assert list(fastst.load_file(tmp_path)) == list(arrays())
    fastst.save_file(arrays(), tmp_path, max_shard_size="1GB")
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors",
                                            "model.safetensors.backup"]
    fastst.save_file(arrays(), tmp_path, max_shard_size=800)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", *shard_names(3), INDEX,
                                                   "model.safetensors.backup"])


def test_a_failed_shard_leaves_the_last_save_whole(tmp_path):
    fastst.save_file(arrays(), tmp_path, max_shard_size=800)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    bad = [ShardEntry(fastst.writer.WriteSpec("ok", "U8", (4,), np.zeros(4, np.uint8)), 4),
           ShardEntry(fastst.writer.WriteSpec("bad", "F32", (4,), np.zeros(4, np.uint8)), 16)]
    with pytest.raises(ValueError, match="'bad'"):
        save_checkpoint(bad, tmp_path, max_shard_size=4)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


# A re-save killed (SIGKILL) at its k-th step, a step being any call that changes
# the directory's names: os.replace, os.rename, os.link or os.unlink. With `no_links`,
# the file system makes no hard links (os.link fails with EPERM). The old checkpoint
# has six shards; the new one is cut by the max_shard_size given.
KILLED_SAVE = """
import errno, os, signal, sys
import numpy as np
import fastst

directory, kill_at, no_links, size = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
steps = [0]

def counted(call):
    def step(*args, **kwargs):
        steps[0] += 1
        if steps[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return call(*args, **kwargs)
    return step

def no_link(*args, **kwargs):
    raise PermissionError(errno.EPERM, "no hard links here")

if no_links:
    os.link = no_link
for name in ("replace", "rename", "link", "unlink"):
    setattr(os, name, counted(getattr(os, name)))
arrays = {f"layer.{k}": np.full(100, 100 + k, np.float32) for k in range(6)}
fastst.save_file(arrays, directory, max_shard_size=int(size) if size.isdigit() else size)
print("saved after", steps[0], "steps")
"""


def saved_arrays(base):
    return {f"layer.{k}": np.full(100, base + k, np.float32) for k in range(6)}


def loads_as(directory):
    """'old', 'new', or the error that opening the checkpoint in `directory` raises."""
    try:
        loaded = fastst.load_file(directory)
    except fastst.SafetensorError as error:
        return error
    for name, base in (("old", 0), ("new", 100)):
        expected = saved_arrays(base)
        if list(loaded) == list(expected) and all(
                np.array_equal(loaded[key], expected[key]) for key in expected):
            return name
    return {key: value[0] for key, value in loaded.items()}   # a mix


def listing(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.mark.parametrize("size, no_links", [
    (400, False),      # six shards again: each takes the name of an old one
    (400, True),
    (800, False),      # three shards, of other names
    ("1GB", False),    # one file
])
def test_a_killed_re_save_leaves_the_old_or_the_new_checkpoint(tmp_path, size, no_links):
    killed, outcomes = [], []
    for kill_at in range(1, 100):
        directory = tmp_path / f"killed-{kill_at}"
        fastst.save_file(saved_arrays(0), directory, max_shard_size=400)
        assert len(os.listdir(directory)) == 7
        child = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(directory),
                                str(kill_at), "1" if no_links else "0", str(size)],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode in (0, -signal.SIGKILL), child.stderr
        outcome = loads_as(directory)
        if isinstance(outcome, fastst.SafetensorError):
            # only where hard links are not made: a shard set aside by a rename
            assert no_links and "is missing" in str(outcome), outcome
            outcome = "error"
        assert outcome in ("old", "new", "error"), f"killed at step {kill_at}: loads {outcome}"
        outcomes.append(outcome)
        killed.append(directory)
        if child.returncode == 0:
            break
    else:
        pytest.fail("the save never finished")
    assert outcomes[0] == "old" and outcomes[-1] == "new" and "new" in outcomes[:-1]
    if size == 400:     # six shards set aside, six renamed into place, two indexes
        assert len(outcomes) > 14
    # the next save finishes the work: the files of a clean save, and nothing else
    clean = tmp_path / "clean"
    fastst.save_file(saved_arrays(200), clean, max_shard_size=size)
    for directory in killed:
        fastst.save_file(saved_arrays(200), directory, max_shard_size=size)
        assert listing(directory) == listing(clean), directory.name


def test_an_fsynced_re_save_flushes_each_rename_before_the_ones_that_depend_on_it(
        tmp_path, monkeypatch):
    fastst.save_file(saved_arrays(0), tmp_path, max_shard_size=400)
    log = []

    def logged(name, call, describe):
        def step(*args, **kwargs):
            log.append((name, *describe(*args)))
            return call(*args, **kwargs)
        monkeypatch.setattr(os, name, step)

    logged("fsync", os.fsync, lambda fd: (os.readlink(f"/proc/self/fd/{fd}"),))
    logged("replace", os.replace, lambda source, target: (os.path.basename(target),))
    logged("link", os.link, lambda source, target, **_: (os.path.basename(target),))
    fastst.save_file(saved_arrays(100), tmp_path, max_shard_size=400, fsync=True)
    monkeypatch.undo()
    assert loads_as(tmp_path) == "new"
    flushed_directory = [k for k, step in enumerate(log) if step == ("fsync", str(tmp_path))]
    renames = [k for k, step in enumerate(log) if step[0] == "replace"]
    shards = [k for k in renames if log[k][1] != INDEX]
    index_renames = [k for k in renames if log[k][1] == INDEX]
    assert len(index_renames) == 2, "an index naming the backups, then the new index"
    backup_index, index = index_renames
    links = [k for k, step in enumerate(log) if step[0] == "link"]
    assert len(links) == len(shards) == 6
    for k in shards:   # a new file's bytes are on disk before it is renamed into place
        temporary = f".{log[k][1]}."
        assert any(step[0] == "fsync" and os.path.basename(step[1]).startswith(temporary)
                   for step in log[:k])
    # the backups, and the index naming them, before any old shard's name is taken
    assert max(links) < backup_index < min(shards)
    assert any(backup_index < k < min(shards) for k in flushed_directory)
    # the new shards before the index that names them; the index itself
    assert any(max(shards) < k < index for k in flushed_directory)
    assert any(k > index for k in flushed_directory)


@pytest.mark.parametrize("size", [400, 800, "1GB"])
def test_a_re_saved_checkpoint_keeps_the_mode_of_the_one_it_replaces(tmp_path, size):
    fastst.save_file(saved_arrays(0), tmp_path, max_shard_size=400)
    for name in os.listdir(tmp_path):
        os.chmod(tmp_path / name, 0o600)
    fastst.save_file(saved_arrays(100), tmp_path, max_shard_size=size)
    assert loads_as(tmp_path) == "new"
    assert {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)
            for name in os.listdir(tmp_path)} == dict.fromkeys(os.listdir(tmp_path), 0o600)


def test_a_new_checkpoint_takes_the_mode_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        fastst.save_file(saved_arrays(0), tmp_path, max_shard_size=400)
    finally:
        os.umask(old)
    assert {stat.S_IMODE(os.stat(tmp_path / name).st_mode)
            for name in os.listdir(tmp_path)} == {0o640}


def test_a_symlink_in_a_checkpoint_is_replaced_not_written_through(tmp_path):
    cache = tmp_path / "cache"
    fastst.save_file(saved_arrays(0), cache, max_shard_size=400)
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    for name in os.listdir(cache):
        (directory / name).symlink_to(cache / name)
    fastst.save_file(saved_arrays(100), directory, max_shard_size=400)
    assert loads_as(cache) == "old" and loads_as(directory) == "new"
    assert not any((directory / name).is_symlink() for name in os.listdir(directory))


# ---------------------------------------------------------------------------
# fastst inspect
# ---------------------------------------------------------------------------

def test_inspect_reports_a_checkpoint(checkpoint, capsys):
    from fastst import cli

    directory, tensors = checkpoint
    assert cli.main(["inspect", str(directory)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"checkpoint: {directory}", f"index: {directory / INDEX}"]
    assert lines[5].split() == ["layer.0", "F32", "[100]", "400", "400", "B", shard_names(3)[0]]
    assert "tensors      6" in lines and "total bytes  2400 (2.3 KiB)" in lines
    assert lines[-1].split() == ["total_size", "2400"]
    assert cli.main(["inspect", "--json", str(directory / INDEX)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in report["tensors"]] == list(tensors)
    assert [t["shard"] for t in report["tensors"]] == [n for n in shard_names(3) for _ in (0, 1)]
    assert [s["file"] for s in report["shards"]] == shard_names(3)
    assert report["file_size"] == sum(os.stat(directory / n).st_size for n in shard_names(3))


def test_inspect_lists_shards_in_file_order_whatever_the_index_order(tmp_path, capsys):
    """As the hub writes them, an index lists its tensors by name, so that a shard
    comes up first for its first name ('layer.10' before 'layer.2'): inspect lists the
    shards, and their tensors, in the order of the files' names, numbers by value."""
    from fastst import cli

    names = [f"part-{k}-of-11.safetensors" for k in range(1, 12)]
    for k, name in enumerate(names):
        fastst.save_file({f"layer.{k}": np.full(4, k, np.float32)}, tmp_path / name)
    write_index(tmp_path, {f"layer.{k}": names[k] for k in sorted(range(11), key=str)})
    assert cli.main(["inspect", "--json", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [shard["file"] for shard in report["shards"]] == names
    assert [tensor["name"] for tensor in report["tensors"]] == [f"layer.{k}" for k in range(11)]


def test_inspect_names_the_index_and_tensor_of_a_broken_checkpoint(checkpoint, capsys):
    from fastst import cli

    directory, _ = checkpoint
    os.unlink(directory / shard_names(3)[2])
    assert cli.main(["inspect", str(directory)]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {directory}: {directory / INDEX}: tensor 'layer.4': shard "
        f"'{shard_names(3)[2]}' is missing\n")


def test_inspect_of_a_directory_with_one_file_reports_that_file(tmp_path, capsys):
    from fastst import cli

    fastst.save_file({"w": np.zeros(2)}, tmp_path / "model.safetensors")
    assert cli.main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"file: {tmp_path / 'model.safetensors'}\n")


@pytest.mark.parametrize("parallel_below", [0, 1 << 40])
def test_copies_are_the_same_whether_shards_are_read_in_turn_or_at_once(
        checkpoint, monkeypatch, parallel_below):
    import fastst.checkpoint

    monkeypatch.setattr(fastst.checkpoint, "PARALLEL_BELOW", parallel_below)
    directory, tensors = checkpoint
    copies = fastst.load_file(directory, copy=True)
    assert list(copies) == list(tensors)
    assert all(np.array_equal(copies[name], tensors[name]) for name in tensors)


def test_relative_names_save_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fastst.save_file(arrays(), "weights.safetensors", max_shard_size=800)
    assert os.path.isfile("weights.safetensors.index.json")
    fastst.save_file(arrays(), "weights.safetensors", max_shard_size="1GB")
    assert sorted(os.listdir(".")) == ["weights.safetensors"]
    assert list(fastst.load_file(".")) == list(arrays())


def test_one_file_and_a_checkpoint_give_handles_of_one_protocol(checkpoint):
    from fastst._handles.protocols import ArrayHandle, Handle

    directory, tensors = checkpoint
    single = directory / "single.safetensors"
    fastst.save_file(tensors, single)
    for path in (directory / INDEX, single):
        with fastst.safe_open(path) as f:
            assert isinstance(f, ArrayHandle) and isinstance(f, Handle)
            assert f.read_rows("layer.3", 0, 2).tolist() == tensors["layer.3"][:2].tolist()
    torch = pytest.importorskip("torch")
    with fastst.safe_open(directory, framework="pt") as f:
        assert isinstance(f, Handle) and not isinstance(f, ArrayHandle)
        assert isinstance(f.get_tensor("layer.0"), torch.Tensor)


# ---------------------------------------------------------------------------
# Pickling and gathers
# ---------------------------------------------------------------------------

def shard_contents(handle):
    """What a worker reads through a handle it was sent."""
    return {"tensors": {name: np.asarray(handle.get_tensor(name)) for name in handle.keys()},
            "gathered": np.asarray(handle.gather("layer.4", [5, -1, 5, 0])),
            "backend": handle.backend, "source": handle.source}


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_checkpoint_handle_pickles_by_opening_the_checkpoint_again(
        checkpoint, backend, framework):
    if framework == "pt":
        pytest.importorskip("torch")
    directory, tensors = checkpoint
    with fastst.safe_open(directory, framework, backend=backend) as f:
        f.get_tensor("layer.0")            # one shard opened, the others not
        copy = pickle.loads(pickle.dumps(f))
    with copy:
        assert type(copy) is type(f) and copy.backend == backend
        assert copy.source == str(directory / INDEX)
        for name, array in tensors.items():
            np.testing.assert_array_equal(np.asarray(copy.get_tensor(name)), array)


def test_a_checkpoint_handle_pickled_in_one_directory_opens_in_another(
        checkpoint, tmp_path, monkeypatch):
    directory, tensors = checkpoint
    monkeypatch.chdir(directory)
    with fastst.safe_open(INDEX) as f:
        pickled = pickle.dumps(f)
    monkeypatch.chdir(tmp_path.parent)
    with pickle.loads(pickled) as copy:
        np.testing.assert_array_equal(copy["layer.5"], tensors["layer.5"])


def test_a_checkpoint_handle_passes_to_a_spawned_pool(checkpoint):
    directory, tensors = checkpoint
    with fastst.safe_open(directory, backend="pread") as f, \
            multiprocessing.get_context("spawn").Pool(1) as pool:
        result = pool.apply_async(shard_contents, (f,)).get(timeout=120)
    assert result["backend"] == "pread" and result["source"] == str(directory / INDEX)
    for name, array in tensors.items():
        np.testing.assert_array_equal(result["tensors"][name], array)
    np.testing.assert_array_equal(result["gathered"], tensors["layer.4"][[5, -1, 5, 0]])


def rewrite(path, array):
    fastst.save_file({path.name.split(".")[0]: array}, path)


def test_a_shard_changed_after_pickling_is_refused_when_opened(checkpoint):
    directory, tensors = checkpoint
    with fastst.safe_open(directory) as f:
        f.get_tensor("layer.0")
        pickled = pickle.dumps(f)
    shard = directory / shard_names(3)[2]
    fastst.save_file({"layer.4": tensors["layer.4"] + 1, "layer.5": tensors["layer.5"]}, shard)
    with pickle.loads(pickled) as copy:
        np.testing.assert_array_equal(copy["layer.0"], tensors["layer.0"])
        with pytest.raises(fastst.SafetensorError, match=r"shard 'model-00003-of-00003"
                                                         r".safetensors' changed since"):
            copy.get_tensor("layer.4")


def test_a_shard_replaced_after_opening_is_pickled_as_the_handle_reads_it(checkpoint):
    """The handle reads the shard it opened: an unpickled copy must not read the
    file that replaced it."""
    directory, tensors = checkpoint
    with fastst.safe_open(directory) as f:
        f.get_tensor("layer.0")
        shard = directory / shard_names(3)[0]
        fastst.save_file({"layer.0": tensors["layer.0"] + 1, "layer.1": tensors["layer.1"]},
                         shard)
        pickled = pickle.dumps(f)
    with pickle.loads(pickled) as copy, pytest.raises(fastst.SafetensorError,
                                                      match="changed since"):
        copy.get_tensor("layer.0")


def test_an_index_changed_after_pickling_is_refused(checkpoint):
    directory, _ = checkpoint
    with fastst.safe_open(directory) as f:
        pickled = pickle.dumps(f)
    index = directory / INDEX
    index.write_text(index.read_text() + " ")
    with pytest.raises(fastst.SafetensorError, match="index changed since the handle was "
                                                     "pickled"):
        pickle.loads(pickled)


def test_closed_and_hand_made_checkpoint_handles_refuse_to_pickle(checkpoint):
    from fastst.checkpoint import NumpyShardedHandle

    directory, _ = checkpoint
    f = fastst.safe_open(directory)
    f.close()
    with pytest.raises(fastst.SafetensorError, match="closed"):
        pickle.dumps(f)
    hand_made = NumpyShardedHandle(read_index(directory / INDEX), fastst.safe_open, "mmap")
    with pytest.raises(fastst.SafetensorError, match="only a checkpoint from safe_open"):
        pickle.dumps(hand_made)


def test_a_directory_with_one_file_pickles_as_that_file(tmp_path):
    fastst.save_file(arrays(2), tmp_path / "model.safetensors")
    with fastst.safe_open(tmp_path) as f:
        copy = pickle.loads(pickle.dumps(f))
    with copy:
        assert isinstance(copy, fastst.NumpyHandle)
        np.testing.assert_array_equal(copy["layer.1"], arrays(2)["layer.1"])


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_gathers_read_rows_from_each_tensors_shard(checkpoint, backend):
    directory, tensors = checkpoint
    rows = np.array([3, 0, -1, 3], dtype=np.int16)
    with fastst.safe_open(directory, backend=backend) as f:
        for name, array in tensors.items():
            np.testing.assert_array_equal(f.gather(name, rows), array[rows])
        out = np.empty(4, np.float32)
        assert f.gather("layer.2", rows, out) is out
        np.testing.assert_array_equal(out, tensors["layer.2"][rows])
        with pytest.raises(fastst.SafetensorIndexError):
            f.gather("layer.2", [100])
        with pytest.raises(fastst.TensorNotFoundError):
            f.gather("nope", [0])
    torch = pytest.importorskip("torch")
    with fastst.safe_open(directory, "pt", backend=backend) as f:
        gathered = f.gather("layer.1", rows)
        assert isinstance(gathered, torch.Tensor)
        assert gathered.tolist() == tensors["layer.1"][rows].tolist()


def test_rows_span_tensors_of_several_shards_in_spawned_loaders(checkpoint):
    from fastst.data import Rows

    directory, tensors = checkpoint
    with Rows(directory, ["layer.1", "layer.5"], backend="pread") as rows:
        restored = pickle.loads(pickle.dumps(rows))
        features, labels = restored.gather([7, 2])
        np.testing.assert_array_equal(features, tensors["layer.1"][[7, 2]])
        np.testing.assert_array_equal(labels, tensors["layer.5"][[7, 2]])
        restored.close()
