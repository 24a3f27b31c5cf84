"""The switch to fastst for code that imports ``safetensors`` itself: the environment
variable, read by the .pth file pip installs beside the package, and
``fastst.patch_safetensors()``; each in a fresh Python."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import fastst
from helpers import SWITCH_PTH, SWITCH_WAYS, switch_environment, switched_python

FASTST = pathlib.Path(fastst.__file__).parent
ON = ["variable", "call"]


def run(code, tmp_path, **way):
    """The stdout of `code` run as ``switched_python`` runs it; an AssertionError with
    its stderr where it failed."""
    done = switched_python(code, tmp_path / "site", **way)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def read_pth(tmp_path, variable):
    """What reading the .pth file as Python starts does with FASTST_PATCH_SAFETENSORS
    set to `variable` (None: unset): the modules it imports, and whether it changed
    the finders of modules. The child starts with the variable unset and sets it just
    before reading the file: where fastst is installed, the copy of the file in
    site-packages has been read already as the child started."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(SWITCH_PTH, site)
    code = ("import json, os, site, sys\n"
            f"if {variable!r} is not None: os.environ['FASTST_PATCH_SAFETENSORS'] = {variable!r}\n"
            "imported, finders = set(sys.modules), list(sys.meta_path)\n"
            f"site.addsitedir({str(site)!r})\n"
            "print(json.dumps([sorted(set(sys.modules) - imported), sys.meta_path != finders]))")
    done = subprocess.run([sys.executable, "-c", code], env=switch_environment(None),
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("variable", [None, "0", ""], ids=["unset", "0", "empty"])
def test_the_pth_file_imports_nothing_while_the_variable_is_off(tmp_path, variable):
    """What every Python of an environment where fastst is installed pays as it starts."""
    assert read_pth(tmp_path, variable) == [[], False]


def test_the_pth_file_adds_a_finder_and_imports_fastst_when_the_variable_is_1(tmp_path):
    imported, changed = read_pth(tmp_path, "1")
    assert changed and "fastst._switch" in imported
    assert not [name for name in imported if name.startswith("safetensors")]   # on use


def test_the_pth_file_imports_two_small_modules_when_the_variable_is_1(tmp_path):
    """What every Python of an environment with the switch on pays as it starts: the
    compiled core, NumPy and importlib's ABCs (tempfile, shutil...) wait for the
    first import of safetensors."""
    imported, _ = read_pth(tmp_path, "1")
    assert imported == ["fastst", "fastst._switch"]


@pytest.mark.parametrize("way", ON)
def test_safetensors_and_its_numpy_module_are_fastst(tmp_path, way):
    code = """
    import json, fastst, safetensors, safetensors.numpy
    from safetensors import safe_open, SafetensorError, serialize, deserialize
    print(json.dumps([safetensors.__version__, safetensors.__file__,
                      safetensors.numpy.__file__,
                      safe_open is fastst.safe_open, SafetensorError is fastst.SafetensorError,
                      serialize is fastst.serialize, deserialize is fastst.deserialize,
                      safetensors.numpy.load is fastst.numpy.load,
                      safetensors.numpy.save_file is fastst.save_file]))
    """
    version, top, numpy, *same = json.loads(run(code, tmp_path, **SWITCH_WAYS[way]))
    assert version == "0.8.0"
    assert (top, numpy) == (str(FASTST / "__init__.py"), str(FASTST / "numpy.py"))
    assert all(same)


@pytest.mark.needs("torch", "jax")
@pytest.mark.parametrize("way", ON)
def test_the_framework_modules_are_fastst(tmp_path, way):
    code = """
    import json, fastst.torch, fastst.flax, safetensors.torch, safetensors.flax
    from safetensors.torch import load_file, save_model, _find_shared_tensors
    print(json.dumps([safetensors.torch.__file__, safetensors.flax.__file__,
                      load_file is fastst.torch.load_file, save_model is fastst.torch.save_model,
                      _find_shared_tensors is fastst.torch._find_shared_tensors,
                      safetensors.flax.load_file is fastst.flax.load_file]))
    """
    torch, flax, *same = json.loads(run(code, tmp_path, **SWITCH_WAYS[way]))
    assert (torch, flax) == (str(FASTST / "torch.py"), str(FASTST / "flax.py"))
    assert all(same)


def test_without_the_switch_safetensors_is_the_reference(tmp_path):
    pytest.importorskip("safetensors")
    code = "import safetensors; print(safetensors.__file__)"
    assert not run(code, tmp_path).strip().startswith(str(FASTST))


def test_the_reference_is_never_imported_under_the_switch(tmp_path):
    """Whether it is installed or not: a `safetensors` first on the path is left alone."""
    impostor = tmp_path / "path" / "safetensors"
    impostor.mkdir(parents=True)
    (impostor / "__init__.py").write_text("raise ImportError('the reference was imported')")
    (impostor / "numpy.py").write_text("raise ImportError('the reference was imported')")
    code = f"""
    import sys
    sys.path.insert(0, {str(tmp_path / "path")!r})
    import fastst, safetensors.numpy
    print(safetensors.numpy.load is fastst.numpy.load)
    """
    for way in ON:
        assert run(code, tmp_path, **SWITCH_WAYS[way]) == "True\n"


def test_turning_it_on_again_changes_nothing(tmp_path):
    code = """
    import fastst, safetensors, sys
    before = (list(sys.meta_path), safetensors)
    fastst.patch_safetensors()
    fastst.patch_safetensors()
    import safetensors
    print((list(sys.meta_path), safetensors) == before)
    """
    for way in ON:      # the variable, then the call; the call, then again
        assert run(code, tmp_path, **SWITCH_WAYS[way]) == "True\n"


def test_the_call_after_safetensors_is_imported_refuses_and_says_what_to_do(tmp_path):
    pytest.importorskip("safetensors")
    code = """
    import sys, safetensors, safetensors.numpy, fastst
    finders = list(sys.meta_path)
    try:
        fastst.patch_safetensors()
    except RuntimeError as error:
        print(error)
    print(sys.meta_path == finders, safetensors.safe_open is fastst.safe_open)
    """
    message, unchanged = run(code, tmp_path).splitlines()
    assert message.startswith("safetensors is imported already (safetensors, ")
    assert "safetensors.numpy): what imported it keeps the reference's functions" in message
    assert "before importing the libraries that use safetensors" in message
    assert "FASTST_PATCH_SAFETENSORS=1" in message
    assert unchanged == "True False"


@pytest.mark.parametrize("name", ["safetensors.mlx", "safetensors.paddle",
                                  "safetensors.tensorflow", "safetensors._safetensors_rust"])
def test_a_module_fastst_does_not_have_is_refused_with_those_it_has(tmp_path, name):
    code = f"""
    try:
        import {name}
    except ModuleNotFoundError as error:
        print(error.name, error)
    """
    assert run(code, tmp_path, **SWITCH_WAYS["call"]).strip() == (
        f"{name} No module named {name!r}: fastst serves safetensors "
        f"(FASTST_PATCH_SAFETENSORS=1 or fastst.patch_safetensors()) and has safetensors, "
        f"safetensors.numpy, safetensors.torch, safetensors.flax; "
        f"fastst.safe_open(path, framework=...) reads for MLX, TensorFlow and Paddle")


@pytest.mark.needs("safetensors")     # in the child it runs
def test_metadata_still_describes_the_installed_distribution(tmp_path):
    code = """
    import importlib.metadata, importlib.util, json
    try:
        version = importlib.metadata.version("safetensors")
    except importlib.metadata.PackageNotFoundError:
        version = None
    print(json.dumps([version, importlib.util.find_spec("safetensors").origin]))
    """
    off, origin_off = json.loads(run(code, tmp_path))
    on, origin_on = json.loads(run(code, tmp_path, **SWITCH_WAYS["variable"]))
    assert on == off and origin_on == str(FASTST / "__init__.py") != origin_off


def test_a_module_shows_every_name_of_its_fastst_module(tmp_path):
    code = """
    import json, fastst, fastst.numpy, safetensors, safetensors.numpy
    namespace = {}
    exec("from safetensors import *", namespace)
    print(json.dumps([sorted(set(dir(fastst)) - set(dir(safetensors))),
                      sorted(set(dir(fastst.numpy)) - set(dir(safetensors.numpy))),
                      sorted(set(fastst.__all__) - set(namespace)),
                      hasattr(safetensors, "no_such_name"), hasattr(safetensors, "numpy")]))
    """
    assert json.loads(run(code, tmp_path, **SWITCH_WAYS["call"])) == [[], [], [], False, True]


@pytest.mark.parametrize("value", ["true", "2"])
def test_a_value_of_the_variable_besides_0_and_1_is_named_as_python_starts(tmp_path, value):
    code = "import sys; print([type(finder).__name__ for finder in sys.meta_path])"
    done = switched_python(code, tmp_path / "site", variable=value)
    assert done.returncode == 0
    assert f"FASTST_PATCH_SAFETENSORS={value!r}: set it to 1" in done.stderr
    assert done.stdout == run(code, tmp_path)      # as with the variable unset
    assert "SafetensorsFinder" in run(code, tmp_path, **SWITCH_WAYS["variable"])


# Every name that libraries take from safetensors: transformers, huggingface_hub,
# accelerate and diffusers (read from their sources), torch.distributed.checkpoint, vLLM
# and the reference's own conversion script.
NAMES_LIBRARIES_USE = {
    "safetensors": ["safe_open", "SafetensorError", "__version__", "serialize",
                    "serialize_file", "deserialize", "TensorSpec", "_safe_open_handle"],
    "safetensors.torch": ["load_file", "save_file", "load", "save", "load_model", "save_model",
                          "safe_open", "storage_ptr", "storage_size", "_find_shared_tensors",
                          "_is_complete", "_remove_duplicate_names", "_getdtype", "_TYPES",
                          "_SIZE", "_to_ndarray"],
    "safetensors.numpy": ["load_file", "save_file", "load", "save", "safe_open"],
}


@pytest.mark.needs("torch")
def test_every_name_libraries_take_from_safetensors_is_there(tmp_path):
    code = f"""
    import importlib, json
    from fastst._switch import FACES
    missing = []
    for module, names in {NAMES_LIBRARIES_USE!r}.items():
        ours = importlib.import_module(FACES[module])
        served = importlib.import_module(module)
        missing += [f"{{module}}.{{name}}" for name in names if not hasattr(served, name)
                    or name != "__version__" and getattr(served, name) is not getattr(ours, name)]
    print(json.dumps(missing))
    """
    assert json.loads(run(code, tmp_path, **SWITCH_WAYS["call"])) == []


@pytest.mark.skipif(os.environ.get("FASTST_TEST_INSTALLED") != "1",
                    reason="fastst is not installed from a wheel here (FASTST_TEST_INSTALLED)")
def test_the_installed_package_has_the_pth_file_beside_it():
    installed = FASTST.parent / SWITCH_PTH.name
    assert installed.read_bytes() == SWITCH_PTH.read_bytes()
