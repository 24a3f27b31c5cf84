"""Drop-in replacement for ``safetensors.torch``: the same functions and signatures,
with tensors that view the file instead of copies of it.

Loading goes through fastst's NumPy views: a CPU tensor shares the file's private
map (``torch.from_numpy``, through a same-width integer view for bfloat16 and
float8), so loading copies nothing. Saving hands each tensor's memory to fastst's
writer through a NumPy view of it, one tensor at a time.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

import numpy as np
import numpy.typing as npt

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fastst.torch needs PyTorch: pip install torch") from error

import ml_dtypes
import orjson

from . import _api, _core
from ._core import DTYPE_CODES, SafetensorError

__all__ = ["save", "save_file", "load", "load_file", "save_model", "load_model", "converter"]

PathLike = Union[str, "os.PathLike[str]"]
Entry = Callable[[str], Tuple[str, List[int], Tuple[int, int], Optional[Tuple[int, ...]]]]

# ---------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------

# header code -> torch dtype; None where this torch lacks the dtype
_TORCH_DTYPES: Dict[str, Optional[torch.dtype]] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
    "I16": torch.int16, "U16": getattr(torch, "uint16", None), "F16": torch.float16,
    "BF16": torch.bfloat16, "I32": torch.int32, "U32": getattr(torch, "uint32", None),
    "F32": torch.float32, "C64": torch.complex64, "F64": torch.float64,
    "I64": torch.int64, "U64": getattr(torch, "uint64", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    "F4": getattr(torch, "float4_e2m1fn_x2", None),
}
_FLOAT4 = _TORCH_DTYPES["F4"]

# NumPy dtypes NumPy has no torch twin for (ml_dtypes'): the same-width integer
# dtype both sides share, and the header code.
_VIA_INTEGER = {
    np.dtype(ml_dtypes.bfloat16): (np.dtype(np.int16), torch.int16, "BF16"),
    np.dtype(ml_dtypes.float8_e5m2): (np.dtype(np.uint8), torch.uint8, "F8_E5M2"),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.dtype(np.uint8), torch.uint8, "F8_E4M3"),
    np.dtype(ml_dtypes.float8_e8m0fnu): (np.dtype(np.uint8), torch.uint8, "F8_E8M0"),
    np.dtype(ml_dtypes.float8_e4m3fnuz): (np.dtype(np.uint8), torch.uint8, "F8_E4M3FNUZ"),
    np.dtype(ml_dtypes.float8_e5m2fnuz): (np.dtype(np.uint8), torch.uint8, "F8_E5M2FNUZ"),
}

# torch dtype -> how its memory is seen from NumPy for writing: (torch dtype of
# the same width NumPy knows, NumPy dtype to view that as).
_TO_NUMPY: Dict[torch.dtype, Tuple[torch.dtype, np.dtype]] = {}
for _code, _dtype in _TORCH_DTYPES.items():
    if _dtype is None or _code == "F4":
        continue
    _numpy_dtype = _core.numpy_dtype(_code)
    _through = _VIA_INTEGER.get(_numpy_dtype)
    _TO_NUMPY[_dtype] = (_dtype if _through is None else _through[1], _numpy_dtype)
if _FLOAT4 is not None:
    _TO_NUMPY[_FLOAT4] = (torch.uint8, np.dtype(np.uint8))
del _code, _dtype, _numpy_dtype, _through

# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def converter(device: Any = "cpu") -> Callable[[npt.NDArray[Any], str, Entry], torch.Tensor]:
    """The function safe_open(framework="pt") passes each NumPy view through.

    On the CPU the tensor views the array's memory; read-only arrays (views of
    ``bytes``) are copied, since torch tensors are always writable. Any other
    device gets a copy, moved there with ``.to(device)``; on a CUDA device large
    tensors go through a ring of pinned buffers filled by several threads.
    """
    target = _target_device(device)
    if target is not None and target.type == "cuda":
        from . import _cuda   # only when CUDA is asked for

    def convert(array: npt.NDArray[Any], name: str, entry: Entry) -> torch.Tensor:
        tensor = _tensor_of(array, name, entry)
        if target is not None and target.type == "cuda":
            return _cuda.to_device(tensor, target)   # large ones through the pinned ring
        return tensor if target is None else tensor.to(target)

    return convert


def _tensor_of(array: npt.NDArray[Any], name: str, entry: Entry) -> torch.Tensor:
    if not array.flags.behaved or (array.ndim and min(array.strides) < 0):
        array = np.array(array, order="C")   # torch wants writable, aligned, forward strides
    through = _VIA_INTEGER.get(array.dtype)
    if through is not None:
        numpy_int, _, code = through
        return torch.from_numpy(array.view(numpy_int)).view(_torch_dtype(code, name))
    if array.dtype == np.uint8:
        code, shape, _, array_shape = entry(name)
        if code == "F4":
            if array_shape is None or len(array_shape) != len(shape):
                raise SafetensorError(
                    f"tensor {name!r}: F4 {shape} cannot be a torch.float4_e2m1fn_x2 tensor, "
                    f"which packs two values a byte along the last dim: that dim must be even")
            return torch.from_numpy(array).view(_torch_dtype(code, name))
        # F6_*: torch has no 6-bit dtype; the packed bytes come as uint8, as in NumPy
    return torch.from_numpy(array)


def _torch_dtype(code: str, name: str) -> torch.dtype:
    dtype = _TORCH_DTYPES[code]
    if dtype is None:
        raise SafetensorError(f"tensor {name!r}: this torch ({torch.__version__}) has no dtype "
                              f"for {code}")
    return dtype


def _target_device(device: Any) -> Optional[torch.device]:
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


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu", *,
              backend: str = "mmap") -> Dict[str, torch.Tensor]:
    """Load every tensor of a file as torch tensors.

    On the CPU (the default) the tensors view the file's private map: nothing is
    copied or read until used, writes stay in this process, and the tensors stay
    valid however long they live. On another device each tensor is moved there.
    ``backend="pread"`` reads each tensor into memory of its own instead.
    A CUDA device gets one allocation holding every tensor, streamed from the file.
    """
    target = _target_device(device)
    if target is not None and target.type == "cuda":
        from . import _cuda   # only when CUDA is asked for
        return _cuda.load_file(filename, target, backend=backend)
    with _api.safe_open(filename, framework="pt", device=device, backend=backend) as f:
        tensors: Any = f.get_tensors()   # torch tensors: the handle converts its views
        return tensors  # type: ignore[no-any-return]


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """Load tensors from the bytes of a safetensors file.

    Tensors from read-only data (``bytes``) are copies; from a writable buffer
    (``bytearray``) they view it, as ``fastst.load``'s arrays do.
    """
    reader = _core.Reader()
    reader.open_buffer(data)
    convert = converter("cpu")
    entry = reader.info
    return {name: convert(array, name, entry) for name, array in reader.get_tensors().items()}


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The bytes of a safetensors file holding `tensors`, identical to what
    ``safetensors.torch.save`` gives for the same tensors.

    Tensors may live on any device and need not be contiguous; tensors that share
    memory raise RuntimeError (see ``save_model``).
    """
    return _core.serialize(*_plan(tensors, metadata))


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike,
              metadata: Optional[Dict[str, str]] = None, *, fsync: bool = False) -> None:
    """Write `tensors` to `filename` atomically (as ``fastst.save_file`` does, with
    its `fsync` option), in the bytes ``safetensors.torch.save_file`` writes. Each
    tensor is written straight from its memory."""
    _api._write_planned(_plan(tensors, metadata), filename, fsync)


def _plan(tensors: Dict[str, torch.Tensor], metadata: Optional[Mapping[str, str]]
          ) -> Tuple[bytes, List[Any], int]:
    _check_for_save(tensors)
    arrays: Dict[str, Any] = {}
    float4: Set[str] = set()
    for name, tensor in tensors.items():
        arrays[name] = _numpy_of(name, tensor)
        if _FLOAT4 is not None and tensor.dtype == _FLOAT4:
            float4.add(name)
    plan = _core.plan_write(arrays, metadata)
    return _recode_float4(plan, float4) if float4 else plan


def _numpy_of(name: Any, tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A NumPy array over `tensor`'s memory (on the CPU), of its header dtype."""
    if tensor.device.type == "meta":
        raise ValueError(f"tensor {name!r} is on the meta device and has no data to save")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    spec = _TO_NUMPY.get(tensor.dtype)
    if spec is None:
        raise TypeError(f"tensor {name!r}: {tensor.dtype} has no safetensors dtype")
    through, numpy_dtype = spec
    if through is not tensor.dtype:
        if _FLOAT4 is not None and tensor.dtype == _FLOAT4 and tensor.dim() == 0:
            raise ValueError(f"tensor {name!r}: a 0-d torch.float4_e2m1fn_x2 tensor has no "
                             f"last dim to hold its two values")
        tensor = tensor.view(through)
    array: npt.NDArray[Any] = tensor.numpy()
    return array if array.dtype == numpy_dtype else array.view(numpy_dtype)


def _recode_float4(plan: Tuple[bytes, List[Any], int], names: Set[str]
                   ) -> Tuple[bytes, List[Any], int]:
    """Turn the U8 entries of float4_e2m1fn_x2 tensors into F4 ones (two values a
    byte: the last dim doubled), then re-order and re-offset as the format's
    writers do (dtype rank descending, then name)."""
    prefix, arrays, total = plan
    header = orjson.loads(prefix[8:])
    metadata = header.pop("__metadata__", None)
    rank = {code: i for i, code in enumerate(DTYPE_CODES)}
    entries = []
    for (name, info), array in zip(header.items(), arrays):
        if name in names:
            info["dtype"] = "F4"
            info["shape"][-1] *= 2
        entries.append((-rank[info["dtype"]], name, info, array))
    entries.sort(key=lambda item: (item[0], item[1]))
    rebuilt: Dict[str, Any] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for _, name, info, array in entries:
        size = info["data_offsets"][1] - info["data_offsets"][0]
        info["data_offsets"] = [offset, offset + size]
        offset += size
        rebuilt[name] = info
    text = orjson.dumps(rebuilt)
    padded = (len(text) + 7) // 8 * 8
    new_prefix = padded.to_bytes(8, "little") + text + b" " * (padded - len(text))
    return new_prefix, [item[3] for item in entries], total


# ---------------------------------------------------------------------------
# Shared storage: tensors that view the same memory
# ---------------------------------------------------------------------------

_SHARED_ERROR = (
    "Some tensors share memory, this will lead to duplicate memory on disk and potential "
    "differences when loading them again: {groups}.\n"
    "A potential way to correctly save your model is to use `save_model`.\n"
    "More information at https://huggingface.co/docs/safetensors/torch_shared_tensors")


def _check_for_save(tensors: Any) -> None:
    if not isinstance(tensors, dict):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    sparse = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received "
                             f"{type(tensor)}")
        if tensor.layout != torch.strided:
            sparse.append(name)
    if sparse:
        raise ValueError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            f"support. You can make it a dense tensor before saving with `.to_dense()` but be "
            f"aware this might make a much larger file than needed.")
    shared = [group for group in _find_shared_tensors(tensors) if len(group) > 1]
    if shared:
        raise RuntimeError(_SHARED_ERROR.format(groups=shared))


def _storage(tensor: torch.Tensor) -> Tuple[int, int]:
    """(address, bytes) of the storage under `tensor`; (0, 0) when it has none."""
    if tensor.device.type == "meta":
        return 0, 0
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):
        return 0, 0


def _byte_range(tensor: torch.Tensor) -> Tuple[int, int]:
    """[first, last) bytes the tensor's elements occupy."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start, start + (reach + 1) * tensor.element_size()


def _find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> List[Set[str]]:
    """Names grouped by the memory they overlap: one set per group, a set of one
    for a tensor alone in its memory. Tensors without memory (meta, empty) are left out."""
    by_storage: Dict[Tuple[Any, int, int], List[str]] = {}
    for name, tensor in state_dict.items():
        ptr, size = _storage(tensor)
        if ptr and size:
            by_storage.setdefault((tensor.device, ptr, size), []).append(name)
    groups: List[Set[str]] = []
    for names in by_storage.values():
        if len(names) == 1:
            groups.append(set(names))
            continue
        areas = sorted(_byte_range(state_dict[name]) + (name,) for name in names)
        reach = -1
        for start, stop, name in areas:
            if start < reach:
                groups[-1].add(name)
            else:
                groups.append({name})
            reach = max(reach, stop)
    return groups


def _covers_storage(tensor: torch.Tensor) -> bool:
    ptr, size = _storage(tensor)
    return tensor.data_ptr() == ptr and tensor.numel() * tensor.element_size() == size


def _remove_duplicate_names(state_dict: Mapping[str, torch.Tensor], *,
                            preferred_names: Optional[Iterable[str]] = None,
                            discard_names: Optional[Iterable[str]] = None
                            ) -> Dict[str, List[str]]:
    """For each group of tensors sharing memory, the name to keep (one covering
    the whole storage; among those, preferred names first, discarded names last,
    then the first in sorted order) -> the other names, sorted."""
    preferred = set(preferred_names or ())
    discarded = set(discard_names or ())
    removals: Dict[str, List[str]] = {}
    for group in _find_shared_tensors(state_dict):
        complete = sorted(name for name in group if _covers_storage(state_dict[name]))
        if not complete:
            raise RuntimeError(
                f"Error while trying to find names to remove to save state dict, but found no "
                f"suitable name to keep for saving amongst: {group}. None is covering the "
                f"entire storage. Refusing to save/load the model since you could be storing "
                f"much more memory than needed. Please refer to "
                f"https://huggingface.co/docs/safetensors/torch_shared_tensors for more "
                f"information.")
        candidates = ([n for n in complete if n in preferred]
                      or [n for n in complete if n not in discarded] or complete)
        keep = candidates[0]
        others = sorted(name for name in group if name != keep)
        if others:
            removals[keep] = others
    return removals


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def save_model(model: torch.nn.Module, filename: PathLike,
               metadata: Optional[Dict[str, str]] = None, force_contiguous: bool = True) -> None:
    """Save a model's state dict, keeping one name for tensors that share memory
    (tied weights).

    Each dropped name goes into the metadata as ``dropped: kept`` (unless
    `metadata` already has that key); ``load_model`` ties them back. With
    `force_contiguous` (the default) tensors are made contiguous first, which
    changes nothing in the file: non-contiguous tensors are written as C-ordered
    data either way.
    """
    state_dict = model.state_dict()
    removals = _remove_duplicate_names(state_dict)
    if removals:
        metadata = dict(metadata) if metadata is not None else {}
        for kept, dropped in removals.items():
            for name in dropped:
                metadata.setdefault(name, kept)
                del state_dict[name]
    if force_contiguous:
        state_dict = {name: tensor.contiguous() for name, tensor in state_dict.items()}
    save_file(state_dict, filename, metadata=metadata)


def load_model(model: torch.nn.Module, filename: PathLike, strict: bool = True,
               device: Union[str, int, torch.device] = "cpu", *, backend: str = "mmap"
               ) -> Tuple[List[str], List[str]]:
    """Load a file into `model`, as saved by ``save_model``.

    Returns ``(missing, unexpected)``: names of the model the file did not fill,
    and names in the file the model has no place for. Names the model ties to
    another (sharing its memory) count as filled when that other is. With `strict`
    (the default) either being non-empty raises RuntimeError.
    """
    state_dict = load_file(filename, device=device, backend=backend)
    removals = _remove_duplicate_names(model.state_dict(), preferred_names=state_dict.keys())
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = list(missing)
    unexpected = list(unexpected)
    for dropped in removals.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                f'"{name}"' for name in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                f'"{name}"' for name in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected
