"""Drop-in replacement for ``safetensors.torch``: the same functions and signatures,
with tensors that view the file instead of copies of it.

Loading goes through fastst's NumPy views: a CPU tensor shares the file's private
map (``torch.from_numpy``, through a same-width integer view for bfloat16 and
float8), so loading copies nothing. Saving hands each tensor's memory to fastst's
writer through a NumPy view of it, one tensor at a time.

Examples
--------
>>> import torch, tempfile, os
>>> from fastst.torch import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> save_file({"w": torch.ones(2, 2, dtype=torch.bfloat16)}, path)
>>> load_file(path)["w"]
tensor([[1., 1.],
        [1., 1.]], dtype=torch.bfloat16)
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple, Union

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("fastst.torch needs PyTorch: pip install torch") from error

import numpy as np

from ._api import LOWLEVEL, lowlevel_name, safe_open
from ._core import DTYPES, Reader, WritePlan
from ._format.torch_dtypes import torch_dtypes
from ._frameworks.torch import bytes_of, converter, spec_of_tensor, target_device
from ._io.files import write_atomically
from ._io.limits import DEFAULT_BACKEND
from ._io.source import as_source

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._format.lowlevel import TensorSpec, deserialize, serialize, serialize_file
    from ._handles.protocols import Backend

    PathLike = Union[str, os.PathLike[str]]

__all__ = ["save", "save_file", "load", "load_file", "save_model", "load_model", "converter",
           "spec_of_tensor", "storage_ptr", "storage_size", "TORCH_DTYPES", "safe_open",
           "serialize", "serialize_file", "deserialize", "TensorSpec"]


# serialize, deserialize... (fastst._api.LOWLEVEL): imported on first use
def __getattr__(name: str) -> Any:
    return lowlevel_name(__name__, name, globals())


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(LOWLEVEL))


TORCH_DTYPES: Dict[str, Optional[torch.dtype]] = torch_dtypes()
"""Header dtype code -> torch dtype, for every code of ``fastst.DTYPES``: None where
torch, or this version of it, has none (the F6 codes, which load as their packed bytes,
``torch.uint8``). ``"F4"`` is ``torch.float4_e2m1fn_x2``, whose elements hold two
values each."""

# The reference's own tables under its names, which libraries import from
# safetensors.torch (vLLM, torch's distributed checkpoint): header code -> torch dtype
# where a torch element is one header element (float4 packs two: left out, as
# there), torch dtype -> bytes an element.
_TYPES: Dict[str, torch.dtype] = {
    row.code: TORCH_DTYPES[row.code] for row in DTYPES
    if TORCH_DTYPES[row.code] is not None and TORCH_DTYPES[row.code].itemsize * 8 == row.bits}
_SIZE: Dict[torch.dtype, int] = {dtype: dtype.itemsize for dtype in TORCH_DTYPES.values()
                                 if dtype is not None}


def _getdtype(dtype_str: str) -> torch.dtype:
    return _TYPES[dtype_str]


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _streamed_cuda_device(device: Any, filename: Any) -> Optional[torch.device]:
    """The CUDA device a local file (or checkpoint) streams to through the pinned
    ring; None for any other device, or a URL or file object."""
    target = target_device(device)
    if target is not None and target.type == "cuda" and \
            as_source(filename).local_path is not None:
        return target
    return None


def _opened_for_ring(filename: PathLike, backend: Backend) -> Any:
    """The file or checkpoint opened for the CUDA ring, which reads its header and
    its bytes: its bfloat16 and float8 arrays hold their bits, and ml_dtypes is not
    imported."""
    from .checkpoint import open_checkpoint

    return open_checkpoint(filename, backend=backend, uses_ml_dtypes=False)


def load_file(filename: PathLike, device: Union[str, int, torch.device] = "cpu", *,
              backend: Backend = DEFAULT_BACKEND) -> Dict[str, torch.Tensor]:
    """Load every tensor of a file, or of a sharded checkpoint, as torch tensors.

    The drop-in for ``safetensors.torch.load_file``. On the CPU (the default)
    the tensors view the file's private map: nothing is copied, writes stay in
    this process, and the tensors stay valid however long they live; a thread
    reads the file's pages in the background, in order, so that using the
    tensors seldom waits for the disk (see ``fastst.read_options``). On another
    device each tensor is moved there; a CUDA device gets one allocation
    holding every tensor, streamed from the file through a ring of pinned
    buffers.

    Parameters
    ----------
    filename : str or os.PathLike
        A ``.safetensors`` file, or a sharded checkpoint (its directory or
        ``*.index.json``); a URL or file object as ``fastst.safe_open`` takes.
    device : str or int or torch.device, default "cpu"
        Where the tensors go (``"cuda:0"``, ``0``, ``"meta"``...).
    backend : "mmap" or "pread", default "mmap"
        ``"pread"`` reads each tensor into memory of its own instead of
        viewing the map.

    Returns
    -------
    dict of str to torch.Tensor
        Every tensor, in the order of its bytes in the file.

    Raises
    ------
    FileNotFoundError
        When the file does not exist.
    SafetensorError
        When the file breaks a rule of the format, or this torch has no dtype
        for a tensor's; when `device` is not a device.
    RuntimeError
        When `device` is not available (no CUDA).

    Examples
    --------
    >>> import torch, fastst.torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.torch.save_file({"b": torch.arange(3), "w": torch.eye(2)}, path)
    >>> fastst.torch.load_file(path)
    {'b': tensor([0, 1, 2]), 'w': tensor([[1., 0.],
            [0., 1.]])}
    """
    target = _streamed_cuda_device(device, filename)
    if target is not None:
        from ._frameworks import cuda as _cuda   # only when CUDA is asked for
        with _opened_for_ring(filename, backend) as opened:
            return _cuda.load_all(opened, target)
    with safe_open(filename, framework="pt", device=device, backend=backend) as f:
        return f.get_tensors()


def load(data: bytes) -> Dict[str, torch.Tensor]:
    """Load the tensors of a safetensors file held in memory.

    The drop-in for ``safetensors.torch.load``. Tensors from read-only data
    (``bytes``) are copies, since torch tensors are always writable; from a
    writable buffer (``bytearray``) they view it, as ``fastst.load``'s arrays
    do.

    Parameters
    ----------
    data : bytes-like object
        The whole file.

    Returns
    -------
    dict of str to torch.Tensor
        Every tensor, in the order of its bytes in `data`.

    Raises
    ------
    SafetensorError
        When the bytes break a rule of the format.

    Examples
    --------
    >>> import torch, fastst.torch
    >>> data = fastst.torch.save({"x": torch.tensor([1.5, 2.5])})
    >>> fastst.torch.load(data)
    {'x': tensor([1.5000, 2.5000])}
    """
    reader = Reader()
    reader.uses_ml_dtypes = False   # torch views the bits of bfloat16 and float8 as its own
    reader.open_buffer(data)
    convert = converter("cpu")
    return {name: convert(array, name, reader.info(name))
            for name, array in reader.get_tensors().items()}


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------


def save(tensors: Dict[str, torch.Tensor], metadata: Optional[Dict[str, str]] = None, *,
         checksum: Optional[str] = None, align: Optional[int] = None) -> bytes:
    """Serialize torch tensors into the bytes of a safetensors file.

    The drop-in for ``safetensors.torch.save``, with the same bytes. Tensors
    may live on any device and need not be contiguous.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        The tensors, by name.
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata (see ``fastst.save``).
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).

    Returns
    -------
    bytes
        The whole file.

    Raises
    ------
    RuntimeError
        When tensors share memory (tied weights: see `save_model`), as the
        reference raises.
    ValueError
        When `tensors` is not a dict of tensors, or a tensor is sparse.
    SafetensorNotImplementedError
        For a tensor on the meta device, which has no data.
    SafetensorTypeError
        For a dtype the format has no code for.

    Examples
    --------
    >>> import torch, fastst.torch
    >>> data = fastst.torch.save({"x": torch.zeros(2)}, {"format": "pt"})
    >>> len(data), fastst.torch.load(data)
    (104, {'x': tensor([0., 0.])})
    """
    return _plan(tensors, metadata, checksum, align).to_bytes()


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike,
              metadata: Optional[Dict[str, str]] = None, *, fsync: bool = False,
              max_shard_size: Union[int, str, None] = None, checksum: Optional[str] = None,
              align: Optional[int] = None) -> None:
    """Write torch tensors to a safetensors file, atomically.

    The drop-in for ``safetensors.torch.save_file``, with the same bytes;
    written as ``fastst.save_file`` writes (beside the target, then renamed
    over it). Each tensor is written straight from its memory.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        The tensors, by name (see `save`).
    filename : str or os.PathLike
        The file to write.
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk before returning.
    max_shard_size : int or str, optional
        Bytes, or a size such as ``"5GB"``: `filename` is then a directory
        (or ``DIR/NAME.safetensors``) and the files are those
        ``huggingface_hub.save_torch_state_dict`` writes there, byte for
        byte: shards cut as it cuts them, each with ``{"format": "pt"}`` as
        metadata, and an index whose metadata is ``total_size`` then
        `metadata` (one file and no index when everything fits in one shard).
        See ``fastst.checkpoint``.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata.
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (each shard's, with `max_shard_size`); see ``fastst.save``.

    Raises
    ------
    RuntimeError
        When tensors share memory (see `save_model`).
    ValueError
        When `tensors` is not a dict of tensors, or a tensor is sparse.
    OSError
        When the file cannot be written; the old file stays.

    Examples
    --------
    >>> import torch, fastst.torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.torch.save_file({"w": torch.ones(3)}, path, metadata={"epoch": "2"})
    >>> with fastst.safe_open(path, framework="pt") as f:
    ...     f.metadata(), f.get_tensor("w")
    ({'epoch': '2'}, tensor([1., 1., 1.]))
    """
    if max_shard_size is not None:
        from .checkpoint import ShardEntry, save_checkpoint   # a capability: imported when used

        _check_for_save(tensors)
        entries = [ShardEntry(spec_of_tensor(name, tensor), storage_size(tensor),
                              None if tensor.device.type == "meta" else
                              (tensor.device, storage_ptr(tensor), storage_size(tensor)))
                   for name, tensor in tensors.items()]
        save_checkpoint(entries, filename, max_shard_size=max_shard_size, metadata=metadata,
                        shard_metadata={"format": "pt"}, fsync=fsync, checksum=checksum,
                        align=align)
        return
    write_atomically(_plan(tensors, metadata, checksum, align), filename, fsync=fsync)


def _plan(tensors: Dict[str, torch.Tensor], metadata: Optional[Mapping[str, str]],
          checksum: Optional[str] = None, align: Optional[int] = None) -> WritePlan:
    from ._format.checksums import plan_with_checksums   # a save's, not a load's

    _check_for_save(tensors)
    specs = [spec_of_tensor(name, tensor) for name, tensor in tensors.items()]
    return plan_with_checksums(specs, metadata, checksum, align=align)


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


def storage_ptr(tensor: torch.Tensor) -> int:
    """The address of the storage under a tensor, as ``safetensors.torch`` has it.

    Parameters
    ----------
    tensor : torch.Tensor

    Returns
    -------
    int
        0 when the tensor has no storage data (meta, sparse).

    Examples
    --------
    >>> import torch
    >>> from fastst.torch import storage_ptr
    >>> x = torch.arange(4)
    >>> storage_ptr(x[2:]) == storage_ptr(x) == x.data_ptr()
    True
    >>> storage_ptr(torch.empty(2, device="meta"))
    0
    """
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def storage_size(tensor: torch.Tensor) -> int:
    """The bytes of the storage under a tensor (a meta tensor's storage has a size
    too), as ``safetensors.torch`` has it.

    Parameters
    ----------
    tensor : torch.Tensor

    Returns
    -------
    int

    Examples
    --------
    >>> import torch
    >>> from fastst.torch import storage_size
    >>> x = torch.arange(4, dtype=torch.int32)
    >>> storage_size(x), storage_size(x[:1])
    (16, 16)
    """
    return int(tensor.untyped_storage().nbytes())


def _to_ndarray(tensor: torch.Tensor) -> Tuple[npt.NDArray[np.uint8], torch.Tensor]:
    """The reference's helper under its name, which diffusers calls: a flat uint8
    array viewing the tensor's bytes, and the CPU tensor that holds them. A tensor
    on another device is copied to the CPU, and one that is not contiguous into one
    that is: its bytes come in the order of its elements, where the reference's
    would be its storage's."""
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return bytes_of(tensor).reshape(-1).view(np.uint8), tensor


def _end_ptr(tensor: torch.Tensor) -> int:
    """The address just past the tensor's last element (its start when empty)."""
    start = int(tensor.data_ptr())
    if tensor.numel() == 0:
        return start
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return start + (reach + 1) * tensor.element_size()


def _is_complete(tensor: torch.Tensor) -> bool:
    """Whether `tensor` starts where its storage starts and spans all of it."""
    return (tensor.data_ptr() == storage_ptr(tensor)
            and tensor.numel() * tensor.element_size() == storage_size(tensor))


def _filter_shared_not_shared(tensors: List[Set[str]],
                              state_dict: Mapping[str, torch.Tensor]) -> List[Set[str]]:
    """Split each group of names sharing a storage into runs that overlap: in
    order of (start, end, name), a tensor joins the run before it when it starts
    before the end of the tensor just before it, as safetensors decides."""
    runs: List[Set[str]] = []
    for group in tensors:
        if len(group) < 2:
            runs.append(group)
            continue
        areas = sorted((state_dict[name].data_ptr(), _end_ptr(state_dict[name]), name)
                       for name in group)
        previous_end = None
        for start, end, name in areas:
            if previous_end is not None and start < previous_end:
                runs[-1].add(name)
            else:
                runs.append({name})
            previous_end = end
    return runs


def _find_shared_tensors(state_dict: Mapping[str, torch.Tensor]) -> List[Set[str]]:
    """Names grouped by the memory they overlap, in order of first appearance: a
    set of one for a tensor alone in its storage. Tensors without memory (meta,
    empty storage) are left out."""
    by_storage: Dict[Tuple[Any, int, int], Set[str]] = {}
    for name, tensor in state_dict.items():
        if tensor.device.type == "meta":
            continue
        ptr = storage_ptr(tensor)
        size = storage_size(tensor) if ptr else 0
        if size:
            by_storage.setdefault((tensor.device, ptr, size), set()).add(name)
    return _filter_shared_not_shared(list(by_storage.values()), state_dict)


def _remove_duplicate_names(state_dict: Mapping[str, torch.Tensor], *,
                            preferred_names: Optional[Iterable[str]] = None,
                            discard_names: Optional[Iterable[str]] = None
                            ) -> Dict[str, List[str]]:
    """For each group of tensors sharing memory, the name to keep (one covering
    the whole storage; among those, preferred names first, then names not
    discarded, then the first in sorted order) -> the other names, sorted."""
    preferred = set(preferred_names or ())
    discarded = set(discard_names or ())
    removals: Dict[str, List[str]] = defaultdict(list)
    for group in _find_shared_tensors(state_dict):
        complete = sorted(name for name in group if _is_complete(state_dict[name]))
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
        for name in sorted(group):
            if name != keep:
                removals[keep].append(name)
    return removals


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def save_model(model: torch.nn.Module, filename: PathLike,
               metadata: Optional[Dict[str, str]] = None, force_contiguous: bool = True, *,
               max_shard_size: Union[int, str, None] = None,
               checksum: Optional[str] = None, align: Optional[int] = None) -> None:
    """Save a model's state dict, keeping one name for tensors that share memory
    (tied weights).

    The drop-in for ``safetensors.torch.save_model``. Each dropped name goes
    into `metadata` as ``dropped: kept`` (unless it already has that key), as
    the reference does: the caller's dict itself gains those keys, or a new
    one is made when it is None; `load_model` ties the names back.

    Parameters
    ----------
    model : torch.nn.Module
        The model.
    filename : str or os.PathLike
        The file to write (a directory with `max_shard_size`).
    metadata : dict of str to str, optional
        The header's ``__metadata__``; gains the dropped names.
    force_contiguous : bool, default True
        Make tensors contiguous first, which changes nothing in the file:
        non-contiguous tensors are written as C-ordered data either way.
    max_shard_size : int or str, optional
        Save in shards, as ``huggingface_hub.save_torch_model`` saves (see
        `save_file`).
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata.
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).

    Raises
    ------
    RuntimeError
        When tensors share memory but none of them covers the whole storage
        (nothing to keep in its place), as the reference raises.
    OSError
        When the file cannot be written.

    Examples
    --------
    >>> import torch, fastst.torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> model = torch.nn.Module()
    >>> model.a, model.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> model.b.weight = model.a.weight                         # tied
    >>> metadata = {}
    >>> fastst.torch.save_model(model, path, metadata)
    >>> metadata
    {'b.weight': 'a.weight'}
    """
    state_dict = model.state_dict()
    for kept, dropped in _remove_duplicate_names(state_dict).items():
        if metadata is None:
            metadata = {}
        for name in dropped:
            metadata.setdefault(name, kept)   # into the caller's dict, as safetensors does
            del state_dict[name]
    if force_contiguous:
        state_dict = {name: tensor.contiguous() for name, tensor in state_dict.items()}
    save_file(state_dict, filename, metadata=metadata, max_shard_size=max_shard_size,
              checksum=checksum, align=align)


def load_model(model: torch.nn.Module, filename: PathLike, strict: bool = True,
               device: Union[str, int, torch.device] = "cpu", *, backend: Backend = DEFAULT_BACKEND
               ) -> Tuple[Set[str], List[str]]:
    """Load a file, or a sharded checkpoint's directory, into a model, as saved
    by `save_model`.

    The drop-in for ``safetensors.torch.load_model``. On a CUDA device, the
    file's tensors stream straight into the model's parameters and buffers
    that live there with the same dtype and shape, with no second copy on the
    device; the others load as `load_file` loads them, then into the model as
    ``load_state_dict`` does.

    Parameters
    ----------
    model : torch.nn.Module
        The model to fill.
    filename : str or os.PathLike
        The file, or a sharded checkpoint's directory or index.
    strict : bool, default True
        Raise when names are missing or unexpected.
    device : str or int or torch.device, default "cpu"
        Where the tensors are loaded.
    backend : "mmap" or "pread", default "mmap"
        How the file is read.

    Returns
    -------
    missing : set of str
        Names of the model the file did not fill (a set, as the reference
        returns it). Names the model ties to another (sharing its memory)
        count as filled when that other is.
    unexpected : list of str
        Names in the file the model has no place for.

    Raises
    ------
    RuntimeError
        With `strict`, when a name is missing or unexpected (as
        ``load_state_dict`` words it); when a shape does not match.
    FileNotFoundError
        When the file does not exist.

    Examples
    --------
    >>> import torch, fastst.torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> fastst.torch.save_model(source, path)
    >>> fastst.torch.load_model(target, path)
    (set(), [])
    >>> torch.equal(source.weight, target.weight)
    True
    """
    target = _streamed_cuda_device(device, filename)
    if target is not None:
        from ._frameworks import cuda as _cuda   # only when CUDA is asked for
        with _opened_for_ring(filename, backend) as opened:
            placed, state_dict = _cuda.load_into(model.state_dict(), opened, target)
    else:
        placed, state_dict = [], load_file(filename, device=device, backend=backend)
    removals = _remove_duplicate_names(model.state_dict(),
                                       preferred_names=[*placed, *state_dict])
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing) - set(placed)
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
