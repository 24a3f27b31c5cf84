"""The frameworks fastst hands tensors to and takes them from: one registry for both
ways. A framework's adapter gives, for reading, the converter that ``safe_open``
passes each NumPy array through (``converter``), and, for writing, the spec and the
NumPy view of its tensors (``tensor_adapter``). Adapters are imported on first use,
with their framework; a tensor is known by the package of its type, so nothing
here imports a framework to ask whether a value is one of its tensors.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Dict, Optional

from ._core import SafetensorError
from ._slicing import Converter

__all__ = ["FRAMEWORKS", "NUMPY_FRAMEWORKS", "converter", "check_numpy_device",
           "tensor_adapter"]

NUMPY_FRAMEWORKS = ("np", "numpy")


def _torch() -> ModuleType:
    from . import _torch_adapter   # imports torch

    return _torch_adapter


def _jax() -> ModuleType:
    from . import jax   # imports JAX

    return jax


# framework name, as safe_open takes it -> its adapter, imported on first use
FRAMEWORKS: Dict[str, Callable[[], ModuleType]] = {
    "pt": _torch, "torch": _torch, "pytorch": _torch, "jax": _jax, "flax": _jax}
# top-level package of a tensor's type -> the adapter that writes such tensors (JAX
# arrays need none: NumPy views them)
TENSOR_PACKAGES: Dict[str, Callable[[], ModuleType]] = {"torch": _torch}


def converter(framework: str, device: Any) -> Converter[Any]:
    """The converter of `framework`'s adapter for `device`: a function of
    (NumPy array, tensor name, TensorInfo) that returns the framework's tensor."""
    adapter = FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if adapter is None:
        raise SafetensorError(
            f"unknown framework {framework!r}; use 'np', 'pt' (torch) or 'jax'/'flax'")
    made: Converter[Any] = adapter().converter(device)
    return made


def check_numpy_device(device: Any) -> None:
    if device != "cpu":
        raise SafetensorError(f"NumPy arrays live on the CPU; device must be 'cpu', "
                              f"got {device!r}")


def tensor_adapter(value: Any) -> Optional[ModuleType]:
    """The adapter that writes `value`, a framework's tensor (with ``spec_of_tensor``
    and ``as_numpy``); None for anything else."""
    load = TENSOR_PACKAGES.get(type(value).__module__.partition(".")[0])
    if load is None:
        return None
    adapter = load()
    return adapter if adapter.is_tensor(value) else None
