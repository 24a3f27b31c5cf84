"""Loading onto many ranks: each torch.distributed rank reads only the bytes it owns
(tensor-parallel slices), or a share of the file that the ranks then exchange (split
reads); the plans say which bytes, and the bytes read are counted through the reader
(rchar for local files, the server's count for URLs). Ranks run as subprocesses in a
gloo group on 127.0.0.1, bounded in time (tests/ranks.py)."""
import re

import ml_dtypes
import numpy as np
import pytest

import fastst
import fastst.distributed as fd
from fastst.writer import WriteSpec, serialize
from ranks import counted, run_ranks
from servers import http_store  # noqa: F401

torch = pytest.importorskip("torch")

import fastst.torch as ft  # noqa: E402

# tensor -> the dimension tensor-parallel ranks split (the others whole)
DIMS = {"embed": 0, "up": 0, "o": 1, "narrow": 1, "i8": 1, "f8": -1, "flags": 0,
        "empty": 0, "i64": -1, "f4": 0, "f6": 0}


def model_bytes(seed=0) -> bytes:
    """A file of every kind of tensor a model has, with uneven, empty, 0-d, sub-byte
    and packed ones, and rows wide enough that column blocks are read alone."""
    rng = np.random.default_rng(seed)

    def raw(count):
        return rng.integers(0, 256, count, dtype=np.uint8)

    arrays = {
        "embed": raw(64 * 4096 * 2).view(ml_dtypes.bfloat16).reshape(64, 4096),
        "up": rng.standard_normal((37, 2048)).astype(np.float16),
        "o": rng.standard_normal((16, 8192)).astype(np.float32),
        "narrow": rng.standard_normal((16, 24)).astype(np.float32),
        "norm": rng.standard_normal(4096).astype(np.float32),
        "i8": rng.integers(-100, 100, (7, 5)).astype(np.int8),
        "f8": raw(8 * 4096).view(ml_dtypes.float8_e4m3fn).reshape(8, 4096),
        "flags": rng.integers(0, 2, (10, 3)).astype(np.bool_),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.float32),
        "i64": rng.integers(-2**40, 2**40, (9, 1024)),
    }
    specs = [fastst.writer.spec_of_array(name, array) for name, array in arrays.items()]
    specs += [WriteSpec("f4", "F4", (8, 4096), raw(8 * 2048)),
              WriteSpec("f6", "F6_E2M3", (4, 8), raw(4 * 6))]
    return serialize(specs)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    path = folder / "model.safetensors"
    path.write_bytes(model_bytes())
    checkpoint = folder / "checkpoint"
    numpy_only = {name: array for name, array in fastst.load_file(path).items()
                  if name not in ("f4", "f6")}
    fastst.save_file(numpy_only, checkpoint, max_shard_size=300_000)
    assert len(list(checkpoint.glob("*.safetensors"))) >= 3
    return path, checkpoint


def comparable(tensor):
    """A tensor's bytes (random bytes make NaNs, which equal nothing)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got, want):
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert got[name].shape == want[name].shape, name
        assert torch.equal(comparable(got[name]), comparable(want[name])), name


def expected_slices(full, world, rank, split):
    """What rank `rank` gets: each tensor's torch.chunk (or tensor_split) part."""
    parts = {}
    for name, tensor in full.items():
        dim = DIMS.get(name)
        if dim is None:
            parts[name] = tensor
            continue
        pieces = (tensor.chunk(world, dim) if split == "chunk"
                  else tensor.tensor_split(world, dim))
        if rank < len(pieces):
            parts[name] = pieces[rank]
        else:   # torch.chunk gave fewer parts than ranks: an empty slice
            parts[name] = tensor.narrow(dim, tensor.shape[dim], 0)
    return parts


def test_pread_reads_only_the_column_block_an_index_selects(tmp_path):
    rows, width = 64, 4096
    full = np.arange(rows * width, dtype=np.float32).reshape(rows, width)
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"w": full}, path)
    with fastst.safe_open(path, backend="pread") as f:
        part = f.get_slice("w")
        block, read = counted(lambda: part[:, 1024:2048])
        np.testing.assert_array_equal(block, full[:, 1024:2048])
        assert block.nbytes <= read < block.nbytes + 1024     # not the rows: 4x as many
        stepped, read = counted(lambda: part[3:40:5, 2048:4000:3])
        np.testing.assert_array_equal(stepped, full[3:40:5, 2048:4000:3])
        assert read < 40 * (4000 - 2048) * 4


def test_a_url_serves_only_the_column_block_an_index_selects(http_store):
    full = np.arange(256 * 4096, dtype=np.float32).reshape(256, 4096)
    http_store.be_honest()
    http_store.objects["/wide.safetensors"] = fastst.save({"w": full})
    with fastst.safe_open(f"{http_store.url}/wide.safetensors") as f:
        http_store.reset_counts()
        np.testing.assert_array_equal(f.get_slice("w")[:, :1024], full[:, :1024])
    block, head = 256 * 1024 * 4, 64 << 10     # the first request brought the head
    assert block - head <= http_store.bytes_sent <= block      # not the rows: 4x as many


def test_a_verifying_handle_checks_a_block_before_giving_it(tmp_path):
    path = tmp_path / "checked.safetensors"
    fastst.save_file({"w": np.ones((4, 8192), np.float32)}, path, checksum="xxh3_64")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1     # a byte of the last row, outside the block asked for
    path.write_bytes(bytes(data))
    with fastst.safe_open(path, backend="pread", verify=True) as f:
        with pytest.raises(fastst.SafetensorError, match="'w'.*xxh3_64"):
            f.get_slice("w")[:, :1024]


# --- plans -------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["chunk", "tensor_split"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_tensor_parallel_plan_gives_each_rank_torchs_part(model, world, split):
    path, _ = model
    plan = fd.plan_tensor_parallel(path, DIMS, world, split=split)
    full = ft.load_file(path)
    assert sorted(plan.reads) == list(range(world))
    for rank in range(world):
        want = expected_slices(full, world, rank, split)
        boxes = {read.tensor: read.box for read in plan.reads[rank]}
        assert list(boxes) == list(full)
        for name, box in boxes.items():
            assert tuple(stop - start for start, stop in box) == tuple(want[name].shape), name


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_a_split_plan_reads_every_byte_once_in_equal_shares(model, world):
    path, checkpoint = model
    for target in (path, checkpoint):
        plan = fd.plan_split(target, world)
        covered = sorted((int(read.offsets[0]), read.length, read.file)
                         for reads in plan.reads.values() for read in reads)
        data = sum(read.nbytes for reads in plan.reads.values() for read in reads)
        assert data + plan.header_bytes == plan.file_bytes      # every tensor byte once
        by_file = {}
        for offset, length, file in covered:
            by_file.setdefault(file, []).append((offset, length))
        for pieces in by_file.values():                          # and no byte twice
            assert all(a + n <= b for (a, n), (b, _) in zip(pieces, pieces[1:]))
        shares = [plan.bytes_of(rank) for rank in range(world)]
        assert max(shares) - min(shares) <= 2 * fd.STREAM_ALIGN * len(by_file) + 1
        assert plan.ratio == pytest.approx(1 + (world - 1) * plan.header_bytes
                                           / plan.file_bytes)


def test_plans_refuse_what_cannot_be_split(model, tmp_path):
    path, _ = model
    for dims, message in [({"embed": 2}, "has no dimension 2"),
                          ({"embed": "0"}, "has no dimension '0'"),
                          ({"f4": 1}, "stored packed"), ({"f6": -1}, "stored packed"),
                          (["embed"], "dims must be a mapping")]:
        with pytest.raises(fastst.SafetensorError, match=re.escape(message)):
            fd.plan_tensor_parallel(path, dims, 2)
    for world in (0, -1, 1.5, True):
        with pytest.raises(fastst.SafetensorError, match="world_size"):
            fd.plan_split(path, world)
    with pytest.raises(fastst.SafetensorError, match="split must be"):
        fd.plan_tensor_parallel(path, DIMS, 2, split="even")


def test_the_loaders_need_an_initialised_group(model):
    path, _ = model
    with pytest.raises(fastst.SafetensorError, match="not initialised"):
        fd.load_split(path)
    with pytest.raises(fastst.SafetensorError, match="not initialised"):
        fd.load_tensor_parallel(path, DIMS)


# --- ranks -------------------------------------------------------------------------------

def served_bytes(server, path):
    """The bytes of `path` the server sent, by the ranges asked."""
    total = 0
    for method, asked_path, asked in server.requests:
        if method == "GET" and asked_path == path:
            first, last = map(int, re.match(r"bytes=(\d+)-(\d+)", asked).groups())
            total += last - first + 1
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_get_what_a_full_load_gives_reading_only_their_bytes(model, world, http_store):
    path, checkpoint = model
    data = path.read_bytes()
    http_store.be_honest()
    http_store.objects.update({"/tp.safetensors": data, "/split.safetensors": data})
    http_store.reset_counts()
    dims = {name: dim for name, dim in DIMS.items()}
    loads = [["tp", str(path), {"dims": dims, "backend": "pread"}],
             ["tp", str(path), {"dims": dims, "split": "tensor_split"}],
             ["split", str(path), {"backend": "pread"}],
             ["split", str(path), {}],
             ["tp", str(checkpoint), {"dims": dims, "backend": "pread"}],
             ["split", str(checkpoint), {"backend": "pread"}],
             ["tp", f"{http_store.url}/tp.safetensors", {"dims": dims}],
             ["split", f"{http_store.url}/split.safetensors", {}]]
    ranks = run_ranks(world, "loads", {"loads": loads})
    full, full_checkpoint = ft.load_file(path), ft.load_file(checkpoint)
    for rank, result in enumerate(ranks):
        tp, tp_split, split, split_mapped, tp_ckpt, split_ckpt, tp_url, split_url = \
            [load["tensors"] for load in result["results"]]
        for got in (tp, tp_url):
            assert_same(got, expected_slices(full, world, rank, "chunk"))
        assert_same(tp_split, expected_slices(full, world, rank, "tensor_split"))
        assert_same(tp_ckpt, expected_slices(full_checkpoint, world, rank, "chunk"))
        for got in (split, split_mapped, split_url):
            assert_same(got, full)
        assert_same(split_ckpt, full_checkpoint)
    # the bytes read, counted by the kernel (pread) and by the server (URLs)
    read = [sum(result["results"][k]["read"] for result in ranks) for k in range(6)]
    for k, plan in [(0, fd.plan_tensor_parallel(path, DIMS, world)),
                    (2, fd.plan_split(path, world)),
                    (4, fd.plan_tensor_parallel(checkpoint, DIMS, world)),
                    (5, fd.plan_split(checkpoint, world))]:
        assert plan.total_bytes <= read[k] <= plan.total_bytes + world * 1024, k
    assert read[2] <= len(data) + world * 1024           # split reads: the file once
    assert read[0] <= 1.2 * len(data)                    # slices, and the small whole ones
    head = 64 << 10    # a URL's first request reads ahead
    served = {name: served_bytes(http_store, f"/{name}.safetensors") for name in ("tp", "split")}
    assert served["split"] <= len(data) + world * head
    # runs 4 KiB apart are one request for a URL: its plan says so
    tp_plan = fd.plan_tensor_parallel(f"{http_store.url}/tp.safetensors", DIMS, world)
    assert served["tp"] <= tp_plan.total_bytes + world * head


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_cannot_read_makes_every_rank_raise(model, tmp_path, world):
    path, _ = model
    other = tmp_path / "other.safetensors"
    fastst.save_file({"w": np.zeros(3)}, other)
    missing = str(tmp_path / "missing.safetensors")
    scenarios = [{"mode": "tp", "bad_target": missing}, {"mode": "split", "bad_target": missing},
                 {"mode": "split", "bad_target": str(other)},
                 {"mode": "tp", "bad_target": str(other)}]
    ranks = run_ranks(world, "failing", {
        "target": str(path), "failing": world - 1, "dims": DIMS,
        "scenarios": [{**scenario, "timeout": 30} for scenario in scenarios]})
    for k, scenario in enumerate(scenarios):
        outcomes = [result["outcomes"][k] for result in ranks]
        assert [outcome["error"] for outcome in outcomes] == ["SafetensorError"] * world
        messages = {outcome["message"] for outcome in outcomes}
        if scenario["bad_target"] == missing:
            assert len(messages) == 1, messages     # the same error on every rank
            (message,) = messages
            assert f"rank {world - 1} of {world} could not read {missing}" in message
            assert "FileNotFoundError" in message
        else:
            assert all("the ranks read different files" in message for message in messages)


def test_a_rank_that_stalls_makes_the_others_raise_within_the_timeout(model):
    path, _ = model
    stall = {"mode": "split", "bad_target": str(path), "sleep": 5, "timeout": 2}
    ranks = run_ranks(2, "failing", {"target": str(path), "failing": 1, "dims": DIMS,
                                     "scenarios": [stall], "group_timeout": 60}, timeout=90)
    (waiting,) = ranks[0]["outcomes"]
    assert waiting["error"] == "SafetensorError"
    assert "did not end within 2 s" in waiting["message"] and "rank 0 of 2" in waiting["message"]
    assert waiting["seconds"] < 15


# (mode, where the rank is killed, at which of its calls there)
KILLINGS = [("split", "_read_part", 1), ("tp", "_tensor_parallel_reads", 1),
            ("split", "_agree", 1), ("split", "_Group.run", 3)]   # the second round


@pytest.mark.parametrize("mode, at, calls", KILLINGS)
def test_a_rank_killed_mid_load_makes_every_other_rank_raise_naming_it(model, mode, at, calls):
    path, _ = model
    world, killed, timeout = 3, 1, 10
    ranks = run_ranks(world, "killed", {"target": str(path), "killed": killed, "at": at,
                                        "calls": calls, "mode": mode, "dims": DIMS,
                                        "round_bytes": 64 << 10, "timeout": timeout,
                                        "group_timeout": 60}, timeout=90, killed=killed)
    for rank, outcome in enumerate(ranks):
        if rank == killed:
            continue
        assert outcome["error"] == "SafetensorError", outcome
        assert re.search(rf"^{re.escape(str(path))}: rank {rank} of {world}: .* failed: the "
                         rf"connection to ranks? ([0-9, ]*){killed}\b.* of {world} closed",
                         outcome["message"]), outcome["message"]
        assert outcome["seconds"] < timeout + 5

