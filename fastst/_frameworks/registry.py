"""The frameworks fastst hands tensors to and takes them from: one registry for both
ways. A framework's adapter gives, for reading, the converter that ``safe_open``
passes each NumPy array through (``converter``), and, for writing, the spec and the
NumPy view of its tensors (``tensor_adapter``). Adapters are imported on first use,
with their framework; a tensor is known by the package of its type, so nothing
here imports a framework to ask whether a value is one of its tensors.

torch and JAX have adapters of their own (views where they can). MLX, TensorFlow
and PaddlePaddle make their tensors from the NumPy arrays, as the reference's do:
their adapters are the few lines below.
"""
from __future__ import annotations

from importlib import import_module
from types import ModuleType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, TypeVar

from .._core import SafetensorError

if TYPE_CHECKING:   # types only: a first read pays for none of them
    import numpy.typing as npt

    from .._core import TensorInfo

    T = TypeVar("T")
    # A framework's converter: (NumPy array, tensor name, the tensor's TensorInfo) -> its
    # tensor
    Converter = Callable[["npt.NDArray[Any]", str, TensorInfo], T]

__all__ = ["FRAMEWORKS", "NUMPY_FRAMEWORKS", "converter", "check_numpy_device",
           "tensor_adapter"]

NUMPY_FRAMEWORKS = ("np", "numpy")


# the package a framework's adapter imports -> what it is called, how it installs
PACKAGES: Dict[str, Tuple[str, str]] = {
    "torch": ("PyTorch", "pip install torch"), "jax": ("JAX", "pip install jax"),
    "mlx": ("MLX", "pip install mlx (on Linux: 'mlx[cpu]')"),
    "tensorflow": ("TensorFlow", "pip install tensorflow"),
    "paddle": ("PaddlePaddle", "pip install paddlepaddle")}
# header dtype code -> the MLX dtype of the same name (MLX has no 8-bit floats)
MLX_DTYPES = {"BOOL": "bool_", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
              "U32": "uint32", "I32": "int32", "U64": "uint64", "I64": "int64",
              "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
              "C64": "complex64"}


def _torch() -> ModuleType:
    from . import torch as _torch_adapter   # imports torch

    return _torch_adapter


def _jax() -> ModuleType:
    from . import jax   # imports JAX

    return jax


def _mlx() -> SimpleNamespace:
    mx = import_module("mlx.core")

    def converter(device: Any = "cpu") -> Converter[Any]:
        if device not in ("cpu", "gpu"):   # MLX arrays live in memory both share
            raise SafetensorError(f"MLX arrays go to 'cpu' or 'gpu', not {device!r}")

        def convert(array: Any, name: str, info: TensorInfo) -> Any:
            dtype = MLX_DTYPES.get(info.dtype)
            if dtype is None:
                raise SafetensorError(f"tensor {name!r}: MLX has no dtype for {info.dtype}")
            return mx.array(array, dtype=getattr(mx, dtype))   # a copy
        return convert
    return SimpleNamespace(converter=converter)


def _tensorflow() -> SimpleNamespace:
    tf = import_module("tensorflow")

    def converter(device: Any = "cpu") -> Converter[Any]:
        def convert(array: Any, name: str, info: TensorInfo) -> Any:
            with tf.device(device):
                return tf.convert_to_tensor(array)   # a copy
        return convert
    return SimpleNamespace(converter=converter)


def _paddle() -> SimpleNamespace:
    paddle = import_module("paddle")

    def converter(device: Any = "cpu") -> Converter[Any]:
        def convert(array: Any, name: str, info: TensorInfo) -> Any:
            return paddle.to_tensor(array, place=device)   # a copy
        return convert
    return SimpleNamespace(converter=converter)


# framework name, as safe_open takes it -> its adapter, imported on first use
FRAMEWORKS: Dict[str, Callable[[], Any]] = {
    "pt": _torch, "torch": _torch, "pytorch": _torch, "jax": _jax, "flax": _jax,
    "mlx": _mlx, "tf": _tensorflow, "tensorflow": _tensorflow, "paddle": _paddle}
# top-level package of a tensor's type -> the adapter that writes such tensors (JAX
# arrays need none: NumPy views them)
TENSOR_PACKAGES: Dict[str, Callable[[], ModuleType]] = {"torch": _torch}


def converter(framework: str, device: Any) -> Converter[Any]:
    """The converter of `framework`'s adapter for `device`: a function of
    (NumPy array, tensor name, TensorInfo) that returns the framework's tensor."""
    adapter = FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if adapter is None:
        raise SafetensorError(
            f"unknown framework {framework!r}; use 'np', 'pt' (torch), 'jax'/'flax', 'mlx', "
            f"'tf' or 'paddle'")
    try:
        loaded = adapter()
    except ImportError as error:
        missing = _not_installed(framework, error)
        if missing is None:
            raise
        raise missing from error
    made: Converter[Any] = loaded.converter(device)
    return made


def _not_installed(framework: str, error: ImportError) -> Optional[ImportError]:
    """The error for `framework`, whose package is missing: which one, and how to
    install it; None when what is missing is something else, which says so itself."""
    package = (error.name or "").partition(".")[0]
    if package not in PACKAGES:
        return None
    name, install = PACKAGES[package]
    return ImportError(f"framework={framework!r} needs {name}, which is not installed: "
                       f"{install}", name=package)


def check_numpy_device(device: Any) -> None:
    if device != "cpu":
        raise SafetensorError(f"NumPy arrays live on the CPU; device must be 'cpu', "
                              f"got {device!r}")


def tensor_adapter(value: Any) -> Optional[ModuleType]:
    """The adapter that writes `value`, a framework's tensor (with ``spec_of_tensor``
    and ``piece_of_tensor``); None for anything else."""
    load = TENSOR_PACKAGES.get(type(value).__module__.partition(".")[0])
    if load is None:
        return None
    adapter = load()
    return adapter if adapter.is_tensor(value) else None
