"""The torch adapter: fastst's NumPy arrays as torch tensors (reading), and torch
tensors as what fastst's writers take (writing). ``safe_open(..., framework="pt")``
and the writers reach it through ``fastst._frameworks.registry``; ``fastst.torch`` is the
public face built on it.

A CPU tensor views the array's memory (``torch.from_numpy``, through a same-width
integer for the dtypes NumPy has from ml_dtypes and torch cannot take from it), so
loading copies nothing; a tensor to write is viewed by NumPy the same way.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, Optional, Tuple

import numpy as np
import torch

import fastst._core as _core
from .._core import (SafetensorError, SafetensorNotImplementedError, SafetensorTypeError,
                     numpy_dtype)
from .._format.torch_dtypes import (FROM_ML_DTYPES, NUMPY_VIEWS_TORCH, PACKED_PAIRS,
                                    SAME_WIDTH_INTEGER, codes_of_torch, same_width_torch,
                                    torch_dtype)

if TYPE_CHECKING:   # numpy.typing costs milliseconds to import
    import numpy.typing as npt

    from .._core import TensorInfo, WriteSpec

__all__ = ["TorchCpuConverter", "TorchCudaConverter", "TorchDeviceConverter", "converter",
           "is_tensor", "piece_of_tensor", "spec_of_tensor", "target_device", "tensor_of"]


def converter(device: Any = "cpu"
              ) -> Callable[[npt.NDArray[Any], str, TensorInfo], torch.Tensor]:
    """The function ``safe_open(framework="pt")`` passes each NumPy view through.

    On the CPU the tensor views the array's memory; read-only arrays (views of
    ``bytes``) are copied, since torch tensors are always writable. Any other
    device gets a copy, moved there with ``.to(device)``; on a CUDA device
    large tensors go through a ring of pinned buffers filled by several
    threads, and a handle's ``get_tensors()`` streams the whole file through
    one ring into one device allocation.

    Parameters
    ----------
    device : str or int or torch.device, default "cpu"
        Where the tensors go; an int is a CUDA device index, as in
        safetensors.

    Returns
    -------
    callable
        ``convert(array, name, info)``: the torch tensor of the NumPy array
        of tensor `name`, described by its ``fastst.TensorInfo``.

    Raises
    ------
    SafetensorError
        When `device` is not a device.
    RuntimeError
        When `device` is not available (no CUDA).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os, torch
    >>> from fastst.torch import converter
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(3, dtype=np.float32)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     tensor = converter("cpu")(f.get_tensor("x"), "x", f.info("x"))
    >>> tensor
    tensor([0., 1., 2.])
    """
    target = target_device(device)
    if target is None:
        return TorchCpuConverter()
    if target.type == "cuda":
        return TorchCudaConverter(target)
    return TorchDeviceConverter(target)


class TorchCpuConverter:
    """The converter to CPU torch tensors, each viewing its array's memory; with
    ``convert_file``, every tensor of an open file at once."""

    # bfloat16 and float8 come as their bits, which torch views as its own dtypes:
    # reading them into torch needs no ml_dtypes
    uses_ml_dtypes = False

    def __call__(self, array: npt.NDArray[Any], name: str, info: TensorInfo) -> torch.Tensor:
        return tensor_of(array, name, info)

    def convert_file(self, reader: Any) -> Dict[str, torch.Tensor]:
        """Every tensor of the file `reader` (a NumpyHandle) opened, each viewing its
        array. An array torch takes as it is becomes a tensor at once; only the
        others (uint8, which may hold a packed dtype, ml_dtypes' dtypes, unaligned
        arrays) ask the header for their TensorInfo: making one for each of 10,000
        small tensors took longer than viewing them all."""
        arrays = reader.get_tensors()
        tensors: Dict[str, torch.Tensor] = {}
        takes, from_numpy = torch_takes_as_is(), torch.from_numpy
        try:
            for name, array in arrays.items():
                if array.dtype in takes and array.flags.behaved:
                    tensors[name] = from_numpy(array)
                else:
                    tensors[name] = tensor_of(array, name, reader.info(name))
        except SafetensorError as error:
            raise type(error)(f"{reader.source}: {error}") from None
        return tensors


@functools.lru_cache(maxsize=None)
def torch_takes_as_is() -> FrozenSet[np.dtype]:
    """The NumPy dtypes whose C-contiguous, aligned, writable arrays
    ``torch.from_numpy`` views as they are, as tensors of the same dtype: not
    uint8 (a packed dtype's bytes, which take a ``.view``) nor ml_dtypes' dtypes."""
    return frozenset(np.dtype(name) for name in NUMPY_VIEWS_TORCH if name != "uint8")


class TorchDeviceConverter:
    """The converter to torch tensors on a device other than the CPU and CUDA: each
    CPU tensor moved there with ``.to``."""

    uses_ml_dtypes = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, array: npt.NDArray[Any], name: str, info: TensorInfo) -> torch.Tensor:
        return tensor_of(array, name, info).to(self.device)


class TorchCudaConverter:
    """The converter to torch tensors on a CUDA device: one tensor through the pinned ring
    (large ones; small ones with ``.to``), or, with ``convert_file``, every
    tensor of an open file through one ring (see ``fastst._frameworks.cuda``)."""

    uses_ml_dtypes = False

    def __init__(self, device: torch.device) -> None:
        from . import cuda as _cuda   # only when CUDA is asked for

        self.device = device
        self.load_handle = _cuda.load_handle
        self.to_device = _cuda.to_device

    def __call__(self, array: npt.NDArray[Any], name: str, info: TensorInfo) -> torch.Tensor:
        return self.to_device(tensor_of(array, name, info), self.device)

    def convert_file(self, reader: Any) -> Dict[str, torch.Tensor]:
        """Every tensor of the file `reader` (a NumpyHandle) opened, on the device."""
        tensors: Dict[str, torch.Tensor] = self.load_handle(reader, self.device)
        return tensors


def tensor_of(array: npt.NDArray[Any], name: str, info: TensorInfo) -> torch.Tensor:
    """The CPU tensor of fastst's NumPy array for tensor `name` (described by
    `info`), viewing its memory. A bfloat16 or float8 array may be ml_dtypes' or
    hold the bits (see ``Reader.uses_ml_dtypes``): either is viewed the same way."""
    if not array.flags.behaved or (array.ndim and min(array.strides) < 0):
        array = np.array(array, order="C")   # torch wants writable, aligned, forward strides
    if info.dtype in FROM_ML_DTYPES:
        integer = np.dtype(SAME_WIDTH_INTEGER[array.dtype.itemsize])
        return torch.from_numpy(array.view(integer)).view(
            torch_dtype(info.dtype, f"tensor {name!r}"))
    if array.dtype == np.uint8 and info.dtype in PACKED_PAIRS:
        if info.array_shape is None or len(info.array_shape) != len(info.shape):
            raise SafetensorError(
                f"tensor {name!r}: F4 {info.shape} cannot be a torch.float4_e2m1fn_x2 tensor, "
                f"which packs two values a byte along the last dim: that dim must be even")
        return torch.from_numpy(array).view(torch_dtype(info.dtype, f"tensor {name!r}"))
    # F6_*: torch has no 6-bit dtype; the packed bytes come as uint8, as in NumPy
    return torch.from_numpy(array)


def target_device(device: Any) -> Optional[torch.device]:
    """None for the CPU, else the torch.device to move tensors to, checked usable."""
    if isinstance(device, str) and device == "cpu":
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise SafetensorError(f"device must be a str, an int or a torch.device, got {device!r}")
    try:
        # an int is a CUDA device index, as in safetensors
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError) as error:
        raise SafetensorError(f"invalid device {device!r}: {error}") from None
    if target.type == "cpu":
        return None
    if target.type == "meta":
        return target
    if target.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA" if torch.version.cuda is None
                   else "no CUDA device is visible")
            raise RuntimeError(f"device {device!r} is not available: {why} "
                               f"(torch {torch.__version__}); load with device='cpu'")
        if target.index is not None and target.index >= torch.cuda.device_count():
            raise RuntimeError(f"device {device!r} is not available: only "
                               f"{torch.cuda.device_count()} CUDA device(s)")
        return target
    backend = getattr(torch, target.type, None)
    is_available = getattr(backend, "is_available", None)
    if callable(is_available) and not is_available():
        raise RuntimeError(f"device {device!r} is not available to torch {torch.__version__}; "
                           f"load with device='cpu'")
    return target


def spec_of_tensor(name: Any, tensor: torch.Tensor) -> WriteSpec:
    """The ``WriteSpec`` that writes a torch tensor: its header code and shape,
    and a NumPy view of its bytes on the CPU.

    A tensor on another device is copied to the CPU; a CPU tensor is viewed,
    not copied (through a same-width integer for the dtypes NumPy lacks).

    Parameters
    ----------
    name : str
        The tensor's name.
    tensor : torch.Tensor
        Any dtype of ``fastst.DTYPES`` that torch has; ``float4_e2m1fn_x2``
        is written with its last axis doubled (two values an element).

    Returns
    -------
    WriteSpec

    Raises
    ------
    SafetensorTypeError
        When the tensor's dtype has no safetensors code.
    SafetensorNotImplementedError
        For a tensor on the meta device, which has no data.

    Examples
    --------
    >>> import torch
    >>> from fastst.torch import spec_of_tensor
    >>> spec = spec_of_tensor("w", torch.ones(2, dtype=torch.bfloat16))
    >>> spec.dtype, spec.shape, spec.data.dtype
    ('BF16', [2], dtype('int16'))
    """
    if tensor.device.type == "meta":
        # the reference's words (torch's own), which code written for it looks for
        raise SafetensorNotImplementedError(
            f"tensor {name!r} is on the meta device and has no data to save (Cannot copy out "
            f"of meta tensor; no data!)")
    code = codes_of_torch().get(tensor.dtype)
    if code is None:
        raise SafetensorTypeError(f"tensor {name!r}: {tensor.dtype} has no safetensors dtype")
    shape = list(tensor.shape)
    if code in PACKED_PAIRS:   # two values a byte, along the last dim
        if not shape:
            raise ValueError(f"tensor {name!r}: a 0-d torch.float4_e2m1fn_x2 tensor has no "
                             f"last dim to hold its two values")
        shape[-1] *= 2
    # the core's attribute: a named tuple made on its first use, by a save, not a load
    return _core.WriteSpec(name, code, shape, bytes_of(tensor))


def bytes_of(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A NumPy array over `tensor`'s memory (copied to the CPU first if need be),
    of a dtype of the same width that NumPy knows."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    if str(tensor.dtype).replace("torch.", "", 1) not in NUMPY_VIEWS_TORCH:
        tensor = tensor.view(same_width_torch(tensor.element_size()))
    array: npt.NDArray[Any] = tensor.numpy()
    return array


def piece_of_tensor(tensor: torch.Tensor) -> Tuple[npt.NDArray[Any], Optional[str]]:
    """What writers take a piece of a tensor as (``StreamWriter.write``): a NumPy
    array over its bytes (copied to the CPU if need be) of the NumPy dtype its code
    surfaces as, and None; for bfloat16 and float8, which NumPy has only from
    ml_dtypes, the unsigned integers of their bits, and the header code."""
    code = codes_of_torch().get(tensor.dtype)
    if code is None or code in PACKED_PAIRS:
        return np.asarray(tensor), None      # NumPy's own error says why it cannot
    raw = tensor.detach().cpu().view(same_width_torch(tensor.element_size())).numpy()
    if code in FROM_ML_DTYPES:
        return raw.view(f"<u{raw.itemsize}"), code
    return raw.view(numpy_dtype(code)), None


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
