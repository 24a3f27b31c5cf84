"""The JAX adapter: ``jax.Array``s from fastst's NumPy views, on the CPU, on a CUDA GPU
through fastst's ring of pinned buffers, and laid out by shardings (``fastst.jax``
says how, for users)."""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import numpy.typing as npt

try:
    import jax
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fastst.jax needs JAX: pip install jax") from error

from .._core import SafetensorError, TensorInfo, numpy_dtype
from .._format.blocks import device_boxes, grouped, leading_index, packed_refusal, whole, within

__all__ = ["converter", "from_torch"]


def converter(device: Any = "cpu") -> Callable[[npt.NDArray[Any], str, TensorInfo], jax.Array]:
    """The function ``safe_open(framework="jax")`` passes each NumPy view through.

    ``jax.device_put`` of each view onto the device. For a CUDA GPU, when
    PyTorch with CUDA is installed too, the converter also takes whole files
    (``convert_file``, used by ``get_tensors``), streamed into one device
    allocation: see `from_torch`.

    Parameters
    ----------
    device : str or jax.Device, default "cpu"
        ``"cpu"``, a ``jax.Device``, or a JAX platform name with an optional
        index (``"gpu"``, ``"cuda:1"``, ``"tpu"``).

    Returns
    -------
    callable
        ``convert(array, name, info)``: the ``jax.Array`` of the NumPy array
        of tensor `name`, described by its ``fastst.TensorInfo``.

    Raises
    ------
    SafetensorError
        When `device` is not a str or a ``jax.Device``, or not a platform
        name.
    RuntimeError
        When the device is not available to JAX.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.jax import converter
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(3, dtype=np.int16)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     array = converter("cpu")(f.get_tensor("x"), "x", f.info("x"))
    >>> array
    Array([0, 1, 2], dtype=int16)
    """
    target = _target_device(device)
    chosen = jax.devices()[0] if target is None else target
    if chosen.platform == "gpu" and _torch_has_cuda():
        import torch

        from . import cuda as _cuda   # imports torch: only when a CUDA GPU is asked for

        return JaxCudaConverter(target, *_cuda.device_ring(
            torch.device("cuda", chosen.local_hardware_id), _cuda.CHUNK_BYTES,
            _cuda.RING_BUFFERS))
    return Converter(target)


class Converter:
    """``jax.device_put`` of each view onto one device (None: JAX's default)."""

    def __init__(self, target: Optional[jax.Device]) -> None:
        self.target = target

    def __call__(self, array: npt.NDArray[Any], name: str, info: TensorInfo) -> jax.Array:
        result: jax.Array = jax.device_put(array, self.target)
        return result

    def sharded(self, reader: Any, name: str, info: TensorInfo,
                sharding: jax.sharding.Sharding) -> jax.Array:
        """Tensor `name` of `reader` (a NumpyHandle) laid out by `sharding`: see
        `sharded`."""
        return sharded(reader, name, info, sharding)

    def sharding_for(self, shardings: Any, name: str, info: TensorInfo
                     ) -> Optional[jax.sharding.Sharding]:
        """The sharding `shardings` gives tensor `name`: see `sharding_for`."""
        return sharding_for(shardings, name, info)


def sharded(reader: Any, name: str, info: TensorInfo,
            sharding: jax.sharding.Sharding) -> jax.Array:
    """The ``jax.Array`` of tensor `name` of `reader` (a NumpyHandle) laid out by
    `sharding`, equal to ``jax.device_put(array, sharding)``: the shards of this
    process's devices read through the tensor's slice, and nothing else (with the
    pread backend and for URLs; copied out of the map with mmap), once however
    many devices hold them: the block they tile in one read where they tile one,
    else shard by shard; each device's shard is then put on it."""
    part = reader.get_slice(name)
    if info.array_shape is None:
        part[...]   # raises the error that says why
    shape: Tuple[int, ...] = info.array_shape or ()
    boxes_held = device_boxes(sharding, shape, f"{reader.source}: tensor {name!r}")
    if list(boxes_held) == [whole(shape)]:     # every device holds it all: JAX copies it
        result: jax.Array = jax.device_put(np.asarray(part[...]), sharding)
        return result
    placed: Dict[Any, jax.Array] = {}
    for read, boxes in grouped(boxes_held):
        for box in (read, *boxes):
            refusal = packed_refusal(reader.source, name, info, box)
            if refusal is not None:
                raise SafetensorError(refusal)
        block = np.asarray(part[leading_index(read, shape)])
        for box, devices in boxes.items():
            shard = block[within(box, read)]
            for device in devices:
                placed[device] = jax.device_put(shard, device)
    arrays: List[jax.Array] = list(placed.values())
    result = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return result


def sharding_for(shardings: Any, name: str, info: TensorInfo
                 ) -> Optional[jax.sharding.Sharding]:
    """The sharding that `shardings` gives tensor `name`: `shardings` itself (a
    ``jax.sharding.Sharding``), ``shardings.get(name)`` (a mapping), or
    ``shardings(name, shape, dtype)`` (a callable, given the array's shape and NumPy
    dtype); None: the tensor loads as without a sharding."""
    if isinstance(shardings, jax.sharding.Sharding):
        return shardings
    if isinstance(shardings, Mapping):
        chosen = shardings.get(name)
    elif callable(shardings):
        shape = info.array_shape if info.array_shape is not None else tuple(info.shape)
        chosen = shardings(name, shape, numpy_dtype(info.dtype))
    else:
        raise SafetensorError(f"shardings must be a jax.sharding.Sharding, a mapping of "
                              f"names to shardings or a callable (name, shape, dtype) -> "
                              f"sharding or None, got {type(shardings).__name__}")
    if chosen is not None and not isinstance(chosen, jax.sharding.Sharding):
        raise SafetensorError(f"tensor {name!r}: shardings gave a {type(chosen).__name__}, "
                              f"not a jax.sharding.Sharding (or None)")
    return chosen


class JaxCudaConverter(Converter):
    """A converter for a CUDA GPU that takes a whole open file at once: its tensors
    stream through a ring of pinned buffers into one allocation on the GPU
    (``make_dest`` and ``make_ring``: see ``fastst._frameworks.cuda.device_ring``) and become
    ``jax.Array``s of that memory, through DLPack."""

    def __init__(self, target: Optional[jax.Device], make_dest: Any, make_ring: Any) -> None:
        super().__init__(target)
        from . import cuda as _cuda

        self.make_dest, self.make_ring = make_dest, make_ring
        self.load_opened_into = _cuda.load_opened_into
        self.numpy_place = _cuda.numpy_place

    def convert_file(self, reader: Any) -> Dict[str, jax.Array]:
        """Every tensor of the file `reader` (a NumpyHandle) opened, on the GPU."""
        _, tensors = self.load_opened_into(reader, {}, self.make_dest, self.make_ring,
                                           place=self.numpy_place)
        return from_torch(tensors)


def from_torch(tensors: Dict[str, Any]) -> Dict[str, jax.Array]:
    """``jax.Array``s of the memory of torch tensors, through DLPack.

    No copy where JAX can use the memory as it is (offsets aligned to 64
    bytes: fastst's packed loads), one where it cannot, and for 64-bit dtypes
    when JAX keeps to 32 bits. Each array keeps its tensor's memory alive.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        The tensors (CPU or CUDA).

    Returns
    -------
    dict of str to jax.Array
        By the same names.

    Examples
    --------
    >>> import torch
    >>> from fastst.jax import from_torch
    >>> from_torch({"t": torch.arange(3, dtype=torch.int32)})
    {'t': Array([0, 1, 2], dtype=int32)}
    """
    return {name: jax.dlpack.from_dlpack(tensor) for name, tensor in tensors.items()}


def _torch_has_cuda() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


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
