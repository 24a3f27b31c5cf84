"""The handle's API: reference methods plus the mapping protocol."""
import subprocess
import sys

import numpy as np
import pytest

import fastst


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "api.safetensors"
    fastst.save_file({"b": np.zeros(2, np.float32), "a": np.ones(3, np.int64),
                      "c": np.zeros((), np.uint8)}, p, metadata={"author": "me"})
    return p


def test_reference_methods(path):
    with fastst.safe_open(path, framework="numpy", device="cpu") as f:
        assert f.keys() == ["a", "b", "c"]
        assert f.offset_keys() == ["a", "b", "c"]
        assert f.metadata() == {"author": "me"}
        assert list(f.get_tensors()) == ["a", "b", "c"]
        assert f.get_tensor("a").tolist() == [1, 1, 1]


def test_mapping_protocol(path):
    with fastst.safe_open(path) as f:
        assert len(f) == 3 and "a" in f and "z" not in f
        assert list(f) == ["a", "b", "c"]
        assert f["b"].dtype == np.float32
        with pytest.raises(KeyError):
            f["z"]
        with pytest.raises(fastst.SafetensorError, match="no tensor named 'z'"):
            f.get_tensor("z")


def test_metadata_is_a_copy(path):
    with fastst.safe_open(path) as f:
        f.metadata()["author"] = "someone else"
        assert f.metadata() == {"author": "me"}
    assert fastst.load_file(path).keys() == {"a", "b", "c"}


def test_no_metadata_gives_none(tmp_path):
    fastst.save_file({"x": np.ones(1)}, tmp_path / "n.safetensors")
    with fastst.safe_open(tmp_path / "n.safetensors") as f:
        assert f.metadata() is None


def test_closed_handle_refuses_every_read(path):
    f = fastst.safe_open(path)
    assert not f.closed and "3 tensors" in repr(f)
    f.close()
    f.close()
    assert f.closed and "closed" in repr(f)
    for call in (f.keys, f.offset_keys, f.metadata, f.get_tensors, lambda: f.get_tensor("a"),
                 lambda: len(f), lambda: "a" in f, lambda: f.get_slice("a")):
        with pytest.raises(fastst.SafetensorError, match="closed"):
            call()


@pytest.mark.parametrize("framework", ["tf", "tensorflow", "mlx", "paddle", "nope"])
def test_frameworks_without_an_adapter_are_refused(path, framework):
    with pytest.raises(fastst.SafetensorError, match=f"unknown framework '{framework}'"):
        fastst.safe_open(path, framework=framework)


def test_unknown_framework_device_and_backend(path):
    with pytest.raises(fastst.SafetensorError, match="device must be 'cpu'"):
        fastst.safe_open(path, device="cuda:0")
    with pytest.raises(ValueError, match="backend"):
        fastst.safe_open(path, backend="io_uring")


def test_errors_are_value_errors_and_not_found_is_a_key_error():
    assert issubclass(fastst.SafetensorError, ValueError)
    assert issubclass(fastst.TensorNotFoundError, fastst.SafetensorError)
    assert issubclass(fastst.TensorNotFoundError, KeyError)
    assert str(fastst.TensorNotFoundError("x: no tensor named 'a'")) == "x: no tensor named 'a'"


def test_import_pulls_in_no_framework():
    code = ("import sys, fastst, fastst.numpy; "
            "print(sorted(m for m in ('torch', 'jax', 'tensorflow', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastst.safe_open(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError):
        fastst.load_file(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("framework, module", [("torch", "fastst.torch"), ("jax", "fastst.jax"),
                                               ("jax", "fastst.flax")])
def test_an_adapter_without_its_framework_names_the_install_command(framework, module):
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as error:\n    print(error)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert f"pip install {framework}" in out.stdout
