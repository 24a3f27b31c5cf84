"""The thread Loader's engine (the core's second extension): its ring of batches and its shuffles."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

from .reader import Reader

def last_level_cache() -> int:
    """The bytes of the first CPU's last level of cache, as Linux describes it (glibc's
    sysconf adds up a whole package's); 32 MiB where it cannot be told."""

READER_FAILED: Final[int]
STOPPED: Final[int]
WATCH_FROM_FILES: int
TAKER_FILLS_BATCH_BYTES: int

class BatchRing:
    """Threads that gather batches of rows of several tensors, from the maps of one
    or more files (numbered across them), into a ring of batch buffers, and the
    consumer's side: each thread's loop (``work``) and each batch's wait (``take``)
    run without the GIL, so that no batch costs Python anything but its ``take``
    (the thread Loader's gathers over mapped files).

    Batch k of an iteration (its place) holds rows ``order[(first + k * step) *
    batch_rows:]`` (at most `batch_rows` of them) and goes into slot k % len(slots)
    once batch k - ahead is taken. With `needs` (one per place), place k waits until
    ``advance`` has said that ``needs[k]`` reads are done and that k's need is set;
    without, none waits. The maps stay while the ring does, whatever becomes of the
    handles; each file is held open until ``close``. A batch takes rows from a file
    only while it is no shorter than mapped: over WATCH_FROM_FILES files or more
    (`watch` None; True: any number), a file on a local file system is watched
    (inotify) and checked again (``fstat``) only when the kernel says it changed;
    any other file (all of them with `watch` False, or where there is no inotify) is
    checked before each batch that takes rows from it. A file cut short while a
    batch's rows are copied ends the batch too (the copy's fault is caught).
    """
    def __init__(self, handles: list[Reader], starts: list[int], names: tuple[str, ...],
                 order: npt.NDArray[np.int64], batch_rows: int, first: int, step: int,
                 count: int, slots: list[dict[str, npt.NDArray[Any]]], ahead: int,
                 needs: npt.NDArray[np.int64] | None = None,
                 watch: bool | None = None) -> None: ...
    @property
    def streams(self) -> bool:
        """Whether its copies of rows of whole 128-byte lines bypass the cache (a ring
        larger than twice the last level of cache, where the CPU can)."""
    @property
    def files_watched(self) -> int:
        """The files whose changes the kernel reports."""
    @property
    def files_checked(self) -> int:
        """The checks of a file's length (fstat calls) made so far."""
    @staticmethod
    def can_stream() -> bool:
        """Whether this CPU has the stores that bypass the cache (AVX2)."""
    def work(self) -> None:
        """A gathering thread's loop: returns once no batch is left, or at ``stop``."""
    def take(self, place: int) -> int:
        """Wait for batch `place` (taken in order) and return its slot, filling the
        batches no thread has started meanwhile where they are small
        (TAKER_FILLS_BATCH_BYTES) and their reads are done; READER_FAILED where the
        reading it waited for failed, STOPPED where the ring stopped first. A file cut
        short raises the SafetensorError that says so; a signal's handler
        (Ctrl-C's) runs while it waits, and what it raises comes out of the wait."""
    def advance(self, ready: int, claimed: int = 0) -> None:
        """`ready` reads are done, and the needs of the first `claimed` places are set
        (after ``close``: nothing to do)."""
    def reading_failed(self) -> None:
        """The reading the batches wait for failed: each waiting batch ends READER_FAILED."""
    def stop(self) -> None:
        """End the threads' loops (after the batches they are copying) and every wait."""
    def close(self) -> None:
        """Once the threads have returned from ``work``: close the files and let go of
        the maps and the buffers (a map goes once nothing else holds it)."""

SHUFFLE_BUCKET_ROWS: Final[int]

def deal_rows(total: int, bit_generator: np.random.BitGenerator, bucket_rows: int = ...,
              /) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Rows ``0..total-1`` dealt at random to ``ceil(total / bucket_rows)`` buckets (at
    most 65,536), from `bit_generator` (left past its draws), without the GIL: the rows
    bucket after bucket (each bucket's in order), and where each bucket ends among
    them. Each bucket then shuffled in turn by ``shuffle_rows`` from the same generator
    makes a uniformly drawn permutation, each bucket shuffled in the CPU's cache, where
    one shuffle of millions of rows waits on a cache miss a row (the thread Loader's
    full shuffles: a bucket is shuffled as its batches come up).

    Raises
    ------
    ValueError
        A negative `total`, or `bucket_rows` below 1.
    """

def shuffle_rows(rows: npt.NDArray[np.int64], bit_generator: np.random.BitGenerator,
                 /) -> None:
    """Shuffle `rows` (a writable, contiguous int64 array of one axis) in place,
    drawn from `bit_generator`, without the GIL (Fisher-Yates; the thread Loader's
    windows of a block shuffle).

    Raises
    ------
    ValueError
        Any other array.
    """
