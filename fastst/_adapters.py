"""The frameworks fastst hands tensors to and takes them from: one registry for both
ways. A framework's adapter gives, for reading, the converter that ``safe_open``
passes each NumPy array through (``converter``), and, for writing, the spec and the
NumPy view of its tensors (``tensor_adapter``). Adapters are imported on first use,
with their framework; a tensor is known by the package of its type, so nothing
here imports a framework to ask whether a value is one of its tensors.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict, Optional

from ._core import SafetensorError
from ._slicing import Converter

__all__ = ["FRAMEWORKS", "NUMPY_FRAMEWORKS", "converter", "check_numpy_device",
           "tensor_adapter"]

NUMPY_FRAMEWORKS = ("np", "numpy")
# framework name, as safe_open takes it -> the module that adapts NumPy arrays to it
FRAMEWORKS: Dict[str, str] = {"pt": "fastst._torch_adapter", "torch": "fastst._torch_adapter",
                              "pytorch": "fastst._torch_adapter", "jax": "fastst.jax",
                              "flax": "fastst.jax"}
# top-level package of a tensor's type -> the module that writes such tensors (JAX
# arrays need none: NumPy views them)
TENSOR_PACKAGES: Dict[str, str] = {"torch": "fastst._torch_adapter"}


def converter(framework: str, device: Any) -> Converter[Any]:
    """The converter of `framework`'s adapter for `device`: a function of
    (NumPy array, tensor name, TensorInfo) that returns the framework's tensor."""
    module = FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if module is None:
        raise SafetensorError(
            f"unknown framework {framework!r}; use 'np', 'pt' (torch) or 'jax'/'flax'")
    made: Converter[Any] = importlib.import_module(module).converter(device)
    return made


def check_numpy_device(device: Any) -> None:
    if device != "cpu":
        raise SafetensorError(f"NumPy arrays live on the CPU; device must be 'cpu', "
                              f"got {device!r}")


def tensor_adapter(value: Any) -> Optional[ModuleType]:
    """The adapter that writes `value`, a framework's tensor (with ``spec_of_tensor``
    and ``as_numpy``); None for anything else."""
    module = TENSOR_PACKAGES.get(type(value).__module__.partition(".")[0])
    if module is None:
        return None
    adapter = importlib.import_module(module)
    return adapter if adapter.is_tensor(value) else None
