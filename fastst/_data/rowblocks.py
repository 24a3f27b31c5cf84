"""Blocks of rows of a block shuffle, read on a thread of their own ahead of the
batches that need them: into memory for files read by ranges (URLs, file objects),
which have no page cache (``RowBlocks``), and into the page cache for local files
(``CachedBlocks``).

A block shuffle takes its batches' rows from a window of blocks of adjacent rows at a
time. Read by ranges, each row of a batch would be a request of its own; instead
``RowBlocks`` fetches whole blocks, several in one read (their parts in flight at once),
ahead of the batches that need them, and gathers each batch from memory. A block is
dropped as soon as every row the iteration takes from it has been taken, and no more
than `most` blocks are held for later batches, so memory stays within about two windows
of blocks. ``CachedBlocks`` reads a local file's blocks into the page cache in the order
they are asked for, and asks for more on a thread of its own before it has read them
(a dataset the page cache holds whole is read at the disk's pace, not the gathers'); a
batch is gathered from the file once the blocks it needs are in: none of its rows is
faulted in by itself, 4 KiB at a time.
"""
from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import numpy.typing as npt

# rows -> {name: an array of those rows}: how the dataset reads rows, for a block's
Read = Callable[[npt.NDArray[np.int64]], Dict[str, Any]]


class BlockEdges:
    """Blocks of `block_rows` adjacent rows of a dataset of `total` rows: block b from
    row b * block_rows (the last may be shorter), but that the row just before is
    block b's too where ``moved[b]``. A block shuffle gives the row at each edge to the
    block read later (``later_read``): a block's rows then lie in the 2 MiB pieces of
    the file that it is the first to need, and its reading brings no piece of a block
    read after it, as an edge row that straddles two pieces would."""

    def __init__(self, block_rows: int, total: int,
                 moved: Optional[npt.NDArray[np.bool_]] = None,
                 read_at: Optional[npt.NDArray[np.int64]] = None) -> None:
        self.block_rows, self.total = block_rows, total
        self.count = -(-total // block_rows)
        self.moved = moved               # count + 1 of them; None: no row moved
        self.read_at = read_at           # each block's turn to be read; None: in order

    @classmethod
    def later_read(cls, block_rows: int, total: int, blocks: npt.NDArray[np.int64],
                   window_blocks: int) -> "BlockEdges":
        """The edges of an epoch whose blocks come in the order `blocks`, read a window
        of `window_blocks` at a time, a window's in the order of the file: each edge
        row goes with the later read of its two blocks."""
        if block_rows < 2:               # a block of one row would be left with none
            return cls(block_rows, total)
        count = len(blocks)
        window = np.empty(count, np.int64)
        window[blocks] = np.arange(count) // window_blocks
        read_at = window * count + np.arange(count)
        moved = np.zeros(count + 1, np.bool_)
        moved[1:count] = read_at[1:] > read_at[:-1]
        return cls(block_rows, total, moved, read_at)

    def in_reading_order(self, blocks: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """`blocks` (distinct) in the order they are read: a window's before the next
        window's, a window's in the order of the file. Blocks asked for together (a
        claim whose last batches reach into the next window) are read so, as the edge
        rows were given."""
        if self.read_at is None:
            return np.sort(blocks)
        return blocks[np.argsort(self.read_at[blocks], kind="stable")]

    def of(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """The block of each row of `rows`."""
        blocks = rows // self.block_rows
        if self.moved is None:
            return blocks
        # only a block's last row may be the next block's: one row in block_rows
        at_edge = np.flatnonzero(rows % self.block_rows == self.block_rows - 1)
        blocks[at_edge] += self.moved[np.minimum(blocks[at_edge] + 1, self.count)]
        return blocks

    def spans(self, blocks: npt.NDArray[np.int64]) -> Tuple[npt.NDArray[np.int64],
                                                            npt.NDArray[np.int64]]:
        """The first row of each block of `blocks`, and the row after its last."""
        firsts = blocks * self.block_rows
        stops = np.minimum(firsts + self.block_rows, self.total)
        if self.moved is not None:
            firsts = firsts - self.moved[blocks]
            stops = stops - self.moved[blocks + 1]
        return firsts, stops

    def span(self, block: int) -> Tuple[int, int]:
        """Block `block`'s first row, and the row after its last."""
        firsts, stops = self.spans(np.array([block], np.int64))
        return int(firsts[0]), int(stops[0])


class RowBlocks:
    """Blocks of rows of a dataset (`edges`), fetched by `read`.

    Parameters
    ----------
    read : callable
        ``read(rows)`` gives ``{name: array}`` of those rows, read in one call.
    edges : BlockEdges
        The rows of each block.
    counts : ndarray
        For each block, the rows the iteration will take from it: when they are
        all taken, the block is dropped.
    most : int
        Blocks held or being fetched ahead of demand, at most; a block a batch
        waits for is fetched whatever the count.
    per_read : int
        Blocks fetched in one call of `read`, at most.
    """

    def __init__(self, read: Read, edges: BlockEdges, counts: npt.NDArray[np.int64],
                 most: int, per_read: int) -> None:
        self.read, self.edges = read, edges
        self.left = {int(block): int(count) for block, count in enumerate(counts) if count}
        self.most, self.per_read = most, per_read
        self.condition = threading.Condition()
        # a block: the arrays of the read that brought it, and its first row in them
        self.held: Dict[int, Tuple[Dict[str, Any], int]] = {}
        self.fetching: Set[int] = set()
        self.ahead: List[int] = []       # asked for, in the order batches need them
        self.demanded: List[int] = []    # a batch waits for them
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.fetches = 0                 # blocks fetched, for tests: each once
        self.most_held = 0
        self.thread = threading.Thread(target=self._fetch_blocks, daemon=True,
                                       name="fastst-loader-blocks")
        self.thread.start()

    def want(self, blocks: Iterable[int]) -> None:
        """Fetch `blocks` ahead, in this order, as room allows."""
        with self.condition:
            for block in blocks:
                if self._unasked(block):
                    self.ahead.append(block)
            self.condition.notify_all()

    def fill(self, buffers: Dict[str, Any], rows: npt.NDArray[np.int64]) -> None:
        """Gather rows `rows` into `buffers` from their blocks (waiting for those not
        fetched yet), then count them taken. Blocks fetched in one read lie in one
        array: the rows from one read are gathered in one pass, straight into place."""
        found, inverse = np.unique(self.edges.of(rows), return_inverse=True)
        blocks = found.tolist()
        for block in blocks:
            self._wait_for(block)
        homes = [self.held[block] for block in blocks]
        # each row's place in the arrays of the read that brought its block
        shift = np.array([first for _, first in homes], np.int64) - self.edges.spans(found)[0]
        places = rows + shift[inverse]
        reads = [arrays for arrays, _ in homes]
        if all(arrays is reads[0] for arrays in reads):
            for name, array in reads[0].items():
                np.take(array, places, axis=0, out=buffers[name][:len(rows)])
        else:     # a window's edge: rows from two reads or more
            first_of = [[id(other) for other in reads].index(id(arrays)) for arrays in reads]
            read_of = np.array(first_of)[inverse]
            for k in sorted(set(first_of)):
                mine = np.flatnonzero(read_of == k)
                for name, array in reads[k].items():
                    buffers[name][mine] = array[places[mine]]
        self._taken(blocks, np.bincount(inverse, minlength=len(blocks)).tolist())

    def _taken(self, blocks: List[int], counts: List[int]) -> None:
        """Count `counts` rows of `blocks` taken; drop the blocks whose rows all are."""
        with self.condition:
            for block, count in zip(blocks, counts):
                left = self.left.get(block, 0) - count
                if left > 0:
                    self.left[block] = left
                else:
                    self.left.pop(block, None)
                    self.held.pop(block, None)
            self.condition.notify_all()

    def stop(self) -> None:
        """End the fetching thread (after a read under way) and drop every block."""
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        if self.thread is not threading.current_thread():
            self.thread.join()
        self.held.clear()

    def _unasked(self, block: int) -> bool:
        return (block in self.left and block not in self.held and block not in self.fetching
                and block not in self.ahead and block not in self.demanded)

    def _wait_for(self, block: int) -> None:
        with self.condition:
            while block not in self.held:
                if self.error is not None:
                    raise self.error
                if self.stopping:
                    raise RuntimeError("the loader stopped while a batch waited for rows")
                if block not in self.fetching and block not in self.demanded:
                    if block in self.ahead:
                        self.ahead.remove(block)
                    self.demanded.append(block)
                    self.condition.notify_all()
                self.condition.wait()

    def _fetch_blocks(self) -> None:
        while True:
            with self.condition:
                batch = self._next_blocks()
                while batch is None:
                    self.condition.wait()
                    batch = self._next_blocks()
                if not batch:
                    return
                self.fetching.update(batch)
            try:
                rows = np.concatenate([self._rows_of(block) for block in batch])
                read = self.read(rows)
            except BaseException as error:
                with self.condition:
                    self.error = error
                    self.fetching.clear()
                    self.condition.notify_all()
                return
            with self.condition:
                first = 0
                for block in batch:
                    self.held[block] = (read, first)
                    first += len(self._rows_of(block))
                self.fetching.difference_update(batch)
                self.fetches += len(batch)
                self.most_held = max(self.most_held, len(self.held))
                self.condition.notify_all()

    def _next_blocks(self) -> Optional[List[int]]:
        """The blocks to fetch next (those a batch waits for first, then those asked
        ahead while room lasts); [] to end; None to wait."""
        if self.stopping:
            return []
        batch = self.demanded[:self.per_read]
        del self.demanded[:len(batch)]
        room = self.most - len(self.held) - len(self.fetching) - len(batch)
        while self.ahead and room > 0 and len(batch) < self.per_read:
            block = self.ahead.pop(0)
            if block in self.left and block not in self.held:
                batch.append(block)
                room -= 1
        return batch or None

    def _rows_of(self, block: int) -> npt.NDArray[np.int64]:
        return np.arange(*self.edges.span(block), dtype=np.int64)


class CachedBlocks:
    """Blocks of rows of a dataset (`edges`), read into the page
    cache by ``cache(first, stop)`` (rows [first, stop) of every tensor) on `threads`
    threads of their own, a block at a time each, in the order they are asked for;
    ``wait(count)`` returns once the first `count` blocks asked for are in; a waiter
    of its own (``follow``) is told of each change instead. Given ``ask_more(more)``,
    a thread of its own calls ``more()`` whenever fewer than `queued` blocks are left
    to read, which asks for more blocks (``want``) or returns False when there are
    none: the reading threads do not wait for the asking (a block shuffle's claim of
    a window, its shuffle included, takes milliseconds).

    With `threads` 0 (a dataset the page cache holds whole), the blocks count as read
    as they are asked for, with no thread to pass over them. Up to `threads` reads
    are in flight at once, as the kernel's own read ahead has them: a thread that
    has read a block needs a core and the GIL before it asks for the next, and the
    gathers hold the cores. Asked blocks wake one reading thread, which wakes another
    before it reads a block that ``held(first, stop)`` says the page cache does not
    hold: blocks held already, which ``cache`` finds so at once, are passed over by
    one thread, not by every thread woken in turn. Each kind of waiter waits on a
    condition of its own (the reading threads, the asking thread, the batches), all
    over one lock, so that a change wakes the threads it concerns."""

    queued = 32      # blocks left to read, below which more are asked
    readers = 8      # reading threads, unless told otherwise: reads in flight at most

    def __init__(self, cache: Callable[[int, int], Any], edges: BlockEdges,
                 threads: int = readers,
                 held: Callable[[int, int], bool] = lambda first, stop: False) -> None:
        self.cache, self.edges, self.held = cache, edges, held
        self.lock = threading.Lock()
        self.to_read = threading.Condition(self.lock)        # blocks asked, or the end
        self.running_low = threading.Condition(self.lock)    # fewer than `queued` left, or the end
        self.read_in = threading.Condition(self.lock)        # `done` moved, or the end
        self.asked: Deque[int] = collections.deque()
        self.taken = 0                   # blocks a thread took to read, of those asked
        self.done = 0                    # the first blocks asked that are all read
        self.read: Set[int] = set()      # the places of those read after a gap
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.on_read: Optional[Callable[[int], Any]] = None
        self.on_failure: Optional[Callable[[], Any]] = None
        self.threads = [threading.Thread(target=self._read_blocks, daemon=True,
                                         name="fastst-loader-blocks") for _ in range(threads)]
        self.reading = threads
        try:
            for thread in self.threads:
                thread.start()
        except BaseException:      # a thread the system would not start: the others end
            self.stop()
            raise

    def ask_more(self, more: Callable[[], bool]) -> None:
        """Call ``more()`` for more blocks, on a thread of its own, whenever fewer than
        `queued` blocks are left to read."""
        asking = threading.Thread(target=self._ask_more, args=(more,), daemon=True,
                                  name="fastst-loader-claims")
        with self.lock:
            self.threads.append(asking)
        asking.start()

    def follow(self, on_read: Callable[[int], Any], on_failure: Callable[[], Any]) -> None:
        """Call ``on_read(done)`` now and whenever more of the blocks asked for are
        in (`done`: the first of them all read), and ``on_failure()`` if the reading
        fails: under the lock, so that each change is told, in order."""
        with self.lock:
            self.on_read, self.on_failure = on_read, on_failure
            on_read(self.done)
            if self.error is not None:
                on_failure()

    def want(self, blocks: Iterable[int]) -> None:
        """Read `blocks` after those asked for before, in this order; with no reading
        thread (the page cache held the dataset whole), they count as read at once."""
        with self.lock:
            count = len(self.asked)
            self.asked.extend(blocks)
            if not self.reading:
                self.taken = self.done = self.taken + len(self.asked)
                self.asked.clear()
                self._told_read()
            elif len(self.asked) > count:
                self.to_read.notify()

    def wait(self, count: int) -> None:
        """Wait until the first `count` blocks asked for are in the page cache."""
        if self.done >= count:
            return
        with self.lock:
            while self.done < count:
                if self.error is not None:
                    raise self.error
                if self.stopping:
                    raise RuntimeError("the loader stopped while a batch waited for rows")
                self.read_in.wait()

    def stop(self) -> None:
        """End the threads (after the blocks they read) and wake every batch waiting."""
        with self.lock:
            self.stopping = True
            self._wake_all()
        for thread in self.threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join()       # a thread that was started

    def _read_blocks(self) -> None:
        while True:
            with self.lock:
                while not (self.asked or self.stopping or self.error is not None):
                    self.to_read.wait()
                if self.stopping or self.error is not None:
                    return
                block, place = self.asked.popleft(), self.taken
                self.taken += 1
                if len(self.asked) < self.queued:
                    self.running_low.notify()
            try:
                first, stop = self.edges.span(block)
                if not self.held(first, stop):
                    self._call_in_another()
                self.cache(first, stop)
            except BaseException as error:
                self._fail(error)
                return
            with self.lock:
                self.read.add(place)
                if self.done not in self.read:
                    continue                  # read after a gap: `done` stays
                while self.done in self.read:
                    self.read.remove(self.done)
                    self.done += 1
                self._told_read()

    def _told_read(self) -> None:
        """Tell the waiters (under the lock) that `done` moved."""
        if self.on_read is not None:
            self.on_read(self.done)
        self.read_in.notify_all()

    def _call_in_another(self) -> None:
        """Before a read that waits for the disk: wake a reading thread for the next
        block asked, if any."""
        with self.lock:
            if self.asked:
                self.to_read.notify()

    def _ask_more(self, more: Callable[[], bool]) -> None:
        """The asking thread: `more` asks (``want``) under a lock of its own, outside
        this one."""
        while True:
            with self.lock:
                while not (len(self.asked) < self.queued or self.stopping
                           or self.error is not None):
                    self.running_low.wait()
                if self.stopping or self.error is not None:
                    return
            try:
                if not more():
                    return
            except BaseException as error:
                self._fail(error)
                return

    def _fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = error
            if self.on_failure is not None:
                self.on_failure()
            self._wake_all()

    def _wake_all(self) -> None:
        """Wake every thread waiting (under the lock): the reading ends."""
        for condition in (self.to_read, self.running_low, self.read_in):
            condition.notify_all()
