"""Sharded checkpoints against the Hugging Face tools themselves, offline on the
CPU: fastst writes the files huggingface_hub writes, byte for byte; transformers
and huggingface_hub load what fastst writes; fastst loads what they write."""
from __future__ import annotations

import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"          # read when the libraries are imported
os.environ["TRANSFORMERS_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
hub = pytest.importorskip("huggingface_hub")
transformers = pytest.importorskip("transformers")

import fastst  # noqa: E402
import fastst.torch as ft  # noqa: E402

INDEX = "model.safetensors.index.json"


def files_of(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def same_files(ours, theirs):
    """Whether two save directories hold the same files with the same bytes. The
    reference writes several metadata keys in a random order: a file whose
    header holds several is compared as its header's JSON and its data bytes."""
    ours, theirs = files_of(ours), files_of(theirs)
    return list(ours) == list(theirs) and all(
        ours[name] == theirs[name] or _unordered(ours[name]) == _unordered(theirs[name])
        for name in ours)


def _unordered(data):
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    assert len(header["__metadata__"]) > 1
    return header, data[8 + length:]


def state_dict():
    generator = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(64, 8, generator=generator),
        "huge": torch.randn(1000, generator=generator),          # over the limits below
        "norm": torch.randn(8, generator=generator).to(torch.bfloat16),
        "empty": torch.zeros(0),
        "blocks.0.w": torch.randn(16, 8, generator=generator).t(),   # not contiguous
        "blocks.0.b": torch.arange(16, dtype=torch.int64),
        "also empty": torch.zeros(3, 0),
        "head": torch.randn(8, 4, generator=generator),
    }


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 40, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("max_shard_size", [600, 1000, "2KB", "1MB"])
def test_save_file_writes_the_files_of_save_torch_state_dict(tmp_path, max_shard_size):
    ours, theirs = tmp_path / "fastst", tmp_path / "hub"
    theirs.mkdir()
    ft.save_file(state_dict(), ours, metadata={"note": "x"}, max_shard_size=max_shard_size)
    hub.save_torch_state_dict(state_dict(), theirs, metadata={"note": "x"},
                              max_shard_size=max_shard_size)
    assert same_files(ours, theirs)
    assert (INDEX in os.listdir(ours)) == (max_shard_size != "1MB")


@pytest.mark.parametrize("max_shard_size", ["1KB", "1MB"])
def test_save_model_writes_the_files_of_save_torch_model(tmp_path, max_shard_size):
    torch.manual_seed(0)
    model = Tied()
    ours, theirs = tmp_path / "fastst", tmp_path / "hub"
    theirs.mkdir()
    ft.save_model(model, ours, max_shard_size=max_shard_size)
    hub.save_torch_model(model, theirs, max_shard_size=max_shard_size)
    assert same_files(ours, theirs)
    if max_shard_size == "1KB":
        metadata = json.loads((ours / INDEX).read_text())["metadata"]
        assert metadata == {"total_size": 1280 + 256 + 32, "head.weight": "embed.weight"}


def test_fastst_reads_what_huggingface_hub_writes(tmp_path):
    tensors = state_dict()
    hub.save_torch_state_dict(tensors, tmp_path, max_shard_size=1000)
    assert INDEX in os.listdir(tmp_path)
    loaded = ft.load_file(tmp_path)
    assert sorted(loaded) == sorted(tensors)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in tensors.items())
    with fastst.safe_open(tmp_path, framework="pt") as f:
        assert f.metadata() == json.loads((tmp_path / INDEX).read_text())["metadata"]
        assert torch.equal(f.get_slice("embed")[3:5], tensors["embed"][3:5])

    torch.manual_seed(1)
    model = Tied()
    (tmp_path / "model").mkdir()
    hub.save_torch_model(model, tmp_path / "model", max_shard_size="1KB")
    torch.manual_seed(2)
    other = Tied()
    assert ft.load_model(other, tmp_path / "model") == (set(), [])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))


def test_huggingface_hub_loads_what_fastst_writes(tmp_path):
    torch.manual_seed(3)
    model = Tied()
    ft.save_model(model, tmp_path, max_shard_size="1KB")
    torch.manual_seed(4)
    other = Tied()
    result = hub.load_torch_model(other, tmp_path)
    # the tied name is filled through the name it shares memory with
    assert result.missing_keys == ["head.weight"] and result.unexpected_keys == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 other.state_dict().values()))


@pytest.fixture(scope="module")
def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                   n_positions=64)


def outputs(model):
    tokens = torch.arange(12).reshape(2, 6) % 100
    with torch.no_grad():
        return model.eval()(tokens)[0]


def test_transformers_loads_what_fastst_writes(tmp_path, gpt2_config):
    torch.manual_seed(5)
    model = transformers.GPT2Model(gpt2_config)
    ft.save_model(model, tmp_path / "ours", max_shard_size="20KB")
    model.config.save_pretrained(tmp_path / "ours")
    assert len([name for name in os.listdir(tmp_path / "ours") if name.startswith("model-")]) > 2
    loaded = transformers.AutoModel.from_pretrained(tmp_path / "ours")
    assert torch.equal(outputs(loaded), outputs(model))

    # transformers' own save: the same shards, the same weight map
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    ours, theirs = files_of(tmp_path / "ours"), files_of(tmp_path / "theirs")
    shards = [name for name in theirs if name.startswith("model-")]
    assert shards == [name for name in ours if name.startswith("model-")]
    assert all(ours[name] == theirs[name] for name in shards)
    assert (json.loads(ours[INDEX])["weight_map"] == json.loads(theirs[INDEX])["weight_map"])


def test_transformers_loads_a_tied_model_that_fastst_writes(tmp_path, gpt2_config):
    torch.manual_seed(6)
    model = transformers.GPT2LMHeadModel(gpt2_config)
    ft.save_model(model, tmp_path, max_shard_size="20KB")
    model.config.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(outputs(loaded), outputs(model))


def test_fastst_loads_what_transformers_writes(tmp_path, gpt2_config):
    torch.manual_seed(7)
    model = transformers.GPT2LMHeadModel(gpt2_config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert INDEX in os.listdir(tmp_path)
    torch.manual_seed(8)
    other = transformers.GPT2LMHeadModel(gpt2_config)
    assert ft.load_model(other, tmp_path) == (set(), [])
    assert torch.equal(outputs(other), outputs(model))
    with fastst.safe_open(tmp_path) as f:
        assert f.metadata()["total_parameters"] == model.num_parameters()
