"""The handle's API: reference methods plus the mapping protocol."""
import ast
import errno
import io
import re
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


@pytest.mark.parametrize("framework", ["nope", "Torch", ""])
def test_unknown_frameworks_are_refused(path, framework):
    with pytest.raises(fastst.SafetensorError, match=f"unknown framework '{framework}'"):
        fastst.safe_open(path, framework=framework)


@pytest.mark.parametrize("framework, package, install", [
    ("tf", "tensorflow", "pip install tensorflow"),
    ("tensorflow", "tensorflow", "pip install tensorflow"),
    ("paddle", "paddle", "pip install paddlepaddle"),
    ("mlx", "mlx", "pip install mlx"),
    ("pt", "torch", "pip install torch")])
def test_a_framework_not_installed_names_its_package(path, framework, package, install):
    code = (f"import sys; sys.modules[{package!r}] = None\n"     # `import package` fails
            f"import fastst\n"
            f"try:\n    fastst.safe_open(sys.argv[1], framework={framework!r})\n"
            f"except ImportError as error:\n    print(error.name, '-', error)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, check=True)
    assert re.fullmatch(f"{package} - framework='{framework}' needs .*: {install}.*\n",
                        done.stdout)


def stand_in_module(name, **functions):
    """A module called `name` with these functions (a framework not installed here)."""
    import types
    module = types.ModuleType(name)
    module.__dict__.update(functions)
    return module


def test_tensorflow_tensors_are_made_from_the_arrays_on_the_device(path, monkeypatch):
    import contextlib
    made = []

    @contextlib.contextmanager
    def device(name):
        made.append(("device", name))
        yield

    monkeypatch.setitem(sys.modules, "tensorflow", stand_in_module(
        "tensorflow", device=device,
        convert_to_tensor=lambda array: made.append(("tensor", array.tolist())) or "tensor"))
    with fastst.safe_open(path, framework="tf", device="gpu:0") as f:
        assert f.get_tensor("a") == "tensor"
    assert made == [("device", "gpu:0"), ("tensor", [1, 1, 1])]


def test_paddle_tensors_are_made_from_the_arrays_in_the_place(path, monkeypatch):
    monkeypatch.setitem(sys.modules, "paddle", stand_in_module(
        "paddle", to_tensor=lambda array, place: (array.tolist(), place)))
    with fastst.safe_open(path, framework="paddle", device="gpu:1") as f:
        assert f.get_tensor("a") == ([1, 1, 1], "gpu:1")
        assert f.get_slice("a")[1:] == ([1, 1], "gpu:1")


def test_mlx_arrays_keep_each_dtype(tmp_path):
    import ml_dtypes
    import mlx.core as mx
    tensors = {"f64": np.arange(3.0), "bf16": np.ones(2, ml_dtypes.bfloat16),
               "u8": np.arange(4, dtype=np.uint8).reshape(2, 2), "b": np.array(True)}
    path = tmp_path / "mlx.safetensors"
    fastst.save_file(tensors, path)
    with fastst.safe_open(path, framework="mlx") as f:
        arrays = f.get_tensors()
        assert {name: array.dtype for name, array in arrays.items()} == {
            "f64": mx.float64, "bf16": mx.bfloat16, "u8": mx.uint8, "b": mx.bool_}
        assert np.array(arrays["f64"]).tolist() == [0.0, 1.0, 2.0]
        assert np.array(f.get_slice("u8")[1]).tolist() == [2, 3]
        assert isinstance(f, fastst.safe_open)
    fastst.save_file({"f8": np.ones(2, ml_dtypes.float8_e4m3fn)}, path)
    with fastst.safe_open(path, framework="mlx") as f:
        with pytest.raises(fastst.SafetensorError, match="'f8': MLX has no dtype for F8_E4M3"):
            f.get_tensor("f8")
    with pytest.raises(fastst.SafetensorError, match="MLX arrays go to 'cpu' or 'gpu'"):
        fastst.safe_open(path, framework="mlx", device="cuda:0")


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


def test_import_loads_the_package_alone():
    """Not even the compiled core (nor NumPy): each name is loaded on its first use,
    and the switch's .pth file imports the package as Python starts."""
    code = ("import sys; before = set(sys.modules); import fastst; "
            "print(sorted(set(sys.modules) - before))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert ast.literal_eval(done.stdout.strip()) == ["fastst"]


def test_the_first_name_used_loads_the_core_and_numpy():
    code = ("import sys, fastst; error = fastst.SafetensorError; "
            "print(error.__module__, 'numpy' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["fastst._core", "True"]


def test_names_used_from_the_package_load_their_module_once():
    code = ("import sys, fastst; assert 'fastst._api' not in sys.modules; "
            "f = fastst.safe_open; assert 'safe_open' in vars(fastst); "
            "print(f is fastst.safe_open is sys.modules['fastst._api'].safe_open, "
            "'fastst.writer' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.split() == ["True", "False"]


def test_import_pulls_in_no_framework_or_store_library():
    assert modules_loaded_by("import fastst, fastst.numpy", (
        "torch", "jax", "tensorflow", "flax", "fsspec", "s3fs", "aiohttp", "botocore",
        "fastst.remote")) == []


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        fastst.safe_open(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError):
        fastst.load_file(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_missing_file_is_worded_as_the_reference_words_it(tmp_path, monkeypatch, backend):
    monkeypatch.chdir(tmp_path)
    for call in (lambda: fastst.safe_open("notafile", backend=backend),
                 lambda: fastst.load_file("notafile", backend=backend)):
        with pytest.raises(FileNotFoundError) as caught:
            call()
        assert str(caught.value) == "No such file or directory: notafile"
        assert (caught.value.errno, caught.value.filename) == (errno.ENOENT, "notafile")


def test_safe_open_is_what_isinstance_checks(path, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    fastst.save_file({"a": np.zeros(100), "b": np.ones(100)}, checkpoint, max_shard_size=800)
    for opened in (fastst.safe_open(path), fastst.safe_open(path, backend="pread"),
                   fastst.safe_open(checkpoint)):
        with opened as f:
            assert isinstance(f, fastst.safe_open) and issubclass(type(f), fastst.safe_open)
    assert not isinstance(path, fastst.safe_open) and not isinstance(None, fastst.safe_open)
    assert issubclass(fastst.NumpyHandle, fastst.safe_open)
    assert not issubclass(dict, fastst.safe_open)


def test_safe_open_handle_opens_the_file_behind_a_file_object(path):
    with open(path) as text, fastst._safe_open_handle(text, framework="np", device="cpu") as g:
        assert g.backend == "mmap" and g.keys() == ["a", "b", "c"]
        assert g.get_tensor("a").tolist() == [1, 1, 1]
    with open(path, "rb") as raw, fastst._safe_open_handle(raw, "np", backend="pread") as g:
        assert g.backend == "pread"
    with fastst._safe_open_handle(io.BytesIO(path.read_bytes()), "np") as g:
        assert g.backend == "ranges" and g.metadata() == {"author": "me"}
    with pytest.raises(TypeError, match="binary file object"):
        fastst._safe_open_handle(3, "np")


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
    # safe_open is shown as a class, its signature on the line after the class's (from
    # there to the return annotation; Python 3.13 puts one parameter a line, each after
    # the "|" of the class's text)
    lines = text.splitlines()
    assert lines[2].startswith("class safe_open(")
    signature = " ".join(" ".join(lines[3:]).split(") -> ", 1)[0].replace("|", " ").split())
    assert signature.replace("( ", "(").startswith("safe_open(filename")
    for name in ("np", "numpy", "pt", "torch", "pytorch", "jax", "flax", "mlx", "tf",
                 "tensorflow", "paddle", "mmap", "pread"):
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
