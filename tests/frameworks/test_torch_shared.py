"""fastst.torch's helpers for tensors that share memory, the names libraries
import from safetensors.torch: the same results as the reference's on the same
state dicts, and save_model's metadata as the reference writes it."""
from __future__ import annotations

import json
import struct

import pytest

torch = pytest.importorskip("torch")
reference = pytest.importorskip("safetensors.torch")

import fastst  # noqa: E402
import fastst.torch as ft  # noqa: E402


def state_dicts():
    base = torch.arange(24, dtype=torch.float32)
    grid = torch.zeros(4, 6)
    tied = torch.nn.Linear(3, 3).weight
    return {
        "tied": {"embed": tied, "head": tied, "bias": torch.zeros(3)},
        "views": {"a": base, "b": base.view(4, 6), "c": base[:6].view(2, 3)},
        "slices": {"a": base, "b": base[:1], "c": base[4:8], "d": base[6:12], "e": base[20:]},
        "disjoint slices": {"b": base[:12], "c": base[12:]},
        "partial slice": {"only": base[3:9]},
        "nested spans": {"a": base, "b": base[4:8], "c": base[8:12]},
        "non-contiguous": {"grid": grid, "column": grid[:, 1], "every other": base[::2],
                           "strided": base[1::4]},
        "transposed": {"grid": grid, "t": grid.t(), "rows": grid[::2]},
        "expanded": {"e": torch.zeros(3, 1).expand(3, 4)},
        "empty": {"empty": torch.zeros(0), "also": torch.zeros(2, 0), "x": torch.ones(2)},
        "meta": {"m": torch.zeros(3, device="meta"), "n": torch.zeros(3, device="meta"),
                 "real": torch.ones(3)},
        "dtypes": {"bf": torch.zeros(8, dtype=torch.bfloat16),
                   "u16": torch.zeros(4, dtype=torch.uint16),
                   "as_int": torch.zeros(8, dtype=torch.bfloat16).view(torch.int16)},
    }


STATE_DICTS = state_dicts()


def outcome(function, *args, **kwargs):
    """What a call gives: its value, or the class of the error it raises."""
    try:
        return "value", function(*args, **kwargs)
    except Exception as error:   # the reference's helpers raise whatever torch raises
        return "error", type(error)


@pytest.mark.parametrize("case", list(STATE_DICTS))
def test_per_tensor_helpers_match_the_reference(case):
    for name, tensor in STATE_DICTS[case].items():
        for helper in ("storage_ptr", "storage_size", "_is_complete"):
            ours = outcome(getattr(ft, helper), tensor)
            assert ours == outcome(getattr(reference, helper), tensor), (case, name, helper)
        theirs = outcome(reference._end_ptr, tensor)
        ours = outcome(ft._end_ptr, tensor)
        if theirs[0] == "value":
            assert ours == theirs, (case, name)
        else:   # the reference cannot view it flat: fastst still answers, from the strides
            last = tensor[tuple(size - 1 for size in tensor.shape)]
            assert ours == ("value", last.data_ptr() + tensor.element_size())


@pytest.mark.parametrize("case", list(STATE_DICTS))
def test_grouping_helpers_match_the_reference(case):
    state_dict = STATE_DICTS[case]
    theirs = outcome(reference._find_shared_tensors, state_dict)
    if theirs[0] == "error":   # the reference's _end_ptr fails on them: see the test below
        return
    assert outcome(ft._find_shared_tensors, state_dict) == theirs
    groups = [set(group) for group in theirs[1]]
    assert (ft._filter_shared_not_shared([set(g) for g in groups], state_dict)
            == reference._filter_shared_not_shared([set(g) for g in groups], state_dict))
    for kwargs in ({}, {"preferred_names": ["b", "head", "c"]}, {"discard_names": ["a", "embed"]},
                   {"preferred_names": ["d"], "discard_names": ["a"]}):
        theirs = outcome(reference._remove_duplicate_names, state_dict, **kwargs)
        ours = outcome(ft._remove_duplicate_names, state_dict, **kwargs)
        assert ours == theirs, (case, kwargs)
        assert type(ours[1]) is type(theirs[1])


def test_the_cases_cover_what_they_name():
    groups = ft._find_shared_tensors(STATE_DICTS["nested spans"])
    assert groups == [{"a", "b"}, {"c"}]      # a run closes where the previous tensor ends
    transposed = STATE_DICTS["transposed"]
    assert outcome(reference._find_shared_tensors, transposed)[0] == "error"
    assert ft._find_shared_tensors(transposed) == [{"grid", "rows", "t"}]
    assert ft._remove_duplicate_names(transposed) == {"grid": ["rows", "t"]}
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        ft._remove_duplicate_names(STATE_DICTS["partial slice"])
    assert ft._remove_duplicate_names(STATE_DICTS["tied"]) == {"embed": ["head"]}


def split(path):
    """A file's header, parsed, and its tensor bytes."""
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + size]), data[8 + size:]


def test_save_model_with_one_dropped_name_writes_the_references_bytes(tmp_path):
    metadata = {}
    ft.save_model(Tied(tie_alias=False), tmp_path / "ours.safetensors", metadata=metadata)
    reference.save_model(Tied(tie_alias=False), str(tmp_path / "theirs.safetensors"))
    assert metadata == {"head.weight": "embed.weight"}
    assert ((tmp_path / "ours.safetensors").read_bytes()
            == (tmp_path / "theirs.safetensors").read_bytes())


class Tied(torch.nn.Module):
    def __init__(self, tie_alias=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.other = torch.nn.Linear(4, 4)
        self.alias = self.other if tie_alias else torch.nn.Linear(4, 4)


@pytest.mark.parametrize("metadata", [None, {}, {"user": "kept", "head.weight": "mine"}])
def test_save_model_writes_dropped_names_into_the_callers_metadata(tmp_path, metadata):
    ours_metadata = None if metadata is None else dict(metadata)
    theirs_metadata = None if metadata is None else dict(metadata)
    ft.save_model(Tied(), tmp_path / "ours.safetensors", metadata=ours_metadata)
    reference.save_model(Tied(), str(tmp_path / "theirs.safetensors"), metadata=theirs_metadata)
    assert ours_metadata == theirs_metadata
    if metadata is not None:
        assert ours_metadata["other.bias"] == "alias.bias"
        assert ours_metadata["head.weight"] == metadata.get("head.weight", "embed.weight")
    # the same file but for the order of metadata keys, which the reference draws at random
    ours, theirs = (split(tmp_path / f"{who}.safetensors") for who in ("ours", "theirs"))
    assert ours == theirs
    with fastst.safe_open(tmp_path / "ours.safetensors") as f:
        assert f.metadata()["other.weight"] == "alias.weight"


def test_save_model_without_shared_tensors_keeps_metadata_none(tmp_path):
    metadata = {"user": "kept"}
    ft.save_model(torch.nn.Linear(2, 2), tmp_path / "plain.safetensors", metadata=metadata)
    assert metadata == {"user": "kept"}
    ft.save_model(torch.nn.Linear(2, 2), tmp_path / "none.safetensors")
    with fastst.safe_open(tmp_path / "none.safetensors") as f:
        assert f.metadata() is None


def test_saving_meta_and_unsupported_dtypes_raise_the_narrow_errors():
    with pytest.raises(fastst.SafetensorNotImplementedError, match="'m'.*meta") as meta:
        ft.save({"m": torch.zeros(2, device="meta")})
    assert isinstance(meta.value, NotImplementedError) and isinstance(meta.value, ValueError)
    # the reference's words, which code written for it looks for
    assert "Cannot copy out of meta tensor" in str(meta.value)
    for dtype in (torch.complex128, torch.qint8 if hasattr(torch, "qint8") else torch.complex32):
        try:
            tensor = torch.zeros(2, dtype=dtype)
        except (RuntimeError, TypeError):
            continue
        with pytest.raises(fastst.SafetensorTypeError, match="'z'") as wrong:
            ft.save({"z": tensor})
        assert isinstance(wrong.value, TypeError) and isinstance(wrong.value, ValueError)
