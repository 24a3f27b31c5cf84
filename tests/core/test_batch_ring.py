"""BatchRing, the thread Loader's gathers over mapped files: threads that copy each
batch's rows into a ring of buffers without the GIL, gated on the reads each needs."""
import os
import signal
import threading

import numpy as np
import pytest

import fastst
from fastst import SafetensorError
from fastst._core import (READER_FAILED, STOPPED, TAKER_FILLS_BATCH_BYTES, WATCH_FROM_FILES,
                          BatchRing, last_level_cache)


def table(rows, start=0):
    numbers = np.arange(start, start + rows)
    return {"x": (numbers[:, None] * 3 + np.arange(3)).astype(np.float32),
            "y": numbers.astype(np.int64)}


@pytest.fixture
def two_files(tmp_path):
    """Rows 0-36 in one file, 37-99 in another."""
    paths = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    fastst.save_file(table(37), paths[0])
    fastst.save_file(table(63, 37), paths[1])
    handles = [fastst.safe_open(path) for path in paths]
    yield paths, handles
    for handle in handles:
        handle.close()


def ring_of(handles, order, batch_rows, slots=4, ahead=2, first=0, step=1, each_needs=None,
            **gate):
    """A ring over the two files; `each_needs`: every batch waits for that many reads
    (its need set at once)."""
    count = len(range(first, -(-len(order) // batch_rows), step))
    buffers = [{"x": np.empty((batch_rows, 3), np.float32),
                "y": np.empty(batch_rows, np.int64)} for _ in range(slots)]
    starts = [0, 37, 100][:len(handles) + 1]
    if each_needs is not None:
        gate["needs"] = np.full(count, each_needs, np.int64)
    ring = BatchRing(handles, starts, ("x", "y"), order, batch_rows, first, step, count,
                     buffers, ahead, **gate)
    if each_needs is not None:
        ring.advance(0, claimed=count)
    return ring, buffers, count


def run(ring, threads=2):
    workers = [threading.Thread(target=ring.work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    return workers


def end(ring, workers):
    ring.stop()
    for worker in workers:
        worker.join()
    ring.close()


@pytest.mark.parametrize("batch_rows, first, step", [(8, 0, 1), (7, 1, 3), (100, 0, 1),
                                                     (128, 0, 1)])
def test_each_batch_holds_its_rows_of_every_tensor_across_files(two_files, batch_rows,
                                                                first, step):
    _, handles = two_files
    order = np.random.default_rng(0).permutation(100).astype(np.int64)
    ring, buffers, count = ring_of(handles, order, batch_rows, first=first, step=step)
    workers = run(ring)
    want = table(100)
    for place in range(count):
        slot = ring.take(place)
        index = first + place * step
        rows = order[index * batch_rows:(index + 1) * batch_rows]
        np.testing.assert_array_equal(buffers[slot]["y"][:len(rows)], rows)
        np.testing.assert_array_equal(buffers[slot]["x"][:len(rows)], want["x"][rows])
    end(ring, workers)
    assert not any(worker.is_alive() for worker in workers)


def test_a_consumer_that_waits_fills_small_batches_itself_once_their_reads_are_done(
        two_files):
    """With no gathering thread at all, each take of a small batch fills it (and the
    batches after it that may start), where its reads are done; one waits until they
    are, and a batch over TAKER_FILLS_BATCH_BYTES is left to the threads."""
    _, handles = two_files
    order = np.random.default_rng(2).permutation(100).astype(np.int64)
    ring, buffers, count = ring_of(handles, order, 10, each_needs=1)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(ring.take(0)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken          # its read is not done: it waits
    ring.advance(1)
    taker.join(30)
    if taker.is_alive():                         # no one fills it: end the wait
        ring.stop()
        taker.join()
    assert taken == [0]
    want = table(100)
    for place in range(count):
        slot = taken[0] if place == 0 else ring.take(place)
        rows = order[place * 10:(place + 1) * 10]
        np.testing.assert_array_equal(buffers[slot]["y"], rows)
        np.testing.assert_array_equal(buffers[slot]["x"], want["x"][rows])
    ring.close()
    rows = TAKER_FILLS_BATCH_BYTES // 20 + 1       # a row of "x" and "y": 20 bytes
    order = np.arange(rows, dtype=np.int64) % 100
    buffers = [{"x": np.empty((rows, 3), np.float32), "y": np.empty(rows, np.int64)}]
    ring = BatchRing(handles, [0, 37, 100], ("x", "y"), order, rows, 0, 1, 1, buffers, 0)
    stopper = threading.Timer(0.3, ring.stop)
    stopper.start()
    assert ring.take(0) == STOPPED
    stopper.join()
    ring.close()


def test_rows_are_found_in_many_files_of_any_length_empty_ones_too(tmp_path):
    """Each row is looked up in its file through a table of chunks of rows (the file
    of each chunk's first row, then a step a file that starts within the chunk): over
    40,014 rows, chunks of 4, with files of 0 to 30,000 rows, none of their starts
    a multiple of 4, every batch holds its rows."""
    sizes = [5000, 1, 2, 3, 0, 7, 30000, 3, 0, 4993, 5]
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    handles = []
    for k, size in enumerate(sizes):
        path = tmp_path / f"part-{k:02d}.safetensors"
        fastst.save_file({"y": np.arange(starts[k], starts[k] + size, dtype=np.int64)}, path)
        handles.append(fastst.safe_open(path))
    order = np.random.default_rng(1).permutation(starts[-1]).astype(np.int64)
    buffers = [{"y": np.empty(1000, np.int64)} for _ in range(4)]
    count = -(-len(order) // 1000)
    ring = BatchRing(handles, starts, ("y",), order, 1000, 0, 1, count, buffers, 2)
    workers = run(ring)
    for place in range(count):
        slot = ring.take(place)
        rows = order[place * 1000:(place + 1) * 1000]
        np.testing.assert_array_equal(buffers[slot]["y"][:len(rows)], rows)
    end(ring, workers)
    for handle in handles:
        handle.close()


def test_the_parts_start_at_row_0_and_do_not_go_back(two_files):
    _, handles = two_files
    order = np.arange(100, dtype=np.int64)
    buffers = [{"x": np.empty((10, 3), np.float32), "y": np.empty(10, np.int64)}]
    for starts in ([1, 37, 100], [0, 101, 100]):
        with pytest.raises(ValueError, match="starts"):
            BatchRing(handles, starts, ("x", "y"), order, 10, 0, 1, 1, buffers, 0)


def test_a_batch_waits_until_the_reads_it_needs_are_done(two_files):
    _, handles = two_files
    ring, buffers, _ = ring_of(handles, np.arange(100, dtype=np.int64), 10, each_needs=2)
    workers = run(ring)
    taken = []
    taker = threading.Thread(target=lambda: taken.append(ring.take(0)))
    taker.start()
    ring.advance(1)
    taker.join(0.2)
    assert taker.is_alive() and not taken        # one read of two: not yet
    ring.advance(2)
    taker.join()
    assert taken == [0] and buffers[0]["y"].tolist() == list(range(10))
    end(ring, workers)


def test_each_batch_waits_for_its_own_needs_once_they_are_set(two_files):
    _, handles = two_files
    needs = np.array([1, 3, 2, 5, 5, 5, 5, 5, 5, 5], np.int64)
    ring, buffers, count = ring_of(handles, np.arange(100, dtype=np.int64), 10, slots=10,
                                   ahead=10, needs=needs)
    workers = run(ring)
    ring.advance(3, claimed=0)           # the reads are done, but no need is set yet
    taken = []
    taker = threading.Thread(target=lambda: taken.append(ring.take(0)))
    taker.start()
    taker.join(0.2)
    assert not taken
    ring.advance(3, claimed=3)           # batches 0-2 need at most 3
    taker.join()
    assert taken == [0] and ring.take(1) == 1 and ring.take(2) == 2
    ring.advance(5, claimed=count)
    assert [ring.take(place) for place in range(3, count)] == list(range(3, count))
    end(ring, workers)


def test_a_failed_reading_and_a_stop_end_the_waits(two_files):
    _, handles = two_files
    ring, _, _ = ring_of(handles, np.arange(100, dtype=np.int64), 10, each_needs=1)
    workers = run(ring)
    ring.reading_failed()
    assert ring.take(0) == READER_FAILED
    end(ring, workers)
    ring, _, _ = ring_of(handles, np.arange(100, dtype=np.int64), 10, each_needs=1)
    workers = run(ring)
    stopper = threading.Timer(0.05, ring.stop)
    stopper.start()
    assert ring.take(0) == STOPPED
    end(ring, workers)
    with pytest.raises(ValueError, match="closed"):
        ring.take(1)


class Interrupted(Exception):
    pass


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_a_signal_while_a_take_waits_is_raised_there(two_files):
    """As Ctrl-C is, while the consumer waits for a batch whose reads never come."""
    _, handles = two_files
    ring, _, _ = ring_of(handles, np.arange(100, dtype=np.int64), 10, each_needs=1)
    workers = run(ring)

    def interrupted(number, frame):
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupted)
    sender = threading.Timer(0.3, signal.pthread_kill,
                             (threading.main_thread().ident, signal.SIGUSR1))
    try:
        sender.start()
        with pytest.raises(Interrupted):
            ring.take(0)
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, previous)
        end(ring, workers)


@pytest.mark.parametrize("watch", [True, False])
def test_a_file_cut_short_is_an_error_at_its_batch_not_a_fault(two_files, watch):
    paths, handles = two_files
    ring, _, count = ring_of(handles, np.arange(100, dtype=np.int64), 10, each_needs=1,
                             watch=watch)
    workers = run(ring)
    os.truncate(paths[1], 64)
    ring.advance(1)
    with pytest.raises(SafetensorError, match="b.safetensors: file was truncated"):
        for place in range(count):
            ring.take(place)
    end(ring, workers)


def watched_ring(handles, order, batch_rows, **gate):
    ring, buffers, count = ring_of(handles, order, batch_rows, watch=True, **gate)
    if ring.files_watched == 0:
        ring.close()
        pytest.skip("the kernel reports no changes of these files (no inotify here)")
    return ring, buffers, count


def test_watched_files_are_checked_only_when_the_kernel_says_they_changed(two_files):
    """A file's length is checked (fstat) once when its watch is set, then only after a
    change: a write that leaves it as long (one check more) is no error, and the batch
    after a cut fails; where files are not watched, each batch checks every file it
    takes rows from."""
    paths, handles = two_files
    order = np.random.default_rng(0).permutation(100).astype(np.int64)
    ring, _, count = ring_of(handles, order, 10, watch=False)
    workers = run(ring)
    for place in range(count):
        ring.take(place)
    end(ring, workers)
    assert ring.files_checked == sum(len(set((order[k:k + 10] >= 37).tolist()))
                                     for k in range(0, 100, 10))
    ring, _, count = watched_ring(handles, order, 10, slots=2, ahead=1)
    assert ring.files_watched == 2 and ring.files_checked == 2
    workers = run(ring)
    ring.take(0)
    with open(paths[1], "r+b") as file:        # a byte rewritten: a change, no shorter
        file.seek(200)
        byte = file.read(1)
        file.seek(200)
        file.write(byte)
    for place in range(1, 5):
        ring.take(place)
    assert ring.files_checked == 3
    os.truncate(paths[0], 64)
    with pytest.raises(SafetensorError, match="a.safetensors: file was truncated"):
        for place in range(5, count):
            ring.take(place)
    end(ring, workers)


def test_files_are_watched_by_default_from_a_number_of_them(tmp_path):
    """By default a ring watches its files only where it has WATCH_FROM_FILES of them or
    more: over fewer, an fstat a batch costs less than a watch."""
    handles = []
    for k in range(WATCH_FROM_FILES):
        path = tmp_path / f"part-{k}.safetensors"
        fastst.save_file({"y": np.arange(k * 4, k * 4 + 4)}, path)
        handles.append(fastst.safe_open(path))
    rings = []
    for parts in (WATCH_FROM_FILES - 1, WATCH_FROM_FILES):
        rings.append(BatchRing(handles[:parts], list(range(0, 4 * parts + 1, 4)), ("y",),
                               np.arange(4 * parts), 4, 0, 1, parts,
                               [{"y": np.empty(4, np.int64)}], 0))
    watched = [ring.files_watched for ring in rings]
    for ring in rings:
        ring.close()
    for handle in handles:
        handle.close()
    if watched[1] == 0:
        pytest.skip("the kernel reports no changes of these files (no inotify here)")
    assert watched == [0, WATCH_FROM_FILES]


def test_a_cut_lost_in_an_overflow_of_the_kernels_news_is_still_found(two_files, tmp_path):
    """Where more changes came than the kernel keeps (its queue overflowed), every file
    is checked again: a cut whose own news was dropped is an error all the same. The
    news that fills the queue is of two other files, written in turn (the kernel
    merges news of one file repeated)."""
    paths, handles = two_files
    with open("/proc/sys/fs/inotify/max_queued_events") as limit:
        most = int(limit.read())
    if most > 200_000:
        pytest.skip(f"the kernel keeps {most} changes: too many to overflow here")
    third = tmp_path / "c.safetensors"
    fastst.save_file(table(50, 100), third)
    with fastst.safe_open(third) as extra:
        buffers = [{"x": np.empty((10, 3), np.float32), "y": np.empty(10, np.int64)}
                   for _ in range(4)]
        ring = BatchRing(handles + [extra], [0, 37, 100, 150], ("x", "y"),
                         np.arange(150, dtype=np.int64), 10, 0, 1, 15, buffers, 2,
                         needs=np.ones(15, np.int64), watch=True)
        ring.advance(0, claimed=15)
    if ring.files_watched == 0:
        ring.close()
        pytest.skip("the kernel reports no changes of these files (no inotify here)")
    workers = run(ring)
    files = [open(path, "r+b") for path in (paths[0], third)]
    try:                                 # more news than the queue holds, then the cut
        for k in range(most + 100):
            os.pwrite(files[k % 2].fileno(), b"\0", 0)
    finally:
        for file in files:
            file.close()
    os.truncate(paths[1], 64)
    ring.advance(1)
    with pytest.raises(SafetensorError, match="b.safetensors: file was truncated"):
        for place in range(15):
            ring.take(place)
    end(ring, workers)


def test_only_maps_and_fitting_buffers_are_taken(two_files):
    paths, handles = two_files
    order = np.arange(100, dtype=np.int64)
    with fastst.safe_open(paths[0], backend="pread") as read:
        with pytest.raises(ValueError, match="mapped files only"):
            ring_of([read, handles[1]], order, 10)
    with pytest.raises(ValueError, match="C-contiguous array of int64"):
        ring_of(handles, order.astype(np.int32), 10)
    short = [{"x": np.empty((5, 3), np.float32), "y": np.empty(10, np.int64)}]
    with pytest.raises(ValueError, match="slot's buffer"):
        BatchRing(handles, [0, 37, 100], ("x", "y"), order, 10, 0, 1, 10, short, 0)
    with pytest.raises(ValueError, match="rows of the part"):
        BatchRing(handles, [0, 40, 100], ("x", "y"), order, 10, 0, 1, 10, short, 0)
    slots = [{"x": np.empty((10, 3), np.float32), "y": np.empty(10, np.int64)}] * 4
    with pytest.raises(ValueError, match="past the order's rows"):     # 10 from the second
        BatchRing(handles, [0, 37, 100], ("x", "y"), order, 10, 1, 1, 10, slots, 2)
    with pytest.raises(ValueError, match="fewer than the slots"):
        ring_of(handles, order, 10, slots=4, ahead=4)
    ring, _, _ = ring_of(handles, order, 10)
    with pytest.raises(ValueError, match="set up once"):
        ring.__init__(handles, [0, 37, 100], ("y",), order, 10, 0, 1, 10,
                      [{"y": np.empty(10, np.int64)}], 0)
    ring.close()


def on_a_line(shape):
    """Float32 zeros starting on a 64-byte boundary (a large np.empty starts 16 bytes
    past one)."""
    memory = np.zeros(int(np.prod(shape)) * 4 + 64, np.uint8)
    start = -memory.ctypes.data % 64
    return memory[start:start + int(np.prod(shape)) * 4].view(np.float32).reshape(shape)


@pytest.mark.parametrize("columns", [1024, 1026])      # rows of 4096 bytes, and of 4104
def test_a_ring_larger_than_the_cache_streams_its_copies_and_they_are_exact(tmp_path,
                                                                           columns):
    """A ring of batches of 4096 rows of 4 KiB larger than twice the last level of
    cache (8 of them, 128 MiB, or more) is copied into with stores that bypass the
    cache where the CPU has them; rows that are not whole 128-byte lines are copied as
    any other. Either way each batch holds its rows. (The buffers are zeros never
    touched but for the rows copied: their pages cost nothing.)"""
    path = tmp_path / "wide.safetensors"
    fastst.save_file({"x": np.arange(1000 * columns, dtype=np.float32).reshape(1000, columns)},
                     path)
    order = np.random.default_rng(1).permutation(1000).astype(np.int64)
    slots = max(8, 2 * last_level_cache() // (4096 * columns * 4) + 1)
    buffers = [{"x": on_a_line((4096, columns))} for _ in range(slots)]
    with fastst.safe_open(path) as handle:
        ring = BatchRing([handle], [0, 1000], ("x",), order, 4096, 0, 1, 1, buffers, 4)
        small = BatchRing([handle], [0, 1000], ("x",), order, 100, 0, 1, 10,
                          [{"x": buffer["x"][:100]} for buffer in buffers], 4)
        want = handle.get_tensor("x")[order]
    assert ring.streams == fastst._core.BatchRing.can_stream() and not small.streams
    workers = run(ring)
    np.testing.assert_array_equal(buffers[ring.take(0)]["x"][:1000], want)
    end(ring, workers)
    small.close()
