"""`fastst convert`: summary table, exit codes, --verify, --max-shard-size, --key."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

import fastst
from fastst.cli import main

torch = pytest.importorskip("torch")
import fastst.torch as fastst_torch  # noqa: E402


@pytest.fixture
def checkpoint(tmp_path):
    state = {"a": torch.randn(8, 8), "b": torch.randn(8), "c": torch.arange(16).reshape(4, 4)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    return path, state


def test_convert_prints_a_summary_and_exits_0(tmp_path, checkpoint, capsys):
    src, state = checkpoint
    assert main(["convert", str(src), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors" in out and "1 file(s), 3 tensors" in out
    loaded = fastst_torch.load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_convert_into_shards(tmp_path, checkpoint, capsys):
    src, state = checkpoint
    assert main(["convert", str(src), str(tmp_path / "model.safetensors"),
                 "--max-shard-size", "300"]) == 0
    assert "model-00001-of-00002.safetensors ... model.safetensors.index.json (3 files)" in \
        capsys.readouterr().out
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in state.values())
    for name, filename in index["weight_map"].items():
        assert torch.equal(fastst_torch.load_file(tmp_path / filename)[name], state[name])
    with fastst.safe_open(tmp_path / "model.safetensors.index.json") as checkpoint:
        assert sorted(checkpoint.keys()) == sorted(state)
    assert main(["verify", str(tmp_path)]) == 0


def test_refused_checkpoint_exits_1_and_writes_nothing(tmp_path, capsys):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "x": Evil()}, src)
    assert main(["convert", str(src), str(tmp_path / "out.safetensors")]) == 1
    assert "refusing the global 'posix.system'" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


def test_usage_errors_exit_2(tmp_path, checkpoint, capsys):
    src, _ = checkpoint
    assert main(["convert", str(src), "--max-shard-size", "lots"]) == 2
    assert main(["convert"]) == 2


def test_key_option(tmp_path, capsys):
    src = tmp_path / "nested.pt"
    torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 1}, src)
    assert main(["convert", str(src), str(tmp_path / "out.safetensors"),
                 "--key", "state_dict"]) == 0
    assert list(fastst.load_file(tmp_path / "out.safetensors")) == ["w"]


def test_convert_npz(tmp_path, capsys):
    import numpy as np
    np.savez(tmp_path / "arrays.npz", x=np.arange(5), y=np.eye(2))
    assert main(["convert", str(tmp_path / "arrays.npz"), "--verify"]) == 0
    loaded = fastst.load_file(tmp_path / "arrays.safetensors")
    assert np.array_equal(loaded["x"], np.arange(5)) and np.array_equal(loaded["y"], np.eye(2))
    assert main(["convert", str(tmp_path / "arrays.npz"), "--max-shard-size", "1MB"]) == 1
    assert "--max-shard-size is for torch checkpoints" in capsys.readouterr().err


def test_progress_bar_counts_bytes_on_a_terminal(tmp_path, capsys, monkeypatch):
    import fastst._io.progress
    monkeypatch.setattr(fastst._io.progress, "PROGRESS_MIN_BYTES", 0)
    np.save(tmp_path / "a.npy", np.arange(1000))
    assert main(["convert", str(tmp_path / "a.npy")]) == 0
    assert capsys.readouterr().err == ""        # no terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["convert", str(tmp_path / "a.npy"), str(tmp_path / "b.safetensors")]) == 0
    assert "verifying" in capsys.readouterr().err

def test_max_expansion_option(tmp_path, capsys):
    src = tmp_path / "expanded.pt"
    torch.save({"w": torch.arange(3000.0).expand(3000, 3000)}, src)     # 36 MB from 1.5 kB
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst)]) == 1
    error = capsys.readouterr().err
    assert f"{src}: converting it would write 36000" in error and "stride [0, 1]" in error
    assert "--max-expansion none" in error and not dst.exists()
    assert main(["convert", str(src), str(dst), "--max-expansion", "none"]) == 0
    assert torch.equal(fastst_torch.load_file(dst)["w"], torch.arange(3000.0).expand(3000, 3000))
    assert main(["convert", str(src), str(dst), "--max-expansion", "30000"]) == 0
    for bad in ("0", "-1", "nan", "inf", "lots"):
        assert main(["convert", str(src), str(dst), "--max-expansion", bad]) == 2
    assert "a positive number or 'none'" in capsys.readouterr().err


def test_a_folder_has_one_output_bound_for_all_its_checkpoints(tmp_path, capsys):
    """Each of these alone fits the 16 MiB a small input is allowed; together they
    do not (the allowance is the folder's, not each file's)."""
    folder = tmp_path / "model"
    folder.mkdir()
    for k in range(2):
        torch.save({"w": torch.zeros(1).expand(1500, 1500)}, folder / f"part{k}.bin")  # 9 MB
    assert main(["convert", str(folder / "part0.bin"), str(tmp_path / "alone.safetensors")]) == 0
    assert main(["convert", str(folder), str(tmp_path / "out")]) == 1
    assert f"{folder / 'part1.bin'}: converting it would write" in capsys.readouterr().err


def test_a_link_out_of_the_folder_exits_1(tmp_path, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    torch.save({"w": torch.ones(1)}, folder / "pytorch_model.bin")
    (tmp_path / "private_key.txt").write_text("PRIVATE")
    os.symlink(tmp_path / "private_key.txt", folder / "tokenizer.json")
    assert main(["convert", str(folder), str(tmp_path / "out"), "--no-progress"]) == 1
    assert f"{folder / 'tokenizer.json'}: a symbolic link to {tmp_path / 'private_key.txt'}, " \
           f"outside {folder}: refused" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_nothing_to_convert_exits_1_and_writes_nothing(tmp_path, capsys):
    empty, converted, out = tmp_path / "empty", tmp_path / "converted", tmp_path / "out"
    empty.mkdir()
    assert main(["convert", str(empty), str(out)]) == 1
    assert f"{empty}: nothing to convert: no torch checkpoint" in capsys.readouterr().err
    assert not out.exists()
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    fastst.save_file({"w": np.ones(3)}, converted / "model.safetensors")
    assert main(["convert", str(converted), str(out)]) == 1
    assert "holds 1 .safetensors file(s) already" in capsys.readouterr().err
    assert not out.exists()


def test_a_safetensors_file_is_already_converted(tmp_path, capsys):
    src = tmp_path / "weights.bin"     # the contents tell, not the name
    fastst.save_file({"w": np.ones(3)}, src)
    assert main(["convert", str(src), str(tmp_path / "out.safetensors")]) == 1
    assert f"{src}: already a safetensors file, nothing to convert" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture
def trainer(tmp_path):
    """A training checkpoint: the model's state dict, an optimizer's state, the epoch."""
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    adam.step()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)     # keeps no tensors
    path = tmp_path / "trainer.pt"
    torch.save({"model": model.state_dict(), "optimizer": adam.state_dict(),
                "sgd": sgd.state_dict(), "epoch": 3}, path)
    return path


def test_a_training_checkpoint_converted_whole_comes_with_a_hint_of_key(trainer, capsys):
    assert main(["convert", str(trainer)]) == 0
    captured = capsys.readouterr()
    assert "1 file(s), 8 tensors" in captured.out
    assert captured.err == (
        f"fastst: note: {trainer}: a training checkpoint: 'model' holds a state dict of 2 "
        f"tensors, 'optimizer' 6 tensors, 'sgd' no tensors, 'epoch' no tensors. It is written "
        f"as one tree whose tensors are named by their path ('model/weight', ...), which "
        f"fastst.load_state reads back whole; for the weights of 'model' alone, under their "
        f"own names, convert it with --key model\n")
    assert main(["convert", str(trainer), str(trainer.with_name("model.safetensors")),
                 "--key", "model"]) == 0
    assert capsys.readouterr().err == ""
    assert sorted(fastst.load_file(trainer.with_name("model.safetensors"))) == ["bias", "weight"]


def test_a_key_that_holds_no_tensors_is_named_with_what_it_holds(trainer, tmp_path, capsys):
    out = str(tmp_path / "out.safetensors")
    assert main(["convert", str(trainer), out, "--key", "optimizer"]) == 0   # nested: kept
    assert "1 file(s), 6 tensors" in capsys.readouterr().out
    assert main(["convert", str(trainer), out, "--key", "sgd"]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {trainer}: key 'sgd' holds no tensors: it is a dict {{'state': an "
        f"empty dict, 'param_groups': a list of 1}}. An optimizer's state holds tensors once "
        f"it has taken a step, and only for an optimizer that keeps some (SGD without "
        f"momentum keeps none)\n")
    assert main(["convert", str(trainer), out, "--key", "epoch"]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {trainer}: key 'epoch' holds an int (3), not tensors\n")
    torch.save({"epoch": 3, "losses": [0.5, 0.25]}, tmp_path / "none.pt")
    assert main(["convert", str(tmp_path / "none.pt"), out]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {tmp_path / 'none.pt'}: the checkpoint holds no tensors: it is a dict "
        f"{{'epoch': an int (3), 'losses': a list of 2}}\n")


def _save_npz(file):
    np.savez(file, w=np.ones(2))


def _save_npy(file):
    np.save(file, np.ones(2))


@pytest.mark.parametrize("save,kind", [
    (lambda file: torch.save({"w": torch.ones(2)}, file), "a PyTorch checkpoint (torch.save)"),
    (lambda file: torch.save({"w": torch.ones(2)}, file, _use_new_zipfile_serialization=False),
     "a PyTorch checkpoint (torch.save)"),
    (_save_npz, "a NumPy .npz archive"),
    (_save_npy, "a NumPy .npy file"),
], ids=["zip", "legacy", "npz", "npy"])
def test_inspect_and_verify_of_a_checkpoint_suggest_converting_it(tmp_path, capsys, save, kind):
    path = tmp_path / "model.bin"
    with open(path, "wb") as file:
        save(file)
    why = (f"{path}: not a safetensors file: it is {kind}: convert it with "
           f"`fastst convert {path}`")
    assert main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == f"fastst: error: {why}\n"
    assert main(["verify", str(path)]) == 1
    assert capsys.readouterr().out == f"{path}: FAILED\n  {why}\n"
    assert main(["verify", "--json", str(path)]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert report["files"][0]["errors"] == [{"tensor": None, "error": why[len(f"{path}: "):]}]
