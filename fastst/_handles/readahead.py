"""Reading ahead: a file's tensors read by a background thread, within a budget of
bytes, while the caller works on the tensor it was given.

``iter_tensors`` of every handle returns a ``ReadAhead``. Its thread reads the tensors
in the order asked for, several small ones in one read plan, into fresh memory (a read
plan shares its requests among the core's reading threads); the caller takes them in
that order. The bytes read and not yet taken, with those being read, never exceed the
budget, except for a tensor larger than the budget, which is read alone, once every
tensor before it has been taken. The thread stops when the iterator is exhausted,
closed, left by ``break`` or an exception, or garbage collected.
"""
from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Deque, Generic, Iterator, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from .._core import SafetensorError
from .._io.limits import DEFAULT_PREFETCH_BYTES

T = TypeVar("T")

# consecutive tensors are read in one plan up to this many bytes, and a quarter of the
# budget: a plan's bytes are taken from the budget together, so smaller plans keep it full
BATCH_BYTES = 8 << 20

# (what reads it: a NumPy handle, its name, and what makes the caller's tensor of the array)
Step = Tuple[Any, str, Optional[Callable[[Any, str], Any]]]


def tensor_bytes(reader: Any, name: str) -> int:
    begin, end = reader.info(name).data_offsets
    return int(end - begin)


class _Shared:
    """What the reading thread and the caller share. The thread holds this, never
    the ReadAhead, so that dropping the iterator collects it and stops the thread."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.lock = threading.Condition()
        self.ready: Deque[Tuple[str, Any, Optional[BaseException], int]] = collections.deque()
        self.held = 0           # bytes read ahead and not taken, and those being read
        self.peak = 0
        self.stopped = False
        self.finished = False

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            self.ready.clear()
            self.held = 0
            self.lock.notify_all()

    def reserve(self, nbytes: int) -> bool:
        """Wait until `nbytes` more fit the budget (or nothing is held: a batch larger
        than the budget is read alone); False once stopped."""
        with self.lock:
            while not self.stopped and self.held and self.held + nbytes > self.budget:
                self.lock.wait()
            if self.stopped:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def hand_over(self, items: List[Tuple[str, Any, Optional[BaseException], int]]) -> None:
        with self.lock:
            if not self.stopped:
                self.ready.extend(items)
                self.lock.notify_all()

    def take(self) -> Optional[Tuple[str, Any, Optional[BaseException], int]]:
        """The next tensor read, once it is; None when every one has been taken."""
        with self.lock:
            while not self.ready and not self.finished and not self.stopped:
                self.lock.wait()
            if not self.ready:
                return None
            item = self.ready.popleft()
            self.held -= item[3]
            self.lock.notify_all()
            return item


def _batches(steps: Sequence[Step], budget: int) -> Iterator[List[Tuple[Step, int]]]:
    """Consecutive steps of one reader, together up to BATCH_BYTES and a quarter of
    the budget; a step larger than that alone."""
    batch: List[Tuple[Step, int]] = []
    total = 0
    limit = min(BATCH_BYTES, budget // 4)
    for step in steps:
        nbytes = tensor_bytes(step[0], step[1])
        if batch and (step[0] is not batch[0][0][0] or total + nbytes > limit):
            yield batch
            batch, total = [], 0
        batch.append((step, nbytes))
        total += nbytes
    if batch:
        yield batch


def _read_batch(batch: List[Tuple[Step, int]]) -> List[Tuple[str, Any]]:
    """The batch's tensors, read into fresh arrays by one plan of their reader."""
    reader = batch[0][0][0]
    arrays = {}
    for (_, name, _), _ in batch:
        info = reader.info(name)
        if info.array_shape is None:
            reader.get_tensor(name)     # raises the error that says why
        arrays[name] = np.empty(info.array_shape, reader.array_dtype(info.dtype))
    reader.read_into(arrays)
    return list(arrays.items())


def _read_ahead(shared: _Shared, steps: Sequence[Step]) -> None:
    try:
        for batch in _batches(steps, shared.budget):
            nbytes = sum(size for _, size in batch)
            if not shared.reserve(nbytes):
                return
            try:
                arrays = _read_batch(batch)
            except BaseException as error:   # raised in the caller, at this batch's first
                shared.hand_over([(batch[0][0][1], None, error.with_traceback(None), nbytes)])
                return
            shared.hand_over([(name, array, None, size)
                              for (name, array), (_, size) in zip(arrays, batch)])
            del arrays
    finally:
        with shared.lock:
            shared.finished = True
            shared.lock.notify_all()


class ReadAhead(Generic[T]):
    """An iterator of ``(name, tensor)`` over tensors read ahead by a background
    thread within a budget of bytes (see ``NumpyHandle.iter_tensors``).

    Attributes
    ----------
    prefetch_bytes : int
        The budget: bytes read ahead and not yet taken, those being read included.
    peak_bytes : int
        The most bytes it has held at once (above `prefetch_bytes` only for a tensor
        larger than it, read alone).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"a": np.zeros(4), "b": np.ones(4)}, path)
    >>> with fastst.safe_open(path) as f, f.iter_tensors(prefetch_bytes=64) as tensors:
    ...     [(name, float(t.sum())) for name, t in tensors], tensors.peak_bytes <= 64
    ([('a', 0.0), ('b', 4.0)], True)
    """

    def __init__(self, steps: Sequence[Step], prefetch_bytes: int) -> None:
        if (isinstance(prefetch_bytes, bool) or not isinstance(prefetch_bytes, int)
                or prefetch_bytes < 1):
            raise SafetensorError(f"prefetch_bytes must be a positive integer, got "
                                  f"{prefetch_bytes!r}")
        self.prefetch_bytes = prefetch_bytes
        self._converts = {name: convert for _, name, convert in steps}
        self._shared = _Shared(prefetch_bytes)
        self._thread = threading.Thread(target=_read_ahead, args=(self._shared, list(steps)),
                                         name="fastst-read-ahead", daemon=True)
        self._thread.start()
        self._stop = weakref.finalize(self, _stop_thread, self._shared, self._thread)

    @property
    def peak_bytes(self) -> int:
        """The most bytes read ahead at once."""
        return self._shared.peak

    def __iter__(self) -> ReadAhead[T]:
        return self

    def __next__(self) -> Tuple[str, T]:
        item = self._shared.take()
        if item is None:
            self.close()
            raise StopIteration
        name, array, error, _ = item
        if error is not None:
            self.close()
            raise error
        convert = self._converts[name]
        return name, (array if convert is None else convert(array, name))

    def close(self) -> None:
        """Stop the reading thread and drop what it read ahead (waits for the read
        in flight, at most one plan)."""
        self._stop()

    def __enter__(self) -> ReadAhead[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _stop_thread(shared: _Shared, thread: threading.Thread) -> None:
    shared.stop()
    if thread is not threading.current_thread():
        thread.join()


class ChainedReadAhead(Generic[T]):
    """Read-aheads one after another (a sharded checkpoint's, shard by shard): each
    made when the one before is exhausted, so that at most one runs at a time."""

    def __init__(self, parts: Sequence[Callable[[], ReadAhead[T]]], prefetch_bytes: int) -> None:
        self.prefetch_bytes = prefetch_bytes
        self._parts = list(parts)
        self._current: Optional[ReadAhead[T]] = None
        self._peak = 0

    @property
    def peak_bytes(self) -> int:
        """The most bytes read ahead at once."""
        current = self._current.peak_bytes if self._current is not None else 0
        return max(self._peak, current)

    def __iter__(self) -> ChainedReadAhead[T]:
        return self

    def __next__(self) -> Tuple[str, T]:
        while True:
            if self._current is None:
                if not self._parts:
                    raise StopIteration
                self._current = self._parts.pop(0)()
            try:
                return next(self._current)
            except StopIteration:
                self._peak = max(self._peak, self._current.peak_bytes)
                self._current = None
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop the reading thread of the part being read, and make no other."""
        self._parts = []
        if self._current is not None:
            self._peak = max(self._peak, self._current.peak_bytes)
            self._current.close()
            self._current = None

    def __enter__(self) -> ChainedReadAhead[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
