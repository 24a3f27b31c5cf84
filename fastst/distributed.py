"""Loading onto many devices: each JAX device, each ``torch.distributed`` rank,
reads only the bytes it owns.

Three ways, each with a plan to look at before loading (a `ReadPlan`: the byte
ranges each device or rank reads, and their sum against the files' size):

- **JAX shardings**: ``fastst.flax.load_file(path, shardings=...)`` and a JAX
  handle's ``get_tensor(name, sharding=...)`` read, for each addressable device,
  the bytes of its shard alone, a shard several devices hold once
  (`plan_shardings`).
- **Tensor-parallel ranks**: `load_tensor_parallel` gives each rank its slice of
  each tensor along the dimension a plan names (the others whole), reading only
  that slice (`plan_tensor_parallel`).
- **Split reads, then exchange**: `load_split` has each rank read about 1/world
  of the files' bytes, then the ranks exchange them (broadcasts on the process
  group), so that every rank ends with the whole state dict, the files read
  once in all (`plan_split`). For replicated models on cold disks or object
  stores, where reading is what costs.

The loaders take the process group from ``torch.distributed`` (gloo on CPUs,
NCCL into CUDA tensors), read single files, sharded checkpoints and URLs, and
fail the same way on every rank: the ranks agree on success before anything is
exchanged or returned, so that a rank that cannot read makes every rank raise a
`SafetensorError` naming it and the file, within the timeout; so does a rank killed
mid-load, named on gloo by the connection it closed.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> from fastst.distributed import plan_split, plan_tensor_parallel
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> fastst.save_file({"w": np.zeros((8, 4096), np.float32), "b": np.zeros(4096, np.float32)}, path)
>>> plan = plan_tensor_parallel(path, {"w": 1}, world_size=4)   # "b" on every rank
>>> [plan.bytes_of(rank) for rank in range(4)], round(plan.ratio, 2)
([49152, 49152, 49152, 49152], 1.34)
>>> plan_split(path, world_size=4).bytes_of(0)         # a quarter of each byte
36864
"""
from __future__ import annotations

import bisect
import hashlib
import os
from datetime import timedelta
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, NamedTuple,
                    Optional, Tuple, Union)

import numpy as np

from ._core import SafetensorError, TensorInfo
from ._format.blocks import (Box, Split, check_split, device_boxes, grouped, join_gap,
                             leading_index, packed_refusal, part_of, runs_of, whole, widened)
from ._io.limits import DEFAULT_BACKEND
from ._io.source import as_source
from .checkpoint import ShardedHandle, data_bytes, open_checkpoint

if TYPE_CHECKING:   # imported when used: JAX users need no torch, and torch users no JAX
    import numpy.typing as npt
    import torch

__all__ = ["Read", "ReadPlan", "load_split", "load_tensor_parallel", "plan_shardings",
           "plan_split", "plan_tensor_parallel"]

Dims = Union[Mapping[str, Optional[int]], Callable[[str], Optional[int]]]

# Each file's tensor data starts at a multiple of this in the stream split reads share
# out, so that tensors keep the alignment they have in their file.
STREAM_ALIGN = 64
# Bytes of each rank's part sent in one round of the exchange (one broadcast a rank):
# 4 to 16 MiB were the fastest on gloo over loopback.
ROUND_BYTES = 8 << 20
# What a rank tells the others when they agree: a failure's message, its layout's digest.
MESSAGE_BYTES = 1024
DIGEST_BYTES = 16
# The tag of the receives that find which ranks' connections closed (gloo).
PROBE_TAG = 0x5AFE


class Read(NamedTuple):
    """Bytes of one tensor that one device or rank reads: an item of a `ReadPlan`.

    Attributes
    ----------
    file : str
        The file (its path or URL).
    tensor : str
        The tensor's name.
    box : tuple of (int, int) or None
        The part of the tensor's array read, ``[start, stop)`` along each axis
        (of the array fastst gives: packed bytes for sub-byte dtypes); None for
        a byte range of a split read, which need not hold whole elements. Its
        runs of bytes less than 4 KiB apart are read as one (up to 4 KiB apart
        for a URL, as its requests are joined), the gap dropped:
        `offsets` and `length` say what is read.
    offsets : numpy.ndarray
        Where each run of bytes starts in the file (int64).
    length : int
        The length of every run, in bytes.
    to : tuple
        Who gets the bytes: the devices that hold the shard (JAX), the rank
        (tensor-parallel), every rank (split reads).
    at : int
        For split reads: where the bytes go in the stream of all the files'
        tensor data that the ranks exchange; -1 otherwise.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.distributed import plan_tensor_parallel
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.zeros((2, 8192), np.int8)}, path)
    >>> read = plan_tensor_parallel(path, {"w": 1}, world_size=2).reads[1][0]
    >>> read.box, read.ranges, read.nbytes
    (((0, 2), (4096, 8192)), [(4168, 4096), (12360, 4096)], 8192)
    """
    file: str
    tensor: str
    box: Optional[Box]
    offsets: "npt.NDArray[np.int64]"
    length: int
    to: Tuple[Any, ...]
    at: int = -1

    @property
    def nbytes(self) -> int:
        """The bytes read."""
        return len(self.offsets) * self.length

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        """The runs read, as ``(file offset, length)``."""
        return [(int(offset), self.length) for offset in self.offsets]


class ReadPlan:
    """Which bytes each device or rank reads, and how many in all against the
    files' size: what `plan_shardings`, `plan_tensor_parallel` and `plan_split`
    return, and what the loaders read.

    Parameters
    ----------
    reads : dict
        Device or rank -> its `Read` items (every device or rank, some
        perhaps with none).
    file_bytes : int
        The files' sizes, summed (a local checkpoint's index JSON included).
    header_bytes : int
        The bytes of the files' prefixes and headers (and a local checkpoint's
        index), which every reader reads (``header_reads`` times in all).
    header_reads : int
        How many readers read the headers: each rank; a JAX process once for
        all its devices.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.distributed import plan_split
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.zeros((256, 256), np.float32)}, path)
    >>> plan = plan_split(path, world_size=2)
    >>> plan.total_bytes <= 1.01 * plan.file_bytes, [plan.bytes_of(r) for r in (0, 1)]
    (True, [131072, 131072])
    >>> print(plan.summary())
    reader            reads     runs          bytes
    0                     1        1        131,072
    1                     1        1        131,072
    headers (x2)                                160
    in all                                  262,304  (1.00x the files' 262,224 bytes)
    """

    def __init__(self, reads: Dict[Any, List[Read]], file_bytes: int, header_bytes: int,
                 header_reads: int) -> None:
        self.reads = reads
        self.file_bytes = file_bytes
        self.header_bytes = header_bytes
        self.header_reads = header_reads

    def bytes_of(self, reader: Any) -> int:
        """The tensor bytes device or rank `reader` reads (headers aside).

        Parameters
        ----------
        reader : jax.Device or int
            A device or rank of the plan.

        Returns
        -------
        int

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.distributed import plan_tensor_parallel
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"w": np.zeros(10, np.int8)}, path)
        >>> plan = plan_tensor_parallel(path, {"w": 0}, world_size=4)    # as torch.chunk
        >>> [plan.bytes_of(rank) for rank in range(4)]
        [3, 3, 3, 1]
        """
        return sum(read.nbytes for read in self.reads[reader])

    @property
    def total_bytes(self) -> int:
        """Every byte every reader reads: the tensors' and the headers'."""
        return (sum(self.bytes_of(reader) for reader in self.reads)
                + self.header_bytes * self.header_reads)

    @property
    def ratio(self) -> float:
        """`total_bytes` against the files' size: 1.0 reads each byte once."""
        return self.total_bytes / self.file_bytes if self.file_bytes else 0.0

    def summary(self) -> str:
        """A table of the bytes each reader reads, and the sum against the files.

        Returns
        -------
        str

        Examples
        --------
        >>> import numpy as np, fastst, tempfile, os
        >>> from fastst.distributed import plan_tensor_parallel
        >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
        >>> fastst.save_file({"w": np.zeros((4, 4), np.float32)}, path)
        >>> print(plan_tensor_parallel(path, {"w": 0}, world_size=2).summary())
        reader            reads     runs          bytes
        0                     1        1             32
        1                     1        1             32
        headers (x2)                                144
        in all                                      208  (1.53x the files' 136 bytes)
        """
        lines = [f"{'reader':<16}{'reads':>7}{'runs':>9}{'bytes':>15}"]
        for reader, reads in self.reads.items():
            runs = sum(len(read.offsets) for read in reads)
            lines.append(f"{str(reader)[:15]:<16}{len(reads):>7,}{runs:>9,}"
                         f"{self.bytes_of(reader):>15,}")
        lines.append(f"{f'headers (x{self.header_reads})':<32}"
                     f"{self.header_bytes * self.header_reads:>15,}")
        lines.append(f"{'in all':<32}{self.total_bytes:>15,}  ({self.ratio:.2f}x the files' "
                     f"{self.file_bytes:,} bytes)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<fastst.distributed.ReadPlan {len(self.reads)} readers, "
                f"{self.total_bytes:,} bytes: {self.ratio:.2f}x the files' {self.file_bytes:,}>")


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------

class _Files:
    """The open files of a file or sharded checkpoint (NumPy handles), in index
    order, and where each one's tensor data lies in the stream of all of them."""

    def __init__(self, opened: Any) -> None:
        self.opened = opened
        self.handles: List[Any] = (opened.shards() if isinstance(opened, ShardedHandle)
                                   else [opened])
        self.by_source = {handle.source: handle for handle in self.handles}
        self.sizes = [data_bytes(handle) for handle in self.handles]
        self.starts, position = [], 0
        for size in self.sizes:
            position = -(-position // STREAM_ALIGN) * STREAM_ALIGN
            self.starts.append(position)
            position += size
        self.stream_bytes = position
        self.index_bytes = _index_bytes(opened)

    @property
    def file_bytes(self) -> int:
        return self.index_bytes + sum(int(handle.data_start) + size
                                      for handle, size in zip(self.handles, self.sizes))

    @property
    def header_bytes(self) -> int:
        return self.index_bytes + sum(int(handle.data_start) for handle in self.handles)

    def tensors(self) -> Iterable[Tuple[Any, str, TensorInfo]]:
        for handle in self.handles:
            for name in handle.offset_keys():
                yield handle, name, handle.info(name)

    def digest(self) -> bytes:
        """A digest of the files' layout (names, dtypes, shapes, offsets): ranks
        that read different files disagree on it."""
        layout = repr([(len(self.handles), [(name, tuple(info[:3])) for _, name, info in
                                            self.tensors()])]).encode()
        return hashlib.blake2b(layout, digest_size=DIGEST_BYTES).digest()

    def close(self) -> None:
        self.opened.close()


def _index_bytes(opened: Any) -> int:
    """The size of a local checkpoint's index, which every reader reads too (an
    object store's is not asked for: 0)."""
    if not isinstance(opened, ShardedHandle):
        return 0
    path = as_source(opened.index.path).local_path
    return os.path.getsize(path) if path is not None else 0


def _open(filename: Any, backend: Any, storage_options: Optional[Mapping[str, Any]]) -> _Files:
    # torch views the bits of bfloat16 and float8 as its own: no ml_dtypes
    opened = open_checkpoint(filename, backend=backend, storage_options=storage_options,
                             uses_ml_dtypes=False)
    try:
        return _Files(opened)    # opens every shard of a checkpoint
    except BaseException:
        opened.close()
        raise


def _read_of(handle: Any, name: str, info: TensorInfo, box: Box, to: Tuple[Any, ...]) -> Read:
    """The runs of bytes that reading `box` reads: those of the box, widened where
    they would lie closer than RUN_GAP (as a slice of the tensor reads them)."""
    shape, itemsize = info.array_shape or (), handle.array_dtype(info.dtype).itemsize
    read = widened(box, shape, itemsize, join_gap(handle.backend))
    offsets, length = runs_of(read, shape, itemsize)
    return Read(handle.source, name, box, offsets + (handle.data_start + info.data_offsets[0]),
                length, to)


def _checked_box(handle: Any, name: str, info: TensorInfo, box: Box) -> Box:
    refusal = packed_refusal(handle.source, name, info, box)
    if refusal is not None:
        raise SafetensorError(refusal)
    return box


def _array_shape(handle: Any, name: str, info: TensorInfo) -> Tuple[int, ...]:
    if info.array_shape is None:
        handle.get_tensor(name)   # raises the error that says why
    return tuple(info.array_shape or ())


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------

def plan_shardings(filename: Any, shardings: Any, *,
                   storage_options: Optional[Mapping[str, Any]] = None) -> ReadPlan:
    """The bytes each JAX device reads when a file is loaded with `shardings`.

    What ``fastst.flax.load_file(filename, shardings=shardings)`` reads, with
    the pread backend or from a URL (with the mmap backend the same bytes are
    copied out of the file's map): the shards of this process's devices, each
    once however many devices hold it (replicated), keyed by the first of
    them. Where they tile a block of the tensor (a process's devices mostly
    do), the block is one read (its ``to`` names every device it feeds),
    however finely the shards cut it; runs of bytes less than 4 KiB apart are
    read as one. A tensor given no sharding is read whole, for JAX's default
    device. Only the headers are read.

    Parameters
    ----------
    filename : str, os.PathLike or URL
        A ``.safetensors`` file or a sharded checkpoint.
    shardings : jax.sharding.Sharding, mapping or callable
        As ``fastst.flax.load_file`` takes it.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Returns
    -------
    ReadPlan
        Keyed by device.

    Raises
    ------
    SafetensorError
        When a sharding would split the packed last axis of a sub-byte tensor.
    ValueError
        When a sharding does not fit a tensor: more dimensions than it has, or
        a tiling that does not divide its shape (JAX's ``IndivisibleError``),
        as ``jax.device_put`` raises it, naming the tensor and its shape too.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os, jax
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
    >>> from fastst.distributed import plan_shardings
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.zeros((8, 256), np.float32)}, path)
    >>> mesh = Mesh(np.array(jax.devices()), ("x",))
    >>> plan = plan_shardings(path, NamedSharding(mesh, PartitionSpec(None, "x")))
    >>> sum(plan.bytes_of(device) for device in plan.reads) == 8 * 256 * 4
    True
    """
    import jax

    from ._frameworks.jax import sharding_for

    files = _open(filename, "pread", storage_options)
    try:
        reads: Dict[Any, List[Read]] = {}
        default = jax.devices()[0]
        for handle, name, info in files.tensors():
            sharding = sharding_for(shardings, name, info)
            shape = _array_shape(handle, name, info)
            if sharding is None:
                reads.setdefault(default, []).append(
                    _read_of(handle, name, info, whole(shape), (default,)))
                continue
            for device in sharding.addressable_devices:
                reads.setdefault(device, [])
            for block, boxes in grouped(device_boxes(sharding, shape,
                                                     f"{handle.source}: tensor {name!r}")):
                for box in (block, *boxes):
                    _checked_box(handle, name, info, box)
                devices = tuple(device for held in boxes.values() for device in held)
                reads[devices[0]].append(_read_of(handle, name, info, block, devices))
        return ReadPlan(reads, files.file_bytes, files.header_bytes, 1)
    finally:
        files.close()


def plan_tensor_parallel(filename: Any, dims: Dims, world_size: int, *, split: Split = "chunk",
                         storage_options: Optional[Mapping[str, Any]] = None) -> ReadPlan:
    """The bytes each rank reads to load its tensor-parallel slices.

    What `load_tensor_parallel` reads on each rank, with the pread backend or
    from a URL: each tensor's slice along its dimension, or the whole tensor
    when it has none (replicated). Only the headers are read.

    Parameters
    ----------
    filename : str, os.PathLike or URL
        A ``.safetensors`` file or a sharded checkpoint.
    dims : mapping or callable
        Tensor name -> the dimension to split (negative counts from the end), or
        None to give every rank the whole tensor; a name the mapping leaves out
        is whole. Or ``dims(name)`` returning the same.
    world_size : int
        How many ranks.
    split : "chunk" or "tensor_split", default "chunk"
        How a dimension that does not divide evenly is cut: as ``torch.chunk``
        (parts of ``ceil(n / world_size)``, the last ones shorter or empty) or
        as ``torch.tensor_split`` (the first ``n % world_size`` parts one
        longer). Where it divides, both are vLLM's ``narrow(dim, rank * size,
        size)``.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Returns
    -------
    ReadPlan
        Keyed by rank.

    Raises
    ------
    SafetensorError
        When a dimension is not one of the tensor's, `split` or `world_size` is
        not valid, or a dimension is the packed last axis of a sub-byte tensor.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.distributed import plan_tensor_parallel
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"up": np.zeros((6, 4), np.float32),
    ...                   "down": np.zeros((4, 6), np.float32)}, path)
    >>> plan = plan_tensor_parallel(path, {"up": 0, "down": -1}, world_size=4)
    >>> [[read.box for read in plan.reads[rank]] for rank in (0, 3)]
    [[((0, 4), (0, 2)), ((0, 2), (0, 4))], [((0, 4), (6, 6)), ((6, 6), (0, 4))]]
    """
    _check_world(world_size)
    check_split(split)
    files = _open(filename, "pread", storage_options)
    try:
        reads = {rank: _tensor_parallel_reads(files, dims, world_size, rank, split)
                 for rank in range(world_size)}
        return ReadPlan(reads, files.file_bytes, files.header_bytes, world_size)
    finally:
        files.close()


def _tensor_parallel_reads(files: _Files, dims: Dims, world: int, rank: int,
                           split: Split) -> List[Read]:
    reads = []
    for handle, name, info in files.tensors():
        shape = _array_shape(handle, name, info)
        box = whole(shape)
        dim = _dim_of(dims, handle.source, name, shape)
        if dim is not None:
            box = box[:dim] + (part_of(shape[dim], world, rank, split),) + box[dim + 1:]
        reads.append(_read_of(handle, name, info, _checked_box(handle, name, info, box),
                              (rank,)))
    return reads


def _dim_of(dims: Dims, source: str, name: str, shape: Tuple[int, ...]) -> Optional[int]:
    if isinstance(dims, Mapping):
        dim = dims.get(name)
    elif callable(dims):
        dim = dims(name)
    else:
        raise SafetensorError(f"dims must be a mapping of tensor names to dimensions or a "
                              f"callable, got {type(dims).__name__}")
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) \
            or not -len(shape) <= dim < len(shape):
        raise SafetensorError(f"{source}: tensor {name!r} (shape {list(shape)}) has no "
                              f"dimension {dim!r} to split")
    return int(dim) % len(shape)


def plan_split(filename: Any, world_size: int, *,
               storage_options: Optional[Mapping[str, Any]] = None) -> ReadPlan:
    """The bytes each rank reads when the ranks share out the reading of a whole
    file, then exchange what they read (`load_split`).

    The tensor data of all the files, one after another, is cut into
    `world_size` byte ranges of equal length (the last shorter); each rank
    reads its range, whatever tensors it cuts through. Only the headers are
    read.

    Parameters
    ----------
    filename : str, os.PathLike or URL
        A ``.safetensors`` file or a sharded checkpoint.
    world_size : int
        How many ranks.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Returns
    -------
    ReadPlan
        Keyed by rank; each `Read` is a byte range of a tensor (``box`` None),
        ``at`` its place in the exchanged stream.

    Raises
    ------
    SafetensorError
        When `world_size` is not a positive integer.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.distributed import plan_split
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"a": np.zeros(100, np.uint8), "b": np.zeros(50, np.uint8)}, path)
    >>> plan = plan_split(path, world_size=2)
    >>> [[(read.tensor, read.nbytes) for read in plan.reads[rank]] for rank in (0, 1)]
    [[('a', 75)], [('a', 25), ('b', 50)]]
    """
    _check_world(world_size)
    files = _open(filename, "pread", storage_options)
    try:
        part = _part_bytes(files.stream_bytes, world_size)
        reads = {rank: _split_reads(files, rank * part, min((rank + 1) * part,
                                                            files.stream_bytes), world_size)
                 for rank in range(world_size)}
        return ReadPlan(reads, files.file_bytes, files.header_bytes, world_size)
    finally:
        files.close()


def _part_bytes(stream_bytes: int, world: int) -> int:
    return -(-stream_bytes // world)


def _split_reads(files: _Files, first: int, last: int, world: int) -> List[Read]:
    """The byte ranges of tensors that bytes [first, last) of the stream hold."""
    reads = []
    everyone = tuple(range(world))
    for handle, start in zip(files.handles, files.starts):
        for name in handle.offset_keys():
            begin, end = handle.info(name).data_offsets
            low, high = max(first, start + begin), min(last, start + end)
            if low < high:
                offset = handle.data_start + low - start
                reads.append(Read(handle.source, name, None, np.full(1, offset, np.int64),
                                  high - low, everyone, low))
    return reads


def _check_world(world_size: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
            or world_size < 1:
        raise SafetensorError(f"world_size must be a positive integer, got {world_size!r}")


# ---------------------------------------------------------------------------
# torch.distributed
# ---------------------------------------------------------------------------

class _Group(NamedTuple):
    """A process group, this process's rank in it, and how it exchanges tensors."""
    dist: Any
    group: Any
    rank: int
    world: int
    device: Any          # where collectives run: CUDA for NCCL, else the CPU
    backend: str
    timeout: Optional[timedelta]
    filename: str

    def run(self, collectives: Callable[[], List[Any]], what: str) -> None:
        """Start collectives (`collectives()` starts them and returns their works)
        and wait for each, no longer than the timeout (the group's own when None): a
        rank that stopped, or does not answer in time, is an error on this one."""
        try:
            for work in collectives():
                if self.timeout is None:
                    work.wait()
                else:
                    work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise self._failure(what, error) from None

    def _failure(self, what: str, error: RuntimeError) -> SafetensorError:
        where = f"{self.filename}: rank {self.rank} of {self.world}: {what}"
        gone = self._ranks_gone()
        if gone:
            ranks = ", ".join(map(str, gone))
            return SafetensorError(
                f"{where} failed: the connection to rank{'s' * (len(gone) > 1)} {ranks} of "
                f"{self.world} closed (a rank killed, crashed or ended)")
        waited = (f"{self.timeout.total_seconds():g} s" if self.timeout is not None
                  else "the process group's timeout")
        return SafetensorError(f"{where} did not end within {waited}: a rank stopped, or is "
                               f"still reading ({error})")

    def _ranks_gone(self) -> List[int]:
        """The ranks whose connection to this one has closed: gloo refuses at once to
        receive from them (the receives posted from the others are never sent to,
        and cost a byte each). Other backends are not asked."""
        import torch

        if "gloo" not in self.backend:
            return []
        gone = []
        for rank in range(self.world):
            if rank == self.rank:
                continue
            try:
                self.dist.irecv(torch.empty(1, dtype=torch.uint8),
                                self.dist.get_global_rank(self.group, rank), group=self.group,
                                tag=PROBE_TAG)
            except RuntimeError:
                gone.append(rank)
        return gone


def _group_of(group: Any, timeout: Optional[float], filename: Any) -> _Group:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise SafetensorError("torch.distributed is not initialised: call "
                              "torch.distributed.init_process_group first")
    group = group if group is not None else dist.group.WORLD
    backend = str(dist.get_backend(group)).lower()
    device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
              else torch.device("cpu"))
    if timeout is not None and not timeout > 0:
        raise SafetensorError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    return _Group(dist, group, dist.get_rank(group), dist.get_world_size(group), device,
                  backend, None if timeout is None else timedelta(seconds=timeout),
                  os.fsdecode(filename) if isinstance(filename, (str, bytes, os.PathLike))
                  else repr(filename))


def _agree(group: _Group, failure: Optional[str], digest: bytes) -> None:
    """Every rank says whether it read what it had to (and the digest of the files'
    layout it saw); all raise the same error when one did not, or when they saw
    different files."""
    import torch

    row = torch.zeros(1 + MESSAGE_BYTES + DIGEST_BYTES, dtype=torch.uint8)
    if failure is not None:
        message = failure.encode()[:MESSAGE_BYTES]
        row[0] = 1
        row[1:1 + len(message)] = torch.tensor(list(message), dtype=torch.uint8)
    row[1 + MESSAGE_BYTES:] = torch.tensor(list(digest.ljust(DIGEST_BYTES, b"\0")),
                                           dtype=torch.uint8)
    row = row.to(group.device)
    rows = [torch.empty_like(row) for _ in range(group.world)]
    group.run(lambda: [group.dist.all_gather(rows, row, group=group.group, async_op=True)],
              "agreeing on what each rank read")
    told = [bytes(answer.cpu().numpy()) for answer in rows]
    failures = [answer[1:1 + MESSAGE_BYTES].rstrip(b"\0").decode(errors="replace")
                for answer in told if answer[0]]
    if failures:
        raise SafetensorError("; ".join(failures))
    digests = [answer[1 + MESSAGE_BYTES:] for answer in told]
    differing = [rank for rank, seen in enumerate(digests) if seen != digests[0]]
    if differing:
        raise SafetensorError(f"{group.filename}: the ranks read different files: rank "
                              f"{differing[0]} saw tensors (names, dtypes, shapes or offsets) "
                              f"that rank 0 did not")


def _kind(error: BaseException) -> str:
    """The name of `error`'s class; for an OSError that fastst's core only rewords
    (``NoSuchFileError`` is a ``FileNotFoundError``), the built-in's."""
    kind = type(error)
    if isinstance(error, OSError) and kind.__module__.startswith("fastst"):
        kind = next(base for base in kind.__mro__ if base.__module__ == "builtins")
    return kind.__name__


def _fail_together(group: _Group, error: BaseException, digest: bytes) -> None:
    """This rank could not read: tell the others (which wait to agree), and raise
    what every rank raises."""
    failure = (f"rank {group.rank} of {group.world} could not read {group.filename}: "
               f"{_kind(error)}: {error}")
    try:
        _agree(group, failure, digest)
    except SafetensorError as agreed:
        raise agreed from error
    raise AssertionError("the ranks agreed although this one failed")   # pragma: no cover


def load_tensor_parallel(filename: Any, dims: Dims, *, group: Any = None,
                         split: Split = "chunk", device: Any = "cpu", backend: str = DEFAULT_BACKEND,
                         storage_options: Optional[Mapping[str, Any]] = None,
                         timeout: Optional[float] = None) -> Dict[str, "torch.Tensor"]:
    """This rank's tensor-parallel slices of a file's tensors, reading only them.

    Each rank of the process group reads, of each tensor, its slice along the
    dimension `dims` gives (the tensor whole when none): the way vLLM's
    loaders call ``get_slice``, without reading the other ranks' bytes
    (`plan_tensor_parallel` shows them). The ranks then agree that each read
    what it had to: one that could not makes every rank raise.

    Parameters
    ----------
    filename : str, os.PathLike or URL
        A ``.safetensors`` file or a sharded checkpoint, the same on every rank.
    dims : mapping or callable
        Tensor name -> dimension to split or None (see `plan_tensor_parallel`).
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the tensors; the default group when None.
    split : "chunk" or "tensor_split", default "chunk"
        How uneven dimensions are cut (see `plan_tensor_parallel`).
    device : str or torch.device, default "cpu"
        Where this rank's tensors go (``"cuda:0"``...).
    backend : "mmap" or "pread", default "mmap"
        How local files are read: ``"pread"`` reads each slice's bytes alone,
        ``"mmap"`` copies them out of the file's map.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    timeout : float, optional
        Seconds to wait for the other ranks to agree; the process group's
        timeout when None.

    Returns
    -------
    dict of str to torch.Tensor
        Every tensor's slice for this rank (contiguous), in the order of the
        files' bytes; a rank past the last part of a ``torch.chunk`` gets an
        empty slice.

    Raises
    ------
    SafetensorError
        On every rank, when one rank could not read (naming the rank and the
        file), the ranks read different files, or did not all answer within
        `timeout`; when ``torch.distributed`` is not initialised.

    Examples
    --------
    One process, a group of one (a real job starts one process a rank, with
    ``torchrun`` or ``torch.multiprocessing``):

    >>> import numpy as np, fastst, tempfile, os
    >>> import torch.distributed as dist
    >>> from fastst.distributed import load_tensor_parallel
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.arange(8, dtype=np.float32).reshape(2, 4)}, path)
    >>> dist.init_process_group("gloo", init_method=f"file://{path}.rendezvous",
    ...                         rank=0, world_size=1)
    >>> load_tensor_parallel(path, {"w": 1})["w"]
    tensor([[0., 1., 2., 3.],
            [4., 5., 6., 7.]])
    >>> dist.destroy_process_group()
    """
    from ._frameworks.torch import target_device, tensor_of

    check_split(split)
    place = target_device(device)
    ranks = _group_of(group, timeout, filename)
    tensors: Dict[str, Any] = {}
    digest = b""
    try:
        files = _open(filename, backend, storage_options)
        try:
            digest = files.digest()
            for read in _tensor_parallel_reads(files, dims, ranks.world, ranks.rank, split):
                handle = files.by_source[read.file]
                info = handle.info(read.tensor)
                part = handle.get_slice(read.tensor)[leading_index(read.box or (),
                                                                   info.array_shape or ())]
                if not part.flags.c_contiguous:   # a view of the map across rows
                    part = part.copy()
                tensor = tensor_of(part, read.tensor, info)
                tensors[read.tensor] = tensor if place is None else tensor.to(place)
        finally:
            files.close()
    except Exception as error:    # every rank must hear of it, or the others wait
        tensors.clear()
        _fail_together(ranks, error, digest)
    _agree(ranks, None, digest)
    return tensors


def load_split(filename: Any, *, group: Any = None, device: Any = "cpu",
               backend: str = DEFAULT_BACKEND,
               storage_options: Optional[Mapping[str, Any]] = None,
               timeout: Optional[float] = None) -> Dict[str, "torch.Tensor"]:
    """Every tensor of a file on every rank, each rank reading about 1/world of it.

    The ranks share out the reading (`plan_split`: the tensor data of all the
    files cut into byte ranges of equal length), agree that each read its
    part, then exchange the parts (a broadcast from each rank on the process
    group, in rounds of ``ROUND_BYTES`` of each part): the files are read once
    in all, not once a rank. For replicated models (data-parallel, pipelines' copies) on cold
    disks or object stores, where reading is what costs; on one machine with
    a warm page cache, each rank reading the whole file is faster.

    With an NCCL group the parts go to the GPU through fastst's ring of pinned
    buffers and are exchanged there: the tensors are CUDA tensors of one
    allocation. With gloo they are exchanged in CPU memory, then moved to
    `device`.

    Parameters
    ----------
    filename : str, os.PathLike or URL
        A ``.safetensors`` file or a sharded checkpoint, the same on every rank.
    group : torch.distributed.ProcessGroup, optional
        The ranks that share the reading; the default group when None.
    device : str or torch.device, default "cpu"
        Where the tensors go, for a gloo group (an NCCL group puts them on its
        CUDA device).
    backend : "mmap" or "pread", default "mmap"
        How local files are read (either way, only this rank's part).
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.
    timeout : float, optional
        Seconds to wait for each collective (agreeing, each round of the
        exchange); the process group's timeout when None.

    Returns
    -------
    dict of str to torch.Tensor
        Every tensor, in the order of the files' bytes: views of one
        allocation (a copy where a tensor's offset does not suit its dtype).

    Raises
    ------
    SafetensorError
        On every rank, when one rank could not read its part (naming the rank
        and the file), the ranks read different files, or did not all answer
        within `timeout`; when ``torch.distributed`` is not initialised.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> import torch.distributed as dist
    >>> from fastst.distributed import load_split
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.ones(3, np.float32), "b": np.arange(2)}, path)
    >>> dist.init_process_group("gloo", init_method=f"file://{path}.rendezvous",
    ...                         rank=0, world_size=1)
    >>> load_split(path)
    {'b': tensor([0, 1]), 'w': tensor([1., 1., 1.])}
    >>> dist.destroy_process_group()
    """
    import torch

    from ._frameworks.torch import target_device

    place = target_device(device)
    ranks = _group_of(group, timeout, filename)
    digest = b""
    try:
        files = _open(filename, backend, storage_options)
        try:
            digest = files.digest()
            part = _part_bytes(files.stream_bytes, ranks.world)
            first = min(ranks.rank * part, files.stream_bytes)
            last = min(first + part, files.stream_bytes)
            stream = torch.empty(part * ranks.world, dtype=torch.uint8, device=ranks.device)
            _read_part(files, _split_reads(files, first, last, ranks.world), first,
                       stream[first:last])
            places = _places(files)
        finally:
            files.close()
    except Exception as error:    # every rank must hear of it, or the others wait
        _fail_together(ranks, error, digest)
    _agree(ranks, None, digest)
    _exchange(ranks, stream, part)
    if place is not None and ranks.device.type == "cpu":
        stream = stream.to(place)
    # views of the stream, each with its torch dtype and shape
    from ._frameworks import cuda as _cuda

    tensors: Dict[str, torch.Tensor] = _cuda.tensor_views(stream, places)
    return tensors


def _read_part(files: _Files, reads: List[Read], first: int, dest: "torch.Tensor") -> None:
    """Read this rank's part of the stream, bytes [first, first + len(dest)), into
    `dest`: in CPU memory at once, or through the pinned ring to a CUDA `dest`."""
    read = _part_reader(files, reads, first)
    total = dest.numel()
    if dest.device.type == "cpu":
        if total:
            read(memoryview(dest.numpy()), 0)  # type: ignore[arg-type]
        return
    # an NCCL group: the part goes to the GPU through the ring
    from ._frameworks import cuda as _cuda

    def cut_short(offset: int) -> Exception:
        return AssertionError(f"a read of the stream ended early, at byte {first + offset}")

    if total:
        ring = _cuda.PinnedRing(dest, *_cuda.ring_shape(total, _cuda.CHUNK_BYTES,
                                                        _cuda.RING_BUFFERS))
        try:
            _cuda.stream(read, total, ring, cut_short)
        finally:
            ring.release()


def _part_reader(files: _Files, reads: List[Read], first: int
                 ) -> Callable[[memoryview, int], int]:
    """``read(buffer, start)``: fills `buffer` with the bytes of the stream from
    ``first + start`` on (each tensor's through its file's reader; the padding
    between files left as it is) and returns its length."""
    ats = [read.at for read in reads]

    def read(buffer: memoryview, start: int) -> int:
        out = np.frombuffer(buffer, np.uint8)
        low, high = first + start, first + start + len(out)
        k = max(bisect.bisect_right(ats, low) - 1, 0)
        while k < len(reads) and reads[k].at < high:
            piece = reads[k]
            a, b = max(low, piece.at), min(high, piece.at + piece.length)
            if a < b:
                handle = files.by_source[piece.file]
                begin = handle.data_start + handle.info(piece.tensor).data_offsets[0]
                offset = int(piece.offsets[0]) - begin + (a - piece.at)
                handle.read_runs(piece.tensor, [offset], b - a, out[a - low:b - low])
            k += 1
        return len(out)

    return read


def _exchange(ranks: _Group, stream: "torch.Tensor", part: int) -> None:
    """Every rank's part of `stream` to every rank, in rounds of ROUND_BYTES of each
    part: a broadcast from each rank (gloo's all-gather was 3 to 10 times slower on
    loopback), in place, so that nothing is staged."""
    if ranks.world == 1 or part == 0:
        return
    parts = list(stream.split(part))  # type: ignore[no-untyped-call]
    senders = [ranks.dist.get_global_rank(ranks.group, rank) for rank in range(ranks.world)]
    for start in range(0, part, ROUND_BYTES):
        ranks.run(lambda: [ranks.dist.broadcast(piece[start:start + ROUND_BYTES], src=sender,
                                                group=ranks.group, async_op=True)
                           for piece, sender in zip(parts, senders)],
                  f"exchanging bytes {start}.. of each rank's part")


def _places(files: _Files) -> List[Any]:
    """Each tensor's torch dtype and shape, and its bytes in the stream."""
    from ._frameworks import cuda as _cuda   # its TensorPlace: what a tensor of a file is to torch

    places = []
    for handle, start in zip(files.handles, files.starts):
        for place in _cuda.places_of(handle):
            places.append(place._replace(begin=place.begin + start, end=place.end + start))
    return places
