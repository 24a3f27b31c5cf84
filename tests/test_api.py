"""The handle's API: reference methods plus the mapping protocol."""
import subprocess
import sys

import numpy as np
import pytest

import fastst
from conftest import modules_loaded_by


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


def test_import_pulls_in_no_framework_or_store_library():
    assert modules_loaded_by("import fastst, fastst.numpy", (
        "torch", "jax", "tensorflow", "flax", "fsspec", "s3fs", "aiohttp", "botocore",
        "fastst.remote")) == []


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


def test_help_shows_the_real_signature_and_every_framework():
    import inspect
    import pydoc
    parameters = inspect.signature(fastst.safe_open).parameters
    assert list(parameters) == ["filename", "framework", "device", "backend", "max_header_size",
                                "verify", "storage_options"]
    assert parameters["framework"].default == "np" and parameters["device"].default == "cpu"
    assert parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    text = pydoc.render_doc(fastst.safe_open, renderer=pydoc.plaintext)
    # from the third line to the return annotation (Python 3.13 puts one parameter a line)
    signature = " ".join(text.split("\n", 2)[2].split(") -> ", 1)[0].split())
    assert signature.replace("( ", "(").startswith("safe_open(filename")
    for name in ("np", "numpy", "pt", "torch", "pytorch", "jax", "flax", "mmap", "pread"):
        assert f"'{name}'" in signature


def test_numpy_handles_are_readers_with_the_compiled_methods(path):
    from fastst._core import Reader
    with fastst.safe_open(path) as f:
        assert isinstance(f, fastst.NumpyHandle) and isinstance(f, Reader)
        # the compiled methods themselves: no Python layer between caller and core
        assert type(f).get_tensor is Reader.get_tensor
        assert type(f).__getitem__ is Reader.__getitem__


def test_framework_handle_delegates_to_its_reader(path):
    torch = pytest.importorskip("torch")
    f = fastst.safe_open(path, framework="pt")
    assert isinstance(f, fastst.FrameworkHandle)
    assert repr(f) == f"<fastst.safe_open {str(path)!r} (3 tensors)>"
    assert f.keys() == ["a", "b", "c"] and f.offset_keys() == ["a", "b", "c"]
    assert len(f) == 3 and "a" in f and list(f) == ["a", "b", "c"]
    assert f.metadata() == {"author": "me"} and f.info("a").dtype == "I64"
    assert f.backend == "mmap" and f.source == str(path) and not f.closed
    assert isinstance(f["a"], torch.Tensor) and f.get_slice("a")[1:].tolist() == [1, 1]
    with pytest.raises(fastst.SafetensorIndexError, match="'a'"):
        f.get_slice("a")[np.array([0, 3])]
    with pytest.raises(TypeError, match="framework='np'"):
        f.get_tensor("a", out=np.empty(3, np.int64))
    with f:
        pass
    assert f.closed and "closed" in repr(f)
    with pytest.raises(fastst.SafetensorError, match="closed"):
        f.get_tensor("a")


@pytest.mark.parametrize("module", [pytest.param("fastst.torch", marks=pytest.mark.needs("torch")),
                                    pytest.param("fastst.jax", marks=pytest.mark.needs("jax"))])
def test_every_adapter_converter_takes_array_name_and_info(path, module):
    import importlib
    import inspect
    adapter = importlib.import_module(module)
    convert = adapter.converter("cpu")
    assert list(inspect.signature(convert).parameters) == ["array", "name", "info"]
    with fastst.safe_open(path) as f:
        assert convert(f.get_tensor("a"), "a", f.info("a")).tolist() == [1, 1, 1]


def test_no_module_calls_a_private_name_of_another():
    import pathlib
    import re
    package = pathlib.Path(fastst.__file__).parent
    pattern = re.compile(r"\b(_api|_core|_handle|_slicing|reader|handle|self\._reader)\._[a-z]")
    offending = [f"{source.name}:{number}: {line.strip()}"
                 for source in sorted(package.glob("*.py"))
                 for number, line in enumerate(source.read_text().splitlines(), 1)
                 if pattern.search(line)]
    assert offending == []
