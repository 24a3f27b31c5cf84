"""Loading a safetensors file onto a CUDA device at the speed of the link.

The file's tensor bytes go to one allocation on the device. Several threads read
the file with ``os.preadv`` (which releases the GIL) into a small ring of pinned
host buffers; each thread owns one buffer, copies it to the device with an
asynchronous copy on a stream of the load's own, and refills it once the CUDA event
recorded after that copy has passed. Disk reads, the kernel's copies out of the page
cache and transfers over the link overlap, and host memory holds the ring, never
the file. Each tensor is a view of the device allocation where its offset is a
multiple of its element size, else a copy of its bytes; the allocation is freed
with the last tensor viewing it.

``fastst.torch`` imports this module only when a CUDA device is asked for.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import threading
from typing import (Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Protocol,
                    Sequence, Tuple, Union)

import numpy as np
import torch

from .._core import SafetensorError, TensorInfo, hint_sequential
from .._format.torch_dtypes import numpy_array_torch_dtypes, torch_dtype_of_bytes
from .._io.source import Identity, identity_of, local_version

# Measured on H100 machines (bench/gpu.py, bench/RESULTS.md): of the ring shapes
# tried, 16 threads reading 16 MiB each were the fastest, or within noise of it, with
# a hot page cache in three runs, and as fast as a plain read with a cold one.
CHUNK_BYTES = 16 << 20
RING_BUFFERS = 16


class TensorPlace(NamedTuple):
    """Where one tensor lies in the tensor buffer, and what torch makes of it."""
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    begin: int
    end: int

    @property
    def is_view(self) -> bool:
        """Whether the tensor can view the device buffer: torch needs a tensor's
        offset in its storage to be a multiple of its element size."""
        return self.begin % self.dtype.itemsize == 0


_FLOAT4 = "F4"


def tensor_place(name: str, info: TensorInfo, source: str) -> TensorPlace:
    """The torch dtype and shape of one header entry: packed sub-byte tensors take
    the shape of their bytes (float4 packs two values a byte along the last dim)."""
    code, shape, (begin, end), array_shape = info
    if code == _FLOAT4 and (array_shape is None or len(array_shape) != len(shape)):
        raise SafetensorError(
            f"{source}: tensor {name!r}: F4 {shape} cannot be a torch.float4_e2m1fn_x2 "
            f"tensor, which packs two values a byte along the last dim: that dim must be even")
    torch_shape = tuple(shape if array_shape is None else array_shape)
    return TensorPlace(name, torch_dtype_of_bytes(code, f"{source}: tensor {name!r}"),
                       torch_shape, begin, end)


def numpy_place(name: str, info: TensorInfo, source: str) -> TensorPlace:
    """The dtype and shape fastst's NumPy array of one header entry has (sub-byte
    tensors as their packed bytes), as torch's: what other frameworks take
    through DLPack."""
    code, shape, (begin, end), array_shape = info
    return TensorPlace(name, numpy_array_torch_dtypes()[code],
                       tuple(shape if array_shape is None else array_shape), begin, end)


Place = Callable[[str, TensorInfo, str], TensorPlace]   # a header entry's torch dtype and shape


def plan_chunks(total: int, chunk_bytes: int) -> List[Tuple[int, int]]:
    """The tensor buffer's bytes [0, total) cut into [start, stop) ranges of
    `chunk_bytes` each, the last one shorter."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return [(start, min(start + chunk_bytes, total)) for start in range(0, total, chunk_bytes)]


def ring_shape(total: int, chunk_bytes: int, buffers: int) -> Tuple[int, int]:
    """(buffer bytes, buffer count) of a ring for a tensor buffer of `total` bytes:
    no larger than the file needs, one buffer at least."""
    if buffers <= 0:
        raise ValueError(f"buffers must be positive, got {buffers}")
    size = max(1, min(chunk_bytes, total))
    return size, max(1, min(buffers, len(plan_chunks(total, chunk_bytes))))


def tensor_at(specs: Sequence[TensorPlace], offset: int) -> TensorPlace:
    """The tensor whose bytes hold tensor-buffer offset `offset`."""
    for spec in specs:
        if spec.begin <= offset < spec.end:
            return spec
    raise ValueError(f"offset {offset} lies in no tensor")


def read_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill `buffer` from `fd` at `offset`; the bytes read, fewer only where the
    file ends (a read may come back short; one that reads nothing is the end)."""
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


class Ring(Protocol):
    """What the reading threads fill and hand on: one buffer per thread.

    ``buffers[k]`` is thread k's buffer; ``send(k, nbytes, start)`` hands on its
    first `nbytes` bytes, which belong at `start` in the tensor buffer;
    ``wait(k)`` returns once buffer k may be refilled; ``finish()`` once every
    byte handed on has arrived; ``start_thread()`` runs in each reading thread
    before its first read.
    """
    buffers: Sequence[memoryview]

    def start_thread(self) -> None: ...
    def wait(self, k: int) -> None: ...
    def send(self, k: int, nbytes: int, start: int) -> None: ...
    def finish(self) -> None: ...
    def release(self) -> None: ...


def stream(read: Callable[[memoryview, int], int], total: int, ring: Ring,
           on_short_read: Callable[[int], Exception]) -> None:
    """Move `total` bytes through `ring`, one thread per ring buffer, chunk i by
    thread i % threads; ``read(buffer, start)`` fills `buffer` with the bytes from
    `start` on and returns how many it read, fewer only where the source ends.

    A read that ends early raises ``on_short_read(offset)``, the offset of the
    first byte missing; the first error of any thread stops the others and is
    raised once all have stopped and every copy already started has finished, so
    the ring may then be freed.
    """
    size = len(ring.buffers[0]) if ring.buffers else 0
    chunks = plan_chunks(total, size) if size else []
    threads = min(len(ring.buffers), len(chunks))
    errors: List[BaseException] = []

    def lane(k: int) -> None:
        try:
            ring.start_thread()
            for start, stop in chunks[k::threads]:
                if errors:
                    return
                ring.wait(k)
                count = read(ring.buffers[k][:stop - start], start)
                if count < stop - start:
                    errors.append(on_short_read(start + count))
                    return
                ring.send(k, stop - start, start)
        except OSError as error:
            # its traceback holds the reading frame, and so the pinned buffer
            errors.append(error.with_traceback(None))
        except BaseException as error:   # raised in the calling thread
            errors.append(error)

    workers = [threading.Thread(target=lane, args=(k,), name=f"fastst-read-{k}", daemon=True)
               for k in range(threads)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    except BaseException as error:   # KeyboardInterrupt while joining: stop the lanes
        errors.append(error)
        for worker in workers:
            if worker.ident is not None:
                worker.join()
        raise
    finally:
        ring.finish()
    if errors:
        raise errors[0]


class Scatter:
    """A tensor buffer whose bytes go to several device tensors rather than one
    allocation: byte range [begin, end) of the buffer into a uint8 tensor of
    end - begin bytes (a model's parameter, viewed as bytes), for each piece."""

    def __init__(self, device: torch.device,
                 pieces: Iterable[Tuple[int, int, torch.Tensor]]) -> None:
        self.device = device
        # empty pieces take no bytes; without them, no two pieces start at one offset
        self.pieces = sorted((piece for piece in pieces if piece[1] > piece[0]),
                             key=lambda piece: piece[0])
        self.begins = [begin for begin, _, _ in self.pieces]

    def copy_in(self, start: int, data: torch.Tensor) -> None:
        """Bytes [start, start + len(data)) of the buffer, to the pieces they fall in."""
        end = start + data.numel()
        k = max(bisect.bisect_right(self.begins, start) - 1, 0)
        while k < len(self.pieces) and self.pieces[k][0] < end:
            begin, stop, target = self.pieces[k]
            low, high = max(start, begin), min(end, stop)
            if low < high:
                target[low - begin:high - begin].copy_(data[low - start:high - start],
                                                       non_blocking=True)
            k += 1


Destination = Union[torch.Tensor, Scatter]   # where a ring's bytes go


class PinnedRing:
    """A ring of pinned host buffers copied into `dest` (a CUDA uint8 tensor, or a
    Scatter of them) on a stream of its own, each buffer released by the event
    recorded after its copy."""

    def __init__(self, dest: Destination, buffer_bytes: int, count: int) -> None:
        self.dest = dest
        self.stream = torch.cuda.Stream(dest.device)
        # one allocation for the whole ring, cut into the threads' buffers
        self.pinned = torch.empty(buffer_bytes * count, dtype=torch.uint8, pin_memory=True)
        self.parts = list(self.pinned.split(buffer_bytes))
        self.buffers: Sequence[memoryview] = [memoryview(part.numpy()) for part in self.parts]
        # blocking: a waiting thread sleeps rather than spin on a core the readers need
        self.events = [torch.cuda.Event(blocking=True) for _ in range(count)]

    def start_thread(self) -> None:
        torch.cuda.set_device(self.dest.device)
        torch.cuda.set_stream(self.stream)   # the current stream is per thread

    def wait(self, k: int) -> None:
        # mostly the copy ended long ago: a query spares a round of the GIL
        if not self.events[k].query():
            self.events[k].synchronize()

    def send(self, k: int, nbytes: int, start: int) -> None:
        if isinstance(self.dest, Scatter):
            self.dest.copy_in(start, self.parts[k][:nbytes])
        else:
            self.dest[start:start + nbytes].copy_(self.parts[k][:nbytes], non_blocking=True)
        self.events[k].record(self.stream)

    def finish(self) -> None:
        self.stream.synchronize()

    def release(self) -> None:
        self.buffers = []
        self.parts = []
        del self.pinned, self.dest


def device_buffer(nbytes: int, device: torch.device, source: str) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError as error:
        free, _ = torch.cuda.mem_get_info(device)
        raise torch.cuda.OutOfMemoryError(
            f"{source}: its tensors need {nbytes} bytes on {device}, which has {free} bytes "
            f"free") from error


def tensor_views(dest: torch.Tensor, specs: Iterable[TensorPlace]) -> Dict[str, torch.Tensor]:
    """Each tensor as a view of the uint8 tensor buffer `dest`, or as a copy of its
    bytes where its offset does not suit its element size."""
    tensors = {}
    for spec in specs:
        raw = dest[spec.begin:spec.end]
        if not spec.is_view:
            raw = raw.clone()
        tensors[spec.name] = raw.view(spec.dtype).reshape(spec.shape)
    return tensors


# tensors smaller than this go with a plain .to(device): starting the threads would
# cost more than the copy
STAGED_MIN_BYTES = 16 << 20


def to_device(tensor: torch.Tensor, device: torch.device, *,
              chunk_bytes: int = CHUNK_BYTES, buffers: int = RING_BUFFERS) -> torch.Tensor:
    """A copy of the contiguous CPU tensor `tensor` on the CUDA `device`, its bytes
    copied by threads into the pinned ring (out of the file's map, for a tensor
    that views one) and on to the device. Chunks shrink so that every thread has
    one."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < STAGED_MIN_BYTES:
        return tensor.to(device)
    raw = tensor.reshape(-1).view(torch.uint8).numpy()
    dest = device_buffer(nbytes, device, f"a tensor of {nbytes} bytes")

    def read(buffer: memoryview, start: int) -> int:
        np.copyto(np.frombuffer(buffer, np.uint8), raw[start:start + len(buffer)])
        return len(buffer)

    def unreachable(offset: int) -> Exception:
        return AssertionError(f"a copy from memory ended early, at byte {offset}")

    per_thread = -(-nbytes // buffers)
    chunk = min(chunk_bytes, -(-per_thread // 4096) * 4096)
    ring = PinnedRing(dest, *ring_shape(nbytes, chunk, buffers))
    try:
        stream(read, nbytes, ring, unreachable)
    finally:
        ring.release()
    return dest.view(tensor.dtype).reshape(tensor.shape)


MakeDest = Callable[[int, str], torch.Tensor]   # (bytes, source) -> a uint8 tensor
MakeRing = Callable[[Any, int], Ring]            # (destination, bytes) -> a ring


def device_ring(device: torch.device, chunk_bytes: int, buffers: int
                ) -> Tuple[MakeDest, MakeRing]:
    """The allocator of CUDA `device` memory, and the maker of rings of `buffers`
    pinned buffers of `chunk_bytes` each, that a load streams through."""
    def make_dest(total: int, source: str) -> torch.Tensor:
        return device_buffer(total, device, source)

    def make_ring(dest: Destination, total: int) -> PinnedRing:
        return PinnedRing(dest, *ring_shape(total, chunk_bytes, buffers))

    return make_dest, make_ring


def load_all(opened: Any, device: torch.device, *, chunk_bytes: int = CHUNK_BYTES,
             buffers: int = RING_BUFFERS) -> Dict[str, torch.Tensor]:
    """Every tensor of `opened` (an open file or sharded checkpoint, as ``safe_open``
    gives it) on the CUDA `device`, read through a ring of `buffers` pinned buffers
    of `chunk_bytes` each (see the module's docstring)."""
    return load_through(opened, *device_ring(device, chunk_bytes, buffers))


def load_through(opened: Any, make_dest: MakeDest, make_ring: MakeRing
                 ) -> Dict[str, torch.Tensor]:
    """Every tensor of an open file, or of a sharded checkpoint (one allocation per
    shard, shard after shard in index order), streamed through rings (see
    ``load_opened_through``)."""
    tensors: Dict[str, torch.Tensor] = {}
    for reader in files_of(opened):
        tensors.update(load_opened_through(reader, make_dest, make_ring))
    return tensors


def load_into(targets: Dict[str, torch.Tensor], opened: Any, device: torch.device, *,
              chunk_bytes: int = CHUNK_BYTES, buffers: int = RING_BUFFERS
              ) -> Tuple[List[str], Dict[str, torch.Tensor]]:
    """Load `opened` (an open file or sharded checkpoint) onto the CUDA `device`,
    its tensors written straight into the tensors of `targets` (a model's state
    dict) that live on `device` and have their dtype and shape: the names so
    written, and the other tensors, in one allocation per file (see
    ``load_opened_into``)."""
    index = torch.cuda.current_device() if device.index is None else device.index
    on_device = {name: tensor for name, tensor in targets.items()
                 if tensor.device == torch.device("cuda", index)}
    return load_into_through(on_device, opened, *device_ring(device, chunk_bytes, buffers))


def load_into_through(targets: Dict[str, torch.Tensor], opened: Any, make_dest: MakeDest,
                      make_ring: MakeRing, *, place: Place = tensor_place
                      ) -> Tuple[List[str], Dict[str, torch.Tensor]]:
    """``load_opened_into`` for each file of `opened` (its shards, in order)."""
    placed: List[str] = []
    rest: Dict[str, torch.Tensor] = {}
    for reader in files_of(opened):
        names, tensors = load_opened_into(reader, targets, make_dest, make_ring, place=place)
        placed += names
        rest.update(tensors)
    return placed, rest


def files_of(opened: Any) -> List[Any]:
    """The open files of `opened`: itself, or a sharded checkpoint's shards in index
    order, each checked against the index before any is read."""
    shards = getattr(opened, "shards", None)
    return list(shards()) if callable(shards) else [opened]


def load_handle(reader: Any, device: torch.device, *, chunk_bytes: int = CHUNK_BYTES,
                buffers: int = RING_BUFFERS) -> Dict[str, torch.Tensor]:
    """Every tensor of the file an open handle (a NumpyHandle on a file) reads, on
    the CUDA `device`, through one ring (see ``load_opened_through``)."""
    return load_opened_through(reader, *device_ring(device, chunk_bytes, buffers))


def load_opened_through(reader: Any, make_dest: MakeDest, make_ring: MakeRing
                        ) -> Dict[str, torch.Tensor]:
    """The tensors of the file `reader` opened, streamed from it into one buffer
    from ``make_dest(bytes, source)`` through ``make_ring(dest, bytes)``, in file
    order. The file is opened again by its path and must be the one the reader
    opened (device, inode, size, modification time)."""
    specs = places_of(reader)
    total = max((spec.end for spec in specs), default=0)
    with opened_again(reader) as fd:
        dest = make_dest(total, reader.source)
        try:
            fill(fd, reader.source, reader.data_start, specs, dest, make_ring)
        except BaseException:
            del dest   # the traceback keeps this frame, not the device memory
            raise
    return tensor_views(dest, specs)


def load_opened_into(reader: Any, targets: Dict[str, torch.Tensor], make_dest: MakeDest,
                     make_ring: MakeRing, *, place: Place = tensor_place
                     ) -> Tuple[List[str], Dict[str, torch.Tensor]]:
    """Stream the file `reader` opened straight into `targets` (a model's state
    dict: tensors of the device): each tensor of the file whose target has its
    dtype and shape (as `place` gives them) and is contiguous is written into that
    target's memory; the others go to one allocation from ``make_dest(bytes,
    source)``, each at an offset aligned for any dtype. Returns the names written
    in place, and the others' tensors."""
    specs = places_of(reader, place)
    direct: List[TensorPlace] = []
    rest: List[TensorPlace] = []
    for spec in specs:
        (direct if fits(targets.get(spec.name), spec) else rest).append(spec)
    places, size = packed(rest)
    with opened_again(reader) as fd:
        scratch = make_dest(size, reader.source)
        pieces = [(spec.begin, spec.end, targets[spec.name].reshape(-1).view(torch.uint8))
                  for spec in direct]
        pieces += [(spec.begin, spec.end, scratch[place.begin:place.end])
                   for spec, place in zip(rest, places)]
        try:
            fill(fd, reader.source, reader.data_start, specs, Scatter(scratch.device, pieces),
                 make_ring)
        except BaseException:
            del scratch, pieces   # the traceback keeps this frame, not the device memory
            raise
    return [spec.name for spec in direct], tensor_views(scratch, places)


def fits(target: Optional[torch.Tensor], spec: TensorPlace) -> bool:
    """Whether tensor `spec` of the file can be written straight into `target`."""
    return (target is not None and target.dtype == spec.dtype
            and tuple(target.shape) == spec.shape and target.is_contiguous()
            and target.numel() * target.element_size() == spec.end - spec.begin)


PACKED_ALIGNMENT = 64   # bytes: every tensor packed into one allocation can view it


def packed(specs: List[TensorPlace]) -> Tuple[List[TensorPlace], int]:
    """`specs` placed one after the other in an allocation of their own, each at
    an offset aligned for any dtype: the places, and the allocation's size."""
    places, offset = [], 0
    for spec in specs:
        offset = -(-offset // PACKED_ALIGNMENT) * PACKED_ALIGNMENT
        places.append(spec._replace(begin=offset, end=offset + spec.end - spec.begin))
        offset += spec.end - spec.begin
    return places, offset


def places_of(reader: Any, place: Place = tensor_place) -> List[TensorPlace]:
    source = reader.source
    return [place(name, reader.info(name), source) for name in reader.offset_keys()]


@contextlib.contextmanager
def opened_again(reader: Any) -> Iterator[int]:
    """A descriptor on the file `reader` opened, opened again by its path and
    checked to be the same file (device, inode, size, modification time)."""
    seen = identity_of(reader)
    with open(seen.location, "rb") as file:
        now = Identity(seen.location, local_version(os.fstat(file.fileno())))
        if now.version != seen.version:
            raise seen.changed(now, "file", "it was opened",
                               "open it again to read the new file")
        yield file.fileno()


def fill(fd: int, source: str, data_start: int, specs: List[TensorPlace], dest: Destination,
         make_ring: MakeRing) -> None:
    """Stream the tensor buffer of the file open as `fd` (the bytes of `specs`)
    into `dest` through ``make_ring(dest, bytes)``."""
    total = max((spec.end for spec in specs), default=0)

    def read(buffer: memoryview, start: int) -> int:
        return read_into(fd, buffer, data_start + start)

    def truncated(offset: int) -> SafetensorError:
        # a read past the end shows where it started; the first byte missing is
        # where the file now ends
        position = max(data_start, min(data_start + offset, os.fstat(fd).st_size))
        spec = tensor_at(specs, position - data_start)
        return SafetensorError(
            f"{source}: tensor {spec.name!r} (file bytes {data_start + spec.begin}.."
            f"{data_start + spec.end}) is cut short: the file ends at byte {position}, "
            f"truncated after its header was read")

    if total:
        hint_sequential(fd, data_start, total)     # the kernel reads further ahead
        try:
            ring = make_ring(dest, total)
            try:
                stream(read, total, ring, truncated)
            finally:
                ring.release()
        except BaseException:
            del dest   # the traceback keeps this frame, not the device memory
            raise
