"""Prefetching a plan: the tensors it names (whole, or a run of rows of each) read by
threads into fresh memory within a budget of bytes, and handed out once each, as
their bytes land or when asked for by name.

``prefetch(plan)`` of every handle returns a ``PrefetchLoader``. The plan is checked
whole before anything is read. The loader's
threads read its tensors in file order: several small ones in one read plan, a
larger one in pieces of ``read_options``' request size that the threads share. The
bytes of the tensors admitted and not yet taken (their memory made, being read, or
read) never exceed the budget: a tensor larger than the budget is read by the caller
when it takes it, as is one it takes before the threads reach it. The threads stop when every tensor is read, and
when the loader is closed or dropped.
"""
from __future__ import annotations

import collections
import operator
import threading
import weakref
from typing import (Any, Callable, Deque, Dict, Generic, Iterable, List, Mapping, Optional,
                    Sequence, Tuple)

import numpy as np

from .._core import (Reader, SafetensorError, SafetensorIndexError, SafetensorTypeError, TensorInfo,
                     dtype_bits, read_options, read_runs, read_threads)
from .slicing import T

__all__ = ["MAX_THREADS", "Plan", "PrefetchLoader", "checked_plan", "planned_tensors"]

# What a plan maps each tensor's name to: None for all of it, or a slice of its rows
Plan = Mapping[str, Optional[slice]]
MAX_THREADS = 64     # as many as read_options gives a read plan at most

# what became of a tensor of the plan: ADMITTED, within the budget, its array made and
# not yet read
PENDING, ADMITTED, READING, LANDED, LEFT, HANDED_OUT = range(6)


def checked_plan(plan: Optional[Plan], source: str) -> Optional[Dict[str, Optional[slice]]]:
    """`plan` as a dict of tensor name to None or a slice; None (every tensor) as it is."""
    if plan is None:
        return None
    if not isinstance(plan, Mapping):
        names = isinstance(plan, Iterable) and not isinstance(plan, (str, bytes))
        hint = ("; to ask the kernel to read tensors into the page cache, call "
                "will_need(names)") if names else ""
        raise SafetensorTypeError(f"invalid prefetch plan: {source}: a plan is a dict of "
                                  f"tensor name to None or a slice (got "
                                  f"{type(plan).__name__}){hint}")
    checked = dict(plan)
    if not checked:
        raise SafetensorError(f"invalid prefetch plan: {source}: the plan selects no tensors")
    for name, rows in checked.items():
        if not isinstance(name, str):
            raise SafetensorTypeError(f"invalid prefetch plan: {source}: tensor names are "
                                      f"str (got {type(name).__name__})")
        if rows is not None and not isinstance(rows, slice):
            raise SafetensorTypeError(f"invalid prefetch plan: {source}: tensor {name!r}: "
                                      f"expected None or a slice (got {type(rows).__name__})")
    return checked


class _Tensor:
    """One tensor of a plan: where its bytes are, what it is handed out as, and what
    became of it (its state, and its array or the error that reading it met)."""
    __slots__ = ("reader", "name", "info", "skip", "nbytes", "shape", "whole", "convert",
                 "state", "array", "error", "pieces_left")

    def __init__(self, reader: Any, name: str, info: TensorInfo, rows: Optional[range],
                 convert: Optional[Callable[[Any, str, TensorInfo], Any]]) -> None:
        self.reader, self.name, self.convert = reader, name, convert
        self.whole = rows is None
        begin, end = info.data_offsets
        array_shape = info.array_shape or ()
        if rows is None:
            self.info, self.skip, self.nbytes, self.shape = info, 0, end - begin, array_shape
        else:
            row_bytes = (end - begin) // info.shape[0] if info.shape[0] else 0
            self.skip, self.nbytes = rows.start * row_bytes, len(rows) * row_bytes
            self.shape = (len(rows),) + tuple(array_shape[1:])
            self.info = info._replace(shape=[len(rows)] + list(info.shape[1:]),
                                      data_offsets=(begin + self.skip,
                                                    begin + self.skip + self.nbytes),
                                      array_shape=self.shape)
        self.state = PENDING
        self.array: Any = None
        self.error: Optional[BaseException] = None
        self.pieces_left = 0

    def allocate(self) -> None:
        self.array = np.empty(self.shape, self.reader.array_dtype(self.info.dtype))

    def bytes_of(self, start: int, stop: int) -> Any:
        """Bytes [start, stop) of its array, as a flat uint8 array."""
        return self.array.reshape(-1).view(np.uint8)[start:stop]

    def read_part(self, start: int, stop: int) -> None:
        """Its bytes [start, stop) read into its array (by the core's read plan, whose
        threads share a large one)."""
        if stop > start:
            read_runs(self.reader, self.name, [self.skip + start], stop - start,
                      self.bytes_of(start, stop))

    def verify(self) -> None:
        """Its checksum checked, when its handle verifies: of the bytes read for a whole
        tensor; of the whole tensor, read again, for rows of it."""
        check = getattr(self.reader, "check", None)
        if check is not None and self.error is None:
            try:
                check(self.name, self.array) if self.whole else check(self.name)
            except BaseException as error:
                self.error = error.with_traceback(None)

    def read_now(self) -> None:
        """Read whole by the calling thread, its error kept to raise when handed out."""
        try:
            if self.array is None:
                self.allocate()
            self.read_part(0, self.nbytes)
        except BaseException as error:
            self.error = error.with_traceback(None)
        self.verify()

    def handed_out(self) -> Any:
        """What the caller is given: the tensor, or the error its reading met."""
        array, error = self.array, self.error
        self.array = self.error = None
        if error is not None:
            raise error
        return array if self.convert is None else self.convert(array, self.name, self.info)


def planned_tensors(reader: Any, plan: Optional[Dict[str, Optional[slice]]],
                    convert: Optional[Callable[[Any, str, TensorInfo], Any]]) -> List[_Tensor]:
    """The tensors a checked `plan` selects from the file `reader` (a NumpyHandle)
    reads, in file order, each with the rows its slice selects checked; every tensor
    whole for a plan of None."""
    in_order = reader.offset_keys()
    if plan is not None:
        for name in plan:
            reader.info(name)      # TensorNotFoundError for a name the file does not hold
        in_order = [name for name in in_order if name in plan]
    tensors = []
    for name in in_order:
        info = reader.info(name)
        if info.array_shape is None:
            Reader.get_tensor(reader, name)     # raises the error that says why
        rows = None if plan is None else plan[name]
        tensors.append(_Tensor(reader, name, info, None if rows is None else
                               _rows(reader.source, name, info, rows), convert))
    return tensors


def _rows(source: str, name: str, info: TensorInfo, rows: slice) -> range:
    """The rows `rows` selects of the tensor's first axis: a slice of step 1, within
    it (negative bounds count from its end; nothing is clamped), of whole bytes."""
    where = f"invalid prefetch plan slice: {source}: tensor {name!r}"
    if rows.step is not None and rows.step != 1:
        raise SafetensorError(f"{where}: step {_short(rows.step)}; a plan reads rows with "
                              f"step 1")
    if not info.shape:
        raise SafetensorError(f"{where} is 0-d: it has no rows to slice")
    count = info.shape[0]
    start, stop = (_bound(where, bound, default, count)
                   for bound, default in ((rows.start, 0), (rows.stop, count)))
    if not (0 <= start <= count and 0 <= stop <= count) or start > stop:
        raise SafetensorIndexError(f"{where}: slice({_short(rows.start)}, {_short(rows.stop)}) "
                                   f"is out of range of its {count} rows (a plan is not "
                                   f"clamped)")
    bits = dtype_bits(info.dtype)
    row_bits = int(np.prod(info.shape[1:], dtype=object)) * bits
    if row_bits % 8:
        raise SafetensorError(f"{where}: a row of {info.dtype} {info.shape} is {row_bits} "
                              f"bits, not whole bytes")
    return range(start, stop)


def _short(value: Any) -> str:
    """`value`'s repr, cut to 40 characters: a plan's bound may be any object."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _bound(where: str, bound: Any, default: int, count: int) -> int:
    if bound is None:
        return default
    try:
        at = operator.index(bound)
    except TypeError:
        raise SafetensorTypeError(f"{where}: the bounds of a slice are integers (got "
                                  f"{type(bound).__name__})") from None
    return at + count if at < 0 else at


class _Loading:
    """What the loader's threads and its callers share, under `lock`. The threads
    hold this, never the loader, so that dropping the loader stops them.

    The caller's thread admits tensors to the budget, making their arrays: memory
    made by one thread and dropped by another waits, on a free-threaded Python, for
    the first to run again, and a thread that waits on the budget would hold the
    memory of the tensors it read past the budget's end. The threads read what was
    admitted, in file order."""

    def __init__(self, tensors: Sequence[_Tensor], budget: int, piece: int) -> None:
        self.lock = threading.Condition()
        self.tensors = list(tensors)
        self.by_name = {tensor.name: tensor for tensor in tensors}
        self.budget, self.piece = budget, piece
        self.cursor = 0                      # the threads' next tensor, in file order
        self.pieces: Deque[Tuple[_Tensor, int, int]] = collections.deque()
        self.landed: Deque[_Tensor] = collections.deque()      # in the order they landed
        self.left: Deque[_Tensor] = collections.deque()        # for the caller to read
        self.held = self.peak = 0            # bytes admitted and not taken
        self.admitted = 0                    # the next tensor to admit, in file order
        self.ready = 0                       # tensors admitted and not yet read
        self.reading = 0                     # tensors the threads are reading
        self.waiting = len(self.tensors)     # tensors not handed out
        self.workers = 0
        self.closed = False

    # -- the threads' side (each with the lock held) --------------------------------

    def next_read(self) -> Optional[Callable[[], List[_Tensor]]]:
        """What a thread reads next, once admitted: a piece of a tensor read in
        pieces, or several small tensors; None when nothing is left."""
        while not self.closed:
            if self.pieces:
                return self._piece(*self.pieces.popleft())
            while (self.cursor < len(self.tensors)
                   and self.tensors[self.cursor].state not in (PENDING, ADMITTED)):
                self.cursor += 1
            if self.cursor == len(self.tensors):
                return None
            tensor = self.tensors[self.cursor]
            if tensor.state == PENDING:
                self.lock.wait()
            elif tensor.whole and tensor.nbytes <= self.piece:
                return self._batch_from(tensor)
            else:
                self._start(tensor)
                self._split(tensor)
        return None

    def _leave(self, tensor: _Tensor) -> None:
        tensor.state = LEFT
        self.left.append(tensor)
        self.lock.notify_all()

    def _start(self, tensor: _Tensor) -> None:
        tensor.state = READING
        self.ready -= 1
        self.reading += 1

    def _split(self, tensor: _Tensor) -> None:
        starts = range(0, tensor.nbytes or 1, self.piece)    # rows of no bytes: one piece
        tensor.pieces_left = len(starts)
        self.pieces.extend((tensor, start, min(start + self.piece, tensor.nbytes))
                           for start in starts)
        self.lock.notify_all()      # threads waiting on the budget share the pieces

    def _batch_from(self, first: _Tensor) -> Callable[[], List[_Tensor]]:
        """`first` and the small whole tensors of its file that follow it, up to a
        piece's bytes and the room in the budget."""
        batch, total = [], 0
        for k in range(self.cursor, len(self.tensors)):
            tensor = self.tensors[k]
            if tensor.state == PENDING:
                break
            if tensor.state != ADMITTED:
                continue
            if (tensor.reader is not first.reader or not tensor.whole
                    or total + tensor.nbytes > self.piece):
                break
            batch.append(tensor)
            total += tensor.nbytes
        for tensor in batch:
            self._start(tensor)
        return lambda: _read_batch(batch)

    def _piece(self, tensor: _Tensor, start: int, stop: int) -> Callable[[], List[_Tensor]]:
        def read() -> List[_Tensor]:
            try:
                tensor.read_part(start, stop)
            except BaseException as error:
                tensor.error = tensor.error or error.with_traceback(None)
            with self.lock:
                tensor.pieces_left -= 1
                done = tensor.pieces_left == 0
            if done:
                tensor.verify()
            return [tensor] if done else []
        return read

    def land(self, tensors: List[_Tensor]) -> None:
        for tensor in tensors:
            self.reading -= 1
            if self.closed:
                tensor.array = None
                continue
            tensor.state = LANDED
            if tensor.error is not None:    # holds no bytes
                tensor.array = None
                self.held -= tensor.nbytes
            self.landed.append(tensor)
        self.admit()                        # what errors freed, whether the caller calls or not
        self.lock.notify_all()

    def worker_done(self) -> None:
        """A thread ends: the last one leaves to the caller what no thread will read
        (when one ended on an error of its own)."""
        self.workers -= 1
        if self.workers == 0 and not self.closed:
            for tensor in self.tensors[self.cursor:]:
                if tensor.state == ADMITTED:
                    self._release(tensor)
                if tensor.state == PENDING:
                    self._leave(tensor)
        self.lock.notify_all()

    # -- the caller's side (each with the lock held) --------------------------------

    def admit(self) -> None:
        """Admit the tensors the threads read next, in file order, as far as the budget
        has room: their arrays made here (a tensor over the whole budget is left to the
        caller)."""
        admitted = False
        while self.admitted < len(self.tensors) and not self.closed:
            tensor = self.tensors[self.admitted]
            if tensor.state == PENDING and tensor.nbytes > self.budget:
                self._leave(tensor)
            elif tensor.state == PENDING:
                if self.held + tensor.nbytes > self.budget:
                    break
                try:
                    tensor.allocate()
                except MemoryError as error:    # handed out as the error, holding nothing
                    tensor.error = error.with_traceback(None)
                    tensor.state = LANDED
                    self.landed.append(tensor)
                else:
                    tensor.state = ADMITTED
                    self.ready += 1
                    self.held += tensor.nbytes
                    self.peak = max(self.peak, self.held)
                admitted = True
            self.admitted += 1
        if admitted:
            self.lock.notify_all()

    def _release(self, tensor: _Tensor) -> None:
        """An admitted tensor no thread will read: back to PENDING, its bytes freed."""
        tensor.state = PENDING
        tensor.array = None
        self.ready -= 1
        self.held -= tensor.nbytes

    def hand_over(self, tensor: _Tensor) -> None:
        """`tensor` is the caller's now."""
        if tensor.state == ADMITTED:
            self.ready -= 1
            self.held -= tensor.nbytes      # its array goes with it: the caller reads it
        elif tensor.state == LANDED and tensor.error is None:
            self.held -= tensor.nbytes
        tensor.state = HANDED_OUT
        self.waiting -= 1
        self.admit()
        self.lock.notify_all()

    def first_of(self, queue: Deque[_Tensor], state: int) -> Optional[_Tensor]:
        """The first tensor of `queue` still in `state` (those taken by name meanwhile
        are dropped from it)."""
        while queue and queue[0].state != state:
            queue.popleft()
        return queue.popleft() if queue else None

    def stop(self) -> None:
        self.closed = True
        for tensor in self.tensors:
            if tensor.state in (ADMITTED, LANDED):
                tensor.array = None
        self.landed.clear()
        self.pieces.clear()
        self.held = 0
        self.lock.notify_all()


def _read_batch(batch: List[_Tensor]) -> List[_Tensor]:
    """Small whole tensors of one file, read by one read plan into fresh arrays; each
    read alone when the plan fails, so that each has its own outcome."""
    try:
        Reader.read_into(batch[0].reader, {tensor.name: tensor.array for tensor in batch})
    except BaseException:
        for tensor in batch:
            tensor.read_now()
        return batch
    for tensor in batch:
        tensor.verify()
    return batch


def _work(loading: _Loading) -> None:
    try:
        while True:
            with loading.lock:
                read = loading.next_read()
            if read is None:
                return
            landed = read()
            with loading.lock:
                loading.land(landed)
    finally:
        with loading.lock:
            loading.worker_done()


class PrefetchLoader(Generic[T]):
    """The tensors of a prefetch plan, read ahead by threads within a budget of
    bytes and handed out once each: what a handle's ``prefetch(plan)`` returns.

    ``take(name)`` hands out one tensor (waiting for its bytes); iterating hands
    out ``(name, tensor)`` as their bytes land, skipping those already taken. Each
    tensor goes out once: taking it again is an error. Its threads read the
    tensors in file order, and stop when every one is read, and when the loader
    is closed (it is a context manager) or dropped. Tensors handed out stay valid
    after it is closed.

    The bytes read and not yet handed out, with those being read, never exceed
    `max_bytes_in_flight`: a tensor larger than that is read by the caller when
    it takes it (or when the iteration reaches it, once nothing else is being
    read), as is a tensor taken before the threads reach it.

    Parameters
    ----------
    tensors : sequence
        The plan's tensors, in file order (made by ``prefetch``).
    source : str
        What error messages call the file or checkpoint.
    threads : int, optional
        The threads that read, 1 to 64; None for as many as share a read plan
        (see ``fastst.read_options``).
    max_bytes_in_flight : int, default 256 MiB
        The budget.

    Raises
    ------
    SafetensorError
        When the plan selects no tensors, or `threads` or `max_bytes_in_flight`
        is out of range.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({f"w{i}": np.full((4, 2), i, np.float32) for i in range(3)}, path)
    >>> with fastst.safe_open(path) as f, f.prefetch({"w2": slice(1, 3), "w0": None}) as tensors:
    ...     tensors.names(), tensors.take("w2").tolist(), [name for name, _ in tensors]
    (['w0', 'w2'], [[2.0, 2.0], [2.0, 2.0]], ['w0'])
    """

    __module__ = "fastst"

    def __init__(self, tensors: Sequence[_Tensor], source: str, *, threads: Optional[int],
                 max_bytes_in_flight: int) -> None:
        if not tensors:
            raise SafetensorError(f"invalid prefetch plan: {source}: the plan selects no "
                                  f"tensors")
        threads = read_threads() if threads is None else threads
        for what, value, low, high in (("threads", threads, 1, MAX_THREADS),
                                       ("max_bytes_in_flight", max_bytes_in_flight, 1, None)):
            if (isinstance(value, bool) or not isinstance(value, int) or value < low
                    or high is not None and value > high):
                rule = f"an integer from {low} to {high}" if high else "a positive integer"
                raise SafetensorError(f"{source}: {what} must be {rule}, got {value!r}")
        self.source = source
        self.threads = threads
        self.max_bytes_in_flight = max_bytes_in_flight
        self._loading = _Loading(tensors, max_bytes_in_flight, read_options().request_bytes)
        with self._loading.lock:
            self._loading.admit()
        pieces = sum(max(1, -(-tensor.nbytes // self._loading.piece)) for tensor in tensors)
        self._threads = [threading.Thread(target=_work, args=(self._loading,),
                                          name="fastst-prefetch", daemon=True)
                         for _ in range(min(threads, pieces))]
        self._loading.workers = len(self._threads)
        for thread in self._threads:
            thread.start()
        self._stop = weakref.finalize(self, _stop_threads, self._loading, self._threads)

    @property
    def peak_bytes(self) -> int:
        """The most bytes the loader has held at once: being read, or read and not
        taken (at most `max_bytes_in_flight`)."""
        return self._loading.peak

    def names(self) -> List[str]:
        """The names of the plan's tensors, in file order.

        Returns
        -------
        list of str
        """
        return [tensor.name for tensor in self._loading.tensors]

    def __len__(self) -> int:
        return len(self._loading.tensors)

    def take(self, name: str) -> T:
        """Tensor `name` of the plan, once its bytes are read: read now, by the
        calling thread, when the threads have not started on it.

        Parameters
        ----------
        name : str
            A tensor of the plan.

        Returns
        -------
        numpy.ndarray or torch.Tensor or jax.Array
            The tensor, or the rows of it the plan names, in fresh memory (on the
            handle's device, or the one ``prefetch`` was given).

        Raises
        ------
        SafetensorError
            When the plan has no tensor `name`, it was handed out already, the
            loader is closed, or reading it failed (a file truncated or replaced,
            a handle closed: the error that says so).
        """
        loading = self._loading
        with loading.lock:
            tensor = loading.by_name.get(name) if isinstance(name, str) else None
            if tensor is None:
                shown = name if isinstance(name, str) and len(name) <= 80 else _short(name)
                raise SafetensorError(f"tensor {shown} is not in the prefetch plan: "
                                      f"{self.source}")
            while tensor.state == READING and not loading.closed:
                loading.lock.wait()
            self._check_open()
            if tensor.state == HANDED_OUT:
                raise SafetensorError(f"tensor already delivered: {self.source}: tensor "
                                      f"{name!r} was handed out before (each tensor of a "
                                      f"prefetch plan goes out once, by take or iteration)")
            read_here = tensor.state != LANDED
            loading.hand_over(tensor)
        if read_here:
            tensor.read_now()
        return tensor.handed_out()  # type: ignore[no-any-return]

    def __iter__(self) -> PrefetchLoader[T]:
        return self

    def __next__(self) -> Tuple[str, T]:
        loading = self._loading
        with loading.lock:
            while True:
                self._check_open()
                tensor = loading.first_of(loading.landed, LANDED)
                read_here = tensor is None and loading.reading == loading.ready == 0
                if read_here:
                    tensor = loading.first_of(loading.left, LEFT)
                if tensor is not None:
                    loading.hand_over(tensor)
                    break
                if loading.waiting == 0:
                    raise StopIteration
                loading.lock.wait()
        if read_here:
            tensor.read_now()
        return tensor.name, tensor.handed_out()

    def _check_open(self) -> None:
        if self._loading.closed:
            raise SafetensorError(f"prefetch loader closed: {self.source}")

    def close(self) -> None:
        """Stop the threads and drop what they read and was not taken (waits for the
        reads in flight, a piece or a few small tensors each)."""
        self._stop()

    def __enter__(self) -> PrefetchLoader[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._loading.closed else f"{self._loading.waiting} to hand out"
        return f"<fastst.PrefetchLoader {self.source!r}: {len(self)} tensors ({state})>"


def _stop_threads(loading: _Loading, threads: List[threading.Thread]) -> None:
    with loading.lock:
        loading.stop()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()
