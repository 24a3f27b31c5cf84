"""The adapter behind ``safe_open(..., framework="jax")`` (or ``"flax"``): fastst's
NumPy views become ``jax.Array``s.

``jax.device_put`` takes each view: on the CPU, JAX uses the view's memory
itself when the tensor is C-contiguous and 64-byte aligned (any dtype, bfloat16
and float8 included), and otherwise makes one copy. JAX arrays are immutable and
no one else holds the view, so sharing it is safe. Tensors of 64-bit dtypes
become 32-bit unless JAX's ``jax_enable_x64`` is on, as with any NumPy input.
Sub-byte tensors (F4, F6_*) come as their packed bytes (uint8), as in NumPy.

``fastst.flax`` has the save/load functions.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy.typing as npt

try:
    import jax
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fastst.jax needs JAX: pip install jax") from error

from ._core import SafetensorError, TensorInfo

__all__ = ["converter"]


def converter(device: Any = "cpu") -> Callable[[npt.NDArray[Any], str, TensorInfo], jax.Array]:
    """The function safe_open(framework="jax") passes each NumPy view through.

    `device` is ``"cpu"`` (the default), a ``jax.Device``, or a JAX platform name
    with an optional index (``"gpu"``, ``"cuda:1"``, ``"tpu"``).
    """
    target = _target_device(device)

    def convert(array: npt.NDArray[Any], name: str, info: TensorInfo) -> jax.Array:
        result: jax.Array = jax.device_put(array, target)
        return result

    return convert


def _target_device(device: Any) -> Optional[jax.Device]:
    """The device to put arrays on; None for JAX's default device when that is
    the one asked for (the arrays are then not committed to a device)."""
    if isinstance(device, jax.Device):
        return device
    if not isinstance(device, str):
        raise SafetensorError(f"device must be 'cpu', a platform name or a jax.Device, "
                              f"got {device!r}")
    platform, _, index_text = device.partition(":")
    if not platform or (index_text and not index_text.isdigit()):
        raise SafetensorError(f"invalid device {device!r}")
    index = int(index_text) if index_text else 0
    try:
        devices = jax.devices(platform)
    except RuntimeError as error:
        raise RuntimeError(f"device {device!r} is not available to JAX: {error}") from None
    if index >= len(devices):
        raise RuntimeError(f"device {device!r} is not available to JAX: it has "
                           f"{len(devices)} {platform} device(s)")
    chosen = devices[index]
    if not index_text and chosen == jax.devices()[0]:
        return None
    return chosen
