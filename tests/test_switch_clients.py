"""The Hugging Face libraries through the switch to fastst: transformers,
huggingface_hub, accelerate and diffusers save and load models built from small
configs (tests/switch_clients.py, offline, on the CPU) in a fresh Python for each way
to turn the switch on, and in one without it; they must save the same files, byte for
byte, and give the same outputs and warnings."""
from __future__ import annotations

import json
import pathlib

import pytest

from helpers import SWITCH_WAYS, switched_python

pytest.importorskip("safetensors")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

SCRIPT = pathlib.Path(__file__).with_name("switch_clients.py")
CASES = ["transformers_sharded_and_tied", "transformers_tied_llama", "transformers_bf16",
         "transformers_device_map_auto", "transformers_disable_mmap", "hub_state_dict",
         "hub_mixin", "accelerate_dispatch", "diffusers_unet"]
ON = ["variable", "call"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each case of switch_clients.py gave, by the way the switch was turned on
    ("off": not at all)."""
    found = {}
    for way, how in SWITCH_WAYS.items():
        folder = tmp_path_factory.mktemp(way)
        code = (f"import runpy, sys\nsys.argv = [{str(SCRIPT)!r}, {str(folder)!r}]\n"
                f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
        done = switched_python(code, folder / "site", timeout=600, **how)
        assert done.returncode == 0, done.stderr[-3000:]
        found[way] = json.loads((folder / "results.json").read_text())
    return found


def test_the_libraries_take_safetensors_from_fastst_only_through_the_switch(results):
    off = results["off"]["bound"]
    assert "fastst" not in off.pop("safetensors")
    assert off and all(module.startswith("safetensors") or module == "builtins"
                       for module in off.values())
    for way in ON:
        bound = dict(results[way]["bound"])
        assert bound.pop("safetensors").endswith("fastst/__init__.py")
        assert bound.keys() == off.keys()
        assert all(module.startswith("fastst.") for module in bound.values()), bound


@pytest.mark.parametrize("way", ON)
@pytest.mark.parametrize("case", CASES)
def test_a_library_saves_and_loads_through_the_switch_as_through_the_reference(
        results, case, way):
    reference = results["off"][case]
    if "missing" in reference:
        pytest.skip(f"needs {reference['missing']}")
    assert "error" not in reference and reference.get("same as saved", True) is True
    assert results[way][case] == reference


def test_the_cases_save_what_they_are_meant_to(results):
    """Sharded checkpoints with an index, a tied head, bfloat16 weights."""
    off = results["off"]
    for case in ("transformers_sharded_and_tied", "transformers_bf16", "hub_state_dict"):
        names = list(off[case]["files"])
        assert "model.safetensors.index.json" in names, case
        assert len([name for name in names if name.startswith("model-")]) > 2, case
    assert off["transformers_tied_llama"]["tied"] is True
    assert off["transformers_bf16"]["dtype"] == "torch.bfloat16"
    # the tied weights saved once, and filled through their other name
    assert off["hub_state_dict"]["keys"] == [["model.embed_tokens.weight"], []]


@pytest.mark.parametrize("way", ON)
def test_huggingface_hub_loads_onto_the_device_itself_with_no_version_warning(results, way):
    """From safetensors 0.4.3 on, huggingface_hub hands the device to load_model, and
    warns below it that it loads on the CPU and copies."""
    mixin = results[way]["hub_mixin"]
    assert mixin["load_model keywords"] == [["device", "strict"]]
    warned = [message for case in CASES for message in results[way][case].get("warnings", [])
              if "safetensors" in message]
    assert warned == []
