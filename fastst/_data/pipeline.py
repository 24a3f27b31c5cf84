"""The threads of one iteration of the thread Loader (``fastst._data.loader``): the blocks
a shuffle reads ahead, a window of batches at a time (`BlocksAhead`), and the
gathering of the batches into the Loader's ring of buffers (`Pipeline`), by a
`BatchRing` without the GIL over mapped files, by Python threads over the others."""
from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Protocol,
                    Tuple)

import numpy as np

from .._core import Reader
from .._core._ring import READER_FAILED, BatchRing
from .order import EpochRows
from .rowblocks import BlockEdges, CachedBlocks, RowBlocks

if TYPE_CHECKING:
    import numpy.typing as npt


class Rows(Protocol):
    """The rows of a dataset that an iteration gathers, numbered across its files
    (``fastst._data.loader._Dataset``)."""
    names: Tuple[str, ...]
    rows: int
    starts: npt.NDArray[np.int64]    # each file's first row
    by_ranges: bool                  # read by ranges (URLs, file objects): no page cache

    def fill(self, buffers: Dict[str, Any], rows: npt.NDArray[np.int64]) -> None: ...
    def read_rows(self, rows: npt.NDArray[np.int64]) -> Dict[str, Any]: ...
    def prefetch_blocks(self, blocks: List[int], edges: BlockEdges) -> None: ...
    def cache_rows(self, first: int, stop: int) -> None: ...
    def rows_cached(self, first: int, stop: int) -> bool: ...
    def read_ahead_on_faults(self, on: bool) -> None: ...
    def fits_page_cache(self) -> bool: ...
    def mapped_handles(self) -> Optional[List[Reader]]: ...


class Blocks(NamedTuple):
    """The blocks a shuffled iteration reads ahead: their rows, a window's blocks, the
    batches of the iteration that a window fills, and whether its batches take rows
    from all over the dataset (a full shuffle); a block shuffle's edges this epoch are
    its order's."""
    block_rows: int
    window_blocks: int
    window_batches: int
    scattered: bool


class BlocksAhead:
    """The blocks (`edges`) that a block shuffle's batches take rows from,
    asked for a window of `window` batches at a time (a claim): each claim's blocks not
    asked for before, in their reading order (``BlockEdges.in_reading_order``: a
    window's in the order of the file; a window's blocks are all needed by its
    first batches). A thread that starts gathering a batch claims the windows up to
    `window` batches after it. With a `reader`, the blocks are handed to it as they are
    claimed, in that order, and it may claim the next window itself whenever few
    blocks are left for it to read (``claim_next``); ``wait(position)`` waits until it
    has read every block of batch `position`, and ``follow(on_claim)`` has each claim
    told (the batches whose `needs` are set)."""

    def __init__(self, rows_of: Callable[[int, int], Tuple[npt.NDArray[np.int64],
                                                          npt.NDArray[np.int64]]],
                 batches: int, edges: BlockEdges, window: int,
                 reader: Optional[CachedBlocks] = None) -> None:
        self.rows_of, self.batches = rows_of, batches
        self.edges, self.window, self.reader = edges, window, reader
        # each block's place in the asking (-1: not asked)
        self.places = np.full(edges.count, -1, np.int64)
        self.asked = 0              # blocks asked for
        self.asked_to = 0           # the batches (places in `todo`) asked for: [0, asked_to)
        # for each batch asked for, the blocks asked for up to its last one
        self.needs = np.zeros(batches, np.int64)
        self.on_claim: Optional[Callable[[int], Any]] = None
        self.lock = threading.Lock()

    def claim(self, position: int) -> List[int]:
        """The blocks not asked for yet of the batches up to `window` after batch
        `position`, now counted as asked: the caller asks for them (the reader, if
        there is one, has them already)."""
        wanted = min(self.batches, position + 1 + self.window)
        blocks: List[int] = []
        with self.lock:
            while self.asked_to < wanted:
                blocks += self._claim_window()
        return blocks

    def follow(self, on_claim: Callable[[int], Any]) -> None:
        """Call ``on_claim(claimed)`` now and after each claim: the first `claimed`
        batches have their `needs` set."""
        with self.lock:
            self.on_claim = on_claim
            on_claim(self.asked_to)

    def claim_next(self) -> bool:
        """Claim the next window, if any batch is left to claim (for the reader)."""
        with self.lock:
            if self.asked_to == self.batches:
                return False
            self._claim_window()
            return True

    def _claim_window(self) -> List[int]:
        start, stop = self.asked_to, min(self.batches, self.asked_to + self.window)
        self.asked_to = stop
        rows, firsts = self.rows_of(start, stop)
        of_rows = self.edges.of(rows)
        needed = np.zeros(self.edges.count, np.bool_)    # a mask, not a sort of the rows
        needed[of_rows] = True
        fresh = self.edges.in_reading_order(np.flatnonzero(needed & (self.places < 0)))
        self.places[fresh] = np.arange(self.asked, self.asked + len(fresh))
        self.asked += len(fresh)
        self.needs[start:stop] = np.maximum.reduceat(self.places[of_rows], firsts) + 1
        blocks = fresh.tolist()
        if self.reader is not None:
            self.reader.want(blocks)     # under the lock: in the order of `places`
        if self.on_claim is not None:
            self.on_claim(stop)
        return blocks

    def wait(self, position: int) -> None:
        """Wait until the reader has read every block of batch `position` (claimed)."""
        if self.reader is not None:
            self.reader.wait(int(self.needs[position]))


class Pipeline:
    """Threads that gather the batches `todo` into the ring `slots`, at most `ahead`
    beyond the one taken: batch k (its place in `todo`) goes into slot
    k % len(slots), and is started once batch k - ahead is taken.

    The batches' rows are those of ``order()`` (`EpochRows`) in turn, asked for once
    a full shuffle's reading (which needs no order) has begun. A full shuffle's rows
    are dealt to buckets then (tens of milliseconds over millions of rows), and its
    buckets shuffled as their batches come up: over the ring, on a thread of its own
    (`_lay_out`) that tells the ring which batches have their rows; otherwise by the
    thread that fills a batch. A block shuffle's windows are drawn as its batches are
    claimed (below), the first before its blocks are read, the others while the
    blocks before them are read and gathered.

    Where every file is mapped, a `BatchRing` does it (`_batch_ring`): its threads take
    the batches in order and copy their rows, and the consumer waits for each, without
    the GIL (filling small ones itself meanwhile), so that a batch costs Python no more
    than the consumer's take; a batch that waits for reads waits for the count that
    `CachedBlocks` and the claims below report. Otherwise the consumer hands out the
    batches to start, in order, through a queue (any free thread takes the next); a
    slot's lock, held while it is being filled, is released when its batch is in. With
    `blocks` (a shuffle), a thread that takes a batch first asks for the blocks of the
    batches up to a window after it, those not asked yet (a window at a time), which are
    read ahead while the batches before them are gathered: of local files,
    `CachedBlocks` reads them into the page cache in whole 2 MiB pieces, asking for the
    next windows' itself before it has read those asked (at the disk's pace; nothing
    where the page cache holds the dataset whole), and a batch is gathered once its
    blocks are in; over a dataset larger than half the memory, a block shuffle only asks
    the kernel for them, and gathers its batches at once. Of files read by ranges, a
    block shuffle's `RowBlocks` fetches them whole into memory and gathers the batches
    from there. A full shuffle's batches take rows from nearly every block: over local
    files that the page cache holds, `CachedBlocks` reads them whole, a window's rows at
    a time, in file order, and each batch waits for all; otherwise its rows are read
    where they lie. The consumer's thread never waits for any of these."""

    def __init__(self, dataset: Rows, order: Callable[[], EpochRows],
                 batch_size: int, todo: range, slots: List[Dict[str, Any]], ahead: int,
                 threads: int, blocks: Optional[Blocks] = None) -> None:
        self.dataset, self.batch_size, self.todo = dataset, batch_size, todo
        self.row_blocks: Optional[RowBlocks] = None
        self.cached_blocks: Optional[CachedBlocks] = None
        self.blocks: Optional[BlocksAhead] = None
        self.whole = 0       # with a full shuffle read whole: the pieces each batch waits for
        if blocks is not None and blocks.scattered:
            self._read_whole(blocks)
        try:       # a full shuffle's reading needs no order: it reads while this is made
            self.order = order()
        except BaseException:
            self._stop_readers()
            raise
        self.rows = self.order.rows
        # a full shuffle's order is laid out as its batches are gathered (`_lay_out`)
        self.scattered = blocks is not None and blocks.scattered
        self.slots, self.ahead = slots, min(ahead, len(slots))
        self.stopping = False
        self.failure: Optional[BaseException] = None     # of a thread of the ring
        self.pid = os.getpid()
        try:
            if blocks is not None and not blocks.scattered:
                self._read_blocks(blocks)
            self.ring = self._batch_ring()
        except BaseException:
            self._stop_readers()
            raise
        # the Python threads' hand-out: the batches to start, each slot's lock and error
        self.to_start: queue.SimpleQueue[Optional[int]] = queue.SimpleQueue()
        self.filled = [threading.Lock() for _ in slots] if self.ring is None else []
        self.errors: List[Optional[BaseException]] = [None] * len(self.filled)
        if self.ring is None:
            for position in range(min(self.ahead, len(todo))):
                self._start(position)
        # no more than the batches in flight: the one taken, and `ahead` after it
        self.workers = [threading.Thread(target=self._work if self.ring is None
                                         else self._gather, daemon=True,
                                         name=f"fastst-loader-{k}")
                        for k in range(min(threads, self.ahead + 1, len(todo)))]
        _PIPELINES.add(self)
        try:
            self._start_threads()
        except BaseException:      # a thread the system would not start: the others end
            self.stop()
            raise

    def _start_threads(self) -> None:
        """Start the gathering threads, and tell the ring of the reading ahead."""
        for worker in self.workers:
            worker.start()
        if self.ring is not None and self.cached_blocks is not None:
            self.cached_blocks.follow(self.ring.advance, self.ring.reading_failed)
            if self.blocks is not None:
                self.blocks.follow(functools.partial(self.ring.advance, 0))   # (0, claimed)
        if self.blocks is not None and self.cached_blocks is not None:
            if not self.cached_blocks.reading:    # started last (see _read_blocks)
                self.cached_blocks.ask_more(self.blocks.claim_next)
        if self.ring is not None and self.scattered:
            laying_out = threading.Thread(target=self._lay_out, daemon=True,
                                          name="fastst-loader-order")
            self.workers.append(laying_out)      # joined with the gathering threads
            laying_out.start()

    def _read_whole(self, blocks: Blocks) -> None:
        """Set up the reading of a full shuffle's files whole (see the class)."""
        dataset = self.dataset
        if not dataset.by_ranges and dataset.fits_page_cache():
            piece_rows = blocks.block_rows * blocks.window_blocks
            self.cached_blocks = self._cached_blocks(BlockEdges(piece_rows, dataset.rows))
            self.whole = -(-dataset.rows // piece_rows)
            self.cached_blocks.want(range(self.whole))

    def _read_blocks(self, blocks: Blocks) -> None:
        """Set up the reading ahead of a block shuffle's blocks (see the class)."""
        dataset, batches, edges = self.dataset, len(self.todo), self.order.edges
        assert edges is not None      # a block shuffle's order has its epoch's edges
        if dataset.by_ranges:
            self.row_blocks = self._row_blocks(edges, blocks.window_blocks)
        elif dataset.fits_page_cache():
            self.cached_blocks = self._cached_blocks(edges)
        self.blocks = BlocksAhead(self._rows_of_batches, batches, edges, blocks.window_batches,
                                  self.cached_blocks)
        # The claims begin at once where blocks are read: the first reads start while the
        # ring is made. Where nothing is read, they begin last (__init__): the asking
        # thread then claims window after window, and the ring's ``follow`` would wait
        # for its lock while it claims most of the epoch (a hot epoch's first batch over
        # 2 M rows came 35-84 ms in; 8-9 ms so).
        if self.cached_blocks is not None and self.cached_blocks.reading:
            self.cached_blocks.ask_more(self.blocks.claim_next)

    def _cached_blocks(self, edges: BlockEdges) -> CachedBlocks:
        """The reading of blocks `edges` into the page cache, in the order they are
        asked for, on threads of its own: none where the page cache holds the dataset
        whole (an epoch after the first; the check takes a millisecond over 1 GiB).
        While they read, the gathers' faults read nothing ahead: the first touch of a
        piece just read would start the kernel's read ahead of the pieces after it in
        the file, needed later if at all, before the blocks asked next."""
        dataset = self.dataset
        held_whole = dataset.rows_cached(0, dataset.rows)
        dataset.read_ahead_on_faults(held_whole)
        return CachedBlocks(dataset.cache_rows, edges,
                            threads=0 if held_whole else CachedBlocks.readers,
                            held=dataset.rows_cached)

    def _batch_ring(self) -> Optional[BatchRing]:
        """Where every file is mapped and no batch needs hints of its own (a block
        shuffle whose blocks are only asked for), the ring's gathers and waits run
        without the GIL (`BatchRing`); each batch waits for the reads it needs, as
        `_fill` does."""
        handles = self.dataset.mapped_handles()
        if handles is None or (self.blocks is not None and self.cached_blocks is None):
            return None
        starts = self.dataset.starts.tolist() + [self.dataset.rows]
        needs: Optional[npt.NDArray[np.int64]] = None
        if self.blocks is not None:
            needs = self.blocks.needs
        elif self.scattered:    # each batch waits for its rows laid out, and every piece
            needs = np.full(len(self.todo), self.whole, np.int64)
        return BatchRing(handles, starts, self.dataset.names, self.rows, self.batch_size,
                         self.todo.start, self.todo.step, len(self.todo), self.slots,
                         self.ahead, needs)

    def _lay_out(self) -> None:
        """A full shuffle's order laid out a piece at a time (``EpochRows.ready``), ahead
        of the ring's gathers, each told which batches have their rows."""
        assert self.ring is not None
        order = self.order
        try:
            while not self.stopping and order.done < len(self.rows):
                order.ready(order.done + 1)
                self.ring.advance(0, self._batches_laid_out(order.done))
        except BaseException as error:     # raised in the consumer, at the next batch
            self.failure = error
            self.ring.reading_failed()

    def _batches_laid_out(self, done: int) -> int:
        """How many of the batches to do (places in `todo`, in turn) have their rows
        among the first `done` of the order."""
        if done >= len(self.rows):
            return len(self.todo)
        last = done // self.batch_size - 1            # the last whole batch laid out
        if last < self.todo.start:
            return 0
        return min(len(self.todo), (last - self.todo.start) // self.todo.step + 1)

    def _gather(self) -> None:
        assert self.ring is not None
        try:
            self.ring.work()
        except BaseException as error:     # raised in the consumer, at the next batch
            self.failure = error
            self.ring.reading_failed()

    def size(self, index: int) -> int:
        return min(self.batch_size, len(self.rows) - index * self.batch_size)

    def _start(self, position: int) -> None:
        self.filled[position % len(self.slots)].acquire()    # released by the filling
        self.to_start.put(position)

    def _rows_of(self, position: int) -> npt.NDArray[np.int64]:
        index = self.todo[position]
        self.order.ready((index + 1) * self.batch_size)
        return self.rows[index * self.batch_size:(index + 1) * self.batch_size]

    def _rows_of_batches(self, first: int, stop: int) -> Tuple[npt.NDArray[np.int64],
                                                              npt.NDArray[np.int64]]:
        """The rows of batches [first, stop) (places in `todo`) one after another, and
        where each batch begins among them: one slice of the order where the batches
        follow one another in it (no workers), not a call a batch."""
        if self.todo.step != 1:
            batches = [self._rows_of(position) for position in range(first, stop)]
            return (np.concatenate(batches),
                    np.cumsum([0] + [len(rows) for rows in batches[:-1]]))
        begin, end = self.todo[first] * self.batch_size, self.todo[stop - 1] * self.batch_size
        self.order.ready(end + self.batch_size)
        rows = self.rows[begin:end + self.batch_size]
        return rows, np.arange(0, len(rows), self.batch_size)

    def _row_blocks(self, edges: BlockEdges, window_blocks: int) -> RowBlocks:
        """Blocks in memory for the batches to do: at most two windows' held."""
        taken, _ = self._rows_of_batches(0, len(self.todo))
        counts = np.bincount(edges.of(taken), minlength=edges.count)
        return RowBlocks(self.dataset.read_rows, edges, counts, most=2 * window_blocks,
                         per_read=window_blocks)

    def _work(self) -> None:
        while True:
            position = self.to_start.get()
            if position is None or self.stopping:
                return
            slot = position % len(self.slots)
            try:
                self._fill(position, self.slots[slot])
            except BaseException as error:   # raised in the consumer, at this batch
                self.errors[slot] = error
            finally:
                self.filled[slot].release()

    def _fill(self, position: int, buffers: Dict[str, Any]) -> None:
        rows = self._rows_of(position)
        if self.blocks is None:
            if self.cached_blocks is not None:
                self.cached_blocks.wait(self.whole)
            self.dataset.fill(buffers, rows)
            return
        blocks = self.blocks.claim(position)
        if self.row_blocks is not None:
            self.row_blocks.want(blocks)
            self.row_blocks.fill(buffers, rows)
            return
        if self.cached_blocks is None:
            self.dataset.prefetch_blocks(blocks, self.blocks.edges)
        self.blocks.wait(position)
        self.dataset.fill(buffers, rows)

    def take(self, position: int) -> int:
        """The slot of batch `position`, once gathered; the batch `ahead` after it is
        started."""
        if self.ring is not None:
            return self._ring_slot(self.ring.take(position))
        slot = position % len(self.slots)
        following = position + self.ahead
        if following < len(self.todo):
            self._start(following)
        self.filled[slot].acquire()
        self.filled[slot].release()
        error = self.errors[slot]
        if error is not None:
            self.errors[slot] = None
            raise error
        return slot

    def _stop_readers(self) -> None:
        for reader in (self.row_blocks, self.cached_blocks):
            if reader is not None:
                reader.stop()          # a batch waiting for a block ends at once

    def _ring_slot(self, slot: int) -> int:
        if slot >= 0:
            return slot
        if slot == READER_FAILED:
            error = self.failure
            if error is None and self.cached_blocks is not None:
                error = self.cached_blocks.error
            if error is not None:
                raise error
        raise RuntimeError("the loader stopped while a batch waited for rows")

    def stop(self) -> None:
        if os.getpid() != self.pid:      # a fork's child: the threads and their locks
            return                       # are the parent's
        self.stopping = True
        if self.ring is not None:
            self.ring.stop()
        else:
            for _ in self.workers:
                self.to_start.put(None)
        self._stop_readers()
        for worker in self.workers:
            if worker.ident is not None and worker is not threading.current_thread():
                worker.join()       # a thread that was started
        if self.ring is not None:
            self.ring.close()
        _PIPELINES.discard(self)


_PIPELINES: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _stop_pipelines() -> None:
    """Threads still gathering at interpreter exit (an iterator left unfinished in
    a global) are stopped, not left in a gather while the interpreter ends."""
    for pipeline in list(_PIPELINES):
        pipeline.stop()
