"""fastst.data.Loader: batches gathered by threads into reused buffers, over one file
or many, shuffled, split between ranks, resumable."""
import gc
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import fastst
import fastst._data.loader
import fastst._data.order
import fastst._data.pipeline
import fastst._data.rowblocks
from fastst import SafetensorError, TensorNotFoundError
from fastst._core import SHUFFLE_BUCKET_ROWS
from fastst._data.order import EpochRows, epoch_order, permutation
from fastst._data.rowblocks import BlockEdges
from fastst.data import Loader

from conftest import modules_loaded_by
from helpers import run_bounded, wait_until
from pages import (cached_pages, drop_or_skip, map_flags, open_descriptors, opened_since,
                   read_bytes)
from servers import RangeServer


LINUX_ONLY = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the page cache and /proc/self/io are Linux's")
ROWS = 103            # not a multiple of any batch size or world size used


def table(rows=ROWS, start=0):
    """Features whose row r holds r, and labels r: a batch tells which rows it has."""
    numbers = np.arange(start, start + rows)
    return {"x": (numbers[:, None] * 4 + np.arange(4)).astype(np.float32),
            "y": numbers.astype(np.int64)}


@pytest.fixture
def one_file(tmp_path):
    path = tmp_path / "rows.safetensors"
    fastst.save_file(table(), path)
    return path


@pytest.fixture
def three_files(tmp_path):
    """103 rows in files of 40, 23 and 40 rows, in a folder of their own."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for k, (start, rows) in enumerate([(0, 40), (40, 23), (63, 40)]):
        fastst.save_file(table(rows, start), folder / f"train-{k:05d}.safetensors")
    return folder


@pytest.fixture
def every_block_read(monkeypatch):
    """A shuffle's reading threads read every block, as over files not in the page
    cache, though it holds the tests' files whole (an iteration then starts none)."""
    monkeypatch.setattr(fastst._data.loader._Dataset, "rows_cached", lambda self, first, stop: False)


def taken(loader):
    """The batches of one pass, each {name: copy of its array}."""
    return [{name: np.array(array) for name, array in batch.items()} for batch in loader]


def expected_batches(order, batch_size, drop_last=False):
    full = table()
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [{name: full[name][order[k:min(k + batch_size, stop)]] for name in full}
            for k in range(0, stop, batch_size)]


def assert_same_batches(got, expected):
    assert len(got) == len(expected)
    for batch, want in zip(got, expected):
        assert sorted(batch) == sorted(want)
        for name in want:
            assert batch[name].dtype == want[name].dtype
            np.testing.assert_array_equal(batch[name], want[name])


def rows_of(batches):
    return np.concatenate([batch["y"] for batch in batches]) if batches else np.array([], int)


# ---------------------------------------------------------------------------
# the rows of every batch
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("threads,prefetch", [(1, 1), (2, 4), (3, 2)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_unshuffled_batches_are_the_rows_in_order(one_file, threads, prefetch, drop_last):
    with Loader(one_file, ["x", "y"], 10, threads=threads, prefetch=prefetch,
                drop_last=drop_last) as loader:
        got = taken(loader)
        assert len(loader) == len(got) == (10 if drop_last else 11)
    assert_same_batches(got, expected_batches(np.arange(ROWS), 10, drop_last))


def test_shuffled_batches_follow_the_seeded_permutation(one_file):
    with Loader(one_file, ["x", "y"], 16, shuffle=True, seed=5) as loader:
        epochs = [taken(loader) for _ in range(3)]
    for epoch, got in enumerate(epochs):
        order = permutation(ROWS, 5, epoch)
        assert_same_batches(got, expected_batches(order, 16))
    assert not np.array_equal(rows_of(epochs[0]), rows_of(epochs[1]))
    with Loader(one_file, ["x", "y"], 16, shuffle=True, seed=5) as again:
        assert_same_batches(taken(again), epochs[0])            # reproducible


def test_block_shuffle_keeps_each_window_of_blocks_together(one_file):
    """The blocks of 10 rows come in the order of a permutation drawn from (seed,
    epoch), two a window, and each window's rows are those of its blocks, shuffled;
    the row at the edge of two blocks (the last of the first: it may straddle two
    pieces of the file) goes with the block read later, its window's blocks being
    read in the order of the file."""
    with Loader(one_file, "y", 8, shuffle="blocks", seed=3, block_rows=10,
                window_blocks=2) as loader:
        epochs = [rows_of(taken(loader)), rows_of(taken(loader))]
    assert not np.array_equal(epochs[0], epochs[1])          # a new order an epoch
    for epoch, order in enumerate(epochs):
        assert sorted(order.tolist()) == list(range(ROWS))
        blocks = np.random.default_rng([3, epoch]).permutation(11)
        window_of = {int(block): place // 2 for place, block in enumerate(blocks)}
        read_at = {block: (window_of[block], block) for block in window_of}
        windows = [set() for _ in range(6)]
        for row in range(ROWS):
            block = row // 10
            if row % 10 == 9 and block + 1 < 11 and read_at[block + 1] > read_at[block]:
                block += 1                         # an edge row, to the block read later
            windows[window_of[block]].add(row)
        start = 0
        for rows in windows:
            assert set(order[start:start + len(rows)].tolist()) == rows
            start += len(rows)
        moved = [row for row in range(9, 99, 10) if row in windows[window_of[row // 10 + 1]]
                 and window_of[row // 10 + 1] != window_of[row // 10]]
        assert moved and len(moved) < 10          # edge rows both stay and move here


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 300), shuffle=st.sampled_from([False, True, "blocks"]),
       block_rows=st.integers(1, 40), window_blocks=st.integers(1, 5),
       world=st.integers(1, 9), data=st.data())
def test_a_ranks_rows_are_its_share_of_the_epochs_order_however_they_are_asked_for(
        total, shuffle, block_rows, window_blocks, world, data):
    """Rank r's rows are positions r, r + world, ... of the epoch's order, repeated
    from its start (or cut) to a multiple of `world`, whichever steps a block shuffle's
    windows are made ready in: each step's rows are final once it returns."""
    rank = data.draw(st.integers(0, world - 1))
    every = data.draw(st.sampled_from([total // world, -(-total // world)])) * world
    whole = epoch_order(total, shuffle, 7, 2, block_rows, window_blocks)
    expected = np.resize(whole, every)[rank::world] if every else whole[:0]
    order = EpochRows(total, shuffle, 7, 2, block_rows, window_blocks, every, rank, world)
    stop = 0
    while stop < len(expected):
        stop += data.draw(st.integers(1, 50))
        order.ready(stop)
        assert np.array_equal(order.rows[:stop], expected[:stop])
    assert np.array_equal(order.rows, expected)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_block_shuffle_over_more_than_the_memory_asks_the_kernel_for_each_block_once(
        tmp_path, monkeypatch, backend):
    """Over a dataset larger than half the memory, a block's rows are asked for in large
    requests: the threads that gather ask the kernel (posix_fadvise WILLNEED) for the
    blocks the batches fall in, each block of each tensor once an epoch, and the
    consumer's thread asks for none; a full shuffle asks for nothing."""
    monkeypatch.setattr(fastst._data.loader._Dataset, "fits_page_cache", lambda dataset: False)
    path = str(tmp_path / "rows.safetensors")
    fastst.save_file({"x": np.arange(1000 * 16, dtype=np.float32).reshape(1000, 16),
                      "y": np.arange(1000)}, path)
    with fastst.safe_open(path) as f:
        begins = {name: f.data_start + f.info(name).data_offsets[0] for name in ("x", "y")}
    asked, askers = [], set()
    advise = os.posix_fadvise

    def noted(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
            askers.add(threading.current_thread())
        return advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", noted)
    with Loader(path, ["x", "y"], 64, shuffle="blocks", block_rows=100, window_blocks=3,
                seed=0, backend=backend) as loader:
        for epoch in range(2):
            rows = np.concatenate([batch["y"].copy() for batch in loader])
            assert sorted(rows.tolist()) == list(range(1000))
            assert len(asked) == 20
            for name, row_bytes in (("x", 64), ("y", 8)):    # 10 blocks of 99-101 rows
                mine = sorted((offset, length) for offset, length in asked
                              if begins[name] <= offset < begins[name] + 1000 * row_bytes)
                assert all(99 <= length // row_bytes <= 101 for _, length in mine)
                ends = [begins[name]] + [offset + length for offset, length in mine]
                assert [offset for offset, _ in mine] == ends[:-1]    # each byte once
                assert ends[-1] == begins[name] + 1000 * row_bytes and len(mine) == 10
            assert askers and threading.main_thread() not in askers
            asked.clear()
    with Loader(path, ["x", "y"], 64, shuffle=True, backend=backend) as loader:
        assert sum(len(batch["y"]) for batch in loader) == 1000 and not asked


def data_offset(path, name):
    """Where tensor `name`'s bytes start in the file `path`."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        return 8 + length + json.loads(file.read(length))[name]["data_offsets"][0]


@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("shuffle, unit", [("blocks", 120), (True, 360)])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_shuffle_reads_each_block_into_the_page_cache_before_its_batches(
        tmp_path, monkeypatch, backend, shuffle, unit):
    """A shuffle over local files reads each block of each tensor (a full shuffle: a
    window's rows at a time) into the page cache once an epoch, on a thread of its own
    (not the consumer's, not a gathering one), and no batch is gathered before every
    block it takes rows from is in; an unshuffled iteration reads no block. The files
    hold -1 in every row until the reading of its block writes the row's true values
    in: a batch gathered before its blocks were read holds a -1."""
    files = [tmp_path / f"part-{k}.safetensors" for k in range(2)]
    for k, path in enumerate(files):     # 1000 rows in two files: a block across the two
        fastst.save_file({name: np.full_like(array, -1) for name, array in
                          table(500, 500 * k).items()}, path)
    cached, readers = [], set()
    cache_rows = fastst.NumpyHandle.cache_rows

    def noted_cache(handle, name, first, stop):
        k = [str(path) for path in files].index(handle.source)
        cached.append((name, 500 * k + max(first, 0), 500 * k + min(stop, 500)))
        readers.add(threading.current_thread().name)
        rows = table(500, 500 * k)[name][max(first, 0):min(stop, 500)]
        with open(files[k], "r+b") as file:      # the block's rows, as they are read
            file.seek(data_offset(files[k], name) + max(first, 0) * rows[0].nbytes)
            file.write(rows.tobytes())
        return cache_rows(handle, name, first, stop)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", noted_cache)
    pieces = sorted((name, first, stop) for name in ("x", "y") for block in range(9)
                    for first, stop in ((unit * block, min(unit * block + unit, 500)),
                                        (max(unit * block, 500), min(unit * block + unit, 1000)))
                    if first < stop)        # blocks of `unit` rows, one across 500 in two
    with Loader(files, ["x", "y"], 64, shuffle=shuffle, block_rows=120, window_blocks=3,
                seed=0, backend=backend) as loader:
        for epoch in range(2):
            batches = taken(loader)
            rows = rows_of(batches)
            assert sorted(rows.tolist()) == list(range(1000))      # none of them -1
            assert all((batch["x"] == table(1000)["x"][batch["y"]]).all() for batch in batches)
            if shuffle is True:
                assert sorted(cached) == pieces            # each once
            else:     # a block's edge row may go with the next block: each row once
                for name in ("x", "y"):
                    spans = sorted((first, stop) for which, first, stop in cached
                                   if which == name)
                    assert [first for first, _ in spans] == [0] + [stop for _, stop in
                                                                  spans[:-1]]
                    assert spans[-1][1] == 1000 and len(spans) == len(pieces) // 2
            assert readers == {"fastst-loader-blocks"}
            cached.clear()
    with Loader(files, ["x", "y"], 64, block_rows=120, backend=backend) as loader:
        assert sum(len(batch["y"]) for batch in loader) == 1000 and not cached
    assert not loader_threads()


@pytest.mark.usefixtures("every_block_read")
def test_a_full_shuffle_reads_its_files_while_its_order_is_made(one_file, monkeypatch):
    """The reading of a full shuffle's files (whole, in file order) needs no order: it
    is under way while the epoch's permutation is made, which waits here for the first
    read (and would wait out its 10 s if it came only after)."""
    first_read = threading.Event()
    cache_rows = fastst.NumpyHandle.cache_rows
    make_order = fastst._data.order.EpochRows.__init__

    def noted_cache(handle, name, first, stop):
        first_read.set()
        return cache_rows(handle, name, first, stop)

    def order_after_a_read(order, *args):
        assert first_read.wait(10)
        make_order(order, *args)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", noted_cache)
    monkeypatch.setattr(fastst._data.order.EpochRows, "__init__", order_after_a_read)
    with Loader(one_file, ["x", "y"], 16, shuffle=True, seed=5) as loader:
        rows = rows_of(taken(loader))
    assert np.array_equal(rows, permutation(ROWS, 5, 0))


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_full_shuffles_first_batch_waits_for_the_first_bucket_only(tmp_path, monkeypatch,
                                                                     backend):
    """A full shuffle's order is dealt to buckets, and each bucket shuffled when its
    batches are asked for: the first batch comes while the later buckets wait (here,
    for it), and the batches are those of the whole permutation."""
    total = 4 * SHUFFLE_BUCKET_ROWS - 5
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"y": np.arange(total)}, path)
    first_taken, laid_out = threading.Event(), []
    next_piece = fastst._data.order.EpochRows._next_piece

    def piece_after_the_first_batch(order):
        if laid_out:
            assert first_taken.wait(10)
        laid_out.append(order.laid_out)
        next_piece(order)

    monkeypatch.setattr(fastst._data.order.EpochRows, "_next_piece", piece_after_the_first_batch)
    with Loader(path, "y", 16, shuffle=True, seed=3, backend=backend) as loader:
        batches = iter(loader)
        got = [next(batches)["y"].copy()]
        pieces_before = len(laid_out)
        first_taken.set()
        got += [batch["y"].copy() for batch in batches]
    assert pieces_before == 1 and laid_out == [0, 1, 2, 3]
    assert np.array_equal(np.concatenate(got), permutation(total, 3, 0))


@pytest.mark.usefixtures("every_block_read")
def test_a_block_shuffle_draws_its_windows_as_its_blocks_are_read(one_file, monkeypatch):
    """A block shuffle's windows are drawn as its batches are claimed, a few ahead of
    the reading of their blocks, not all before its first read: of 52 windows of one
    block of two rows, those of the blocks asked ahead of the reading (`queued`) and of
    a few claims at most are drawn before the first read. The rows are those of the
    whole order drawn at once."""
    from fastst._data.rowblocks import CachedBlocks

    events, whole = [], epoch_order(ROWS, "blocks", 5, 0, 2, 1)
    cache_rows = fastst.NumpyHandle.cache_rows
    next_piece = fastst._data.order.EpochRows._next_piece

    def noted_cache(handle, name, first, stop):
        events.append("read")
        return cache_rows(handle, name, first, stop)

    def noted_window(order):
        events.append("window")
        next_piece(order)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", noted_cache)
    monkeypatch.setattr(fastst._data.order.EpochRows, "_next_piece", noted_window)
    with Loader(one_file, ["x", "y"], 4, shuffle="blocks", seed=5, block_rows=2,
                window_blocks=1) as loader:
        rows = rows_of(taken(loader))
    assert np.array_equal(rows, whole)
    assert events.count("window") == 52
    before_a_read = events[:events.index("read")]
    assert before_a_read[0] == "window"
    assert before_a_read.count("window") <= CachedBlocks.queued + 8 < 52


@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("window_blocks", [1, 3, 4])
def test_a_blocks_reading_seldom_brings_a_piece_of_a_block_read_later(tmp_path, monkeypatch,
                                                                      window_blocks):
    """Blocks of 4,096 rows of 512 B are 2 MiB, but the rows start 88 bytes into the
    file: each block's last row reaches into the next 2 MiB piece, whose other rows
    are the next block's, and a piece is read whole. The edge row goes with whichever
    of its blocks is read later, so that a read brings pieces of its own block only (a
    piece of a block read later is read before its turn, this block waiting for it):
    always with windows of one block; with larger ones, but for a block whose window
    begins inside the last batch of the window before (a claim takes it early), in
    ten epochs of 16 blocks at most 10 times, where half the reads did before."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.zeros((4096 * 16, 128), np.float32)}, path)
    offset = data_offset(path, "x")
    assert 0 < offset < 512
    reads = []
    cache_rows = fastst.NumpyHandle.cache_rows

    def noted_cache(handle, name, first, stop):
        reads.append((first, stop))
        return cache_rows(handle, name, first, stop)

    def owner(piece):          # the block of the row in the middle of the piece (the
        return min(((piece << 21) + (1 << 20) - offset) // 512 // 4096, 15)  # last's tail)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", noted_cache)
    # one reading thread: the reads are noted in the order the blocks are asked for
    monkeypatch.setattr(fastst._data.rowblocks.CachedBlocks, "readers", 1)
    early = 0
    for seed in range(10):
        reads.clear()
        with Loader(path, "x", 256, shuffle="blocks", seed=seed,
                    window_blocks=window_blocks) as loader:
            assert sum(len(batch["x"]) for batch in loader) == 4096 * 16
        assert len(reads) == 16
        seen = set()
        for first, stop in reads:
            pieces = set(range((offset + first * 512) >> 21,
                               ((offset + stop * 512 - 1) >> 21) + 1))
            early += len({owner(piece) for piece in pieces - seen} - {(first + stop) // 8192})
            seen |= pieces
    assert early <= (0 if window_blocks == 1 else 10)


@LINUX_ONLY
@pytest.mark.parametrize("shuffle", ["blocks", True])
def test_a_shuffle_over_a_cold_file_reads_it_once_and_leaves_it_cached(tmp_path, shuffle):
    """An epoch of a shuffle over a file not in the page cache reads the file once
    (blocks read in whole 2 MiB pieces bring parts of their neighbours, which are not
    read again when their turn comes; the header's pages, read at open, are read
    again with the first piece, whole; 64 KiB either way: the header's, and what the
    file system reads of its own), and leaves it all in the page cache: the next epoch
    reads nothing."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.arange(16384 * 256, dtype=np.float32).reshape(16384, 256)},
                     path)                                    # 16 MiB of 1 KiB rows
    drop_or_skip(path)
    size = os.path.getsize(path)
    with Loader(path, "x", 256, shuffle=shuffle, block_rows=1500, window_blocks=2,
                seed=0) as loader:
        before = read_bytes()
        assert sum(len(batch["x"]) for batch in loader) == 16384
        assert size - (64 << 10) <= read_bytes() - before <= size + (64 << 10)
        assert cached_pages(path) * 4096 >= size
        before = read_bytes()
        assert sum(len(batch["x"]) for batch in loader) == 16384
        assert read_bytes() == before


@LINUX_ONLY
@pytest.mark.parametrize("shuffle", [False, True, "blocks"])
def test_a_shuffle_read_by_cache_rows_maps_its_files_without_read_ahead(tmp_path, shuffle):
    """Where a shuffle's rows are read into the page cache by cache_rows, the maps the
    batches are gathered from read nothing ahead (advised MADV_RANDOM: "rr"), but
    where the page cache holds the files whole (the next epoch: nothing is read);
    unshuffled, the kernel's read ahead is what reads ahead of the batches."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.arange(8192 * 256, dtype=np.float32).reshape(8192, 256)},
                     path)                                     # 8 MiB of 1 KiB rows
    drop_or_skip(path)
    with Loader(path, "x", 256, shuffle=shuffle, seed=0, block_rows=1024,
                window_blocks=2) as loader:
        for epoch in range(2):
            batches = iter(loader)
            rows = [batch["x"][:, 0] // 256 for batch in itertools.islice(batches, 1)]
            assert ("rr" in map_flags(path)) == (bool(shuffle) and epoch == 0)
            rows += [batch["x"][:, 0] // 256 for batch in batches]
            assert sorted(np.concatenate(rows).tolist()) == list(range(8192))


@LINUX_ONLY
def test_the_gathers_of_a_block_shuffle_read_no_piece_before_it_is_asked(tmp_path,
                                                                          monkeypatch):
    """A cold block shuffle's blocks are read in the order its batches need them: the
    gathers' first touches of the pieces just read start no read ahead of the pieces
    after them in the file (which would be read before the blocks asked next, and
    keep those waiting). The reads after the first window's wait here until its first
    batch is taken: no piece is in the page cache before a read asks for it."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.arange(16384 * 256, dtype=np.float32).reshape(16384, 256)},
                     path)                                    # 16 MiB of 1 KiB rows
    drop_or_skip(path)
    offset = data_offset(path, "x")
    _, blocks, _ = fastst._data.order.epoch_blocks(16384, 0, 0, 2048, 2)
    cache_rows, asked, early = fastst.NumpyHandle.cache_rows, set(), []
    first_taken, lock = threading.Event(), threading.Lock()

    def pieces(first, stop):
        return set(range((offset + first * 1024) >> 21, ((offset + stop * 1024 - 1) >> 21) + 1))

    def noted_cache(handle, name, first, stop):
        if round(first / 2048) not in blocks[:2]:      # a block of a later window
            assert first_taken.wait(30)
        with lock:
            unasked = set(range(9)) - asked - {0}      # the header's piece is read at open
            early.extend(piece for piece in unasked
                         if cached_pages(path, piece << 21, (piece + 1) << 21))
            asked.update(pieces(first, stop))
        return cache_rows(handle, name, first, stop)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", noted_cache)
    with Loader(path, "x", 256, shuffle="blocks", block_rows=2048, window_blocks=2,
                seed=0) as loader:
        count = 0
        for batch in loader:
            first_taken.set()
            count += len(batch["x"])
    assert count == 16384 and early == []


@pytest.mark.usefixtures("every_block_read")
def test_a_file_cut_short_under_a_block_shuffle_is_an_error_not_a_fault(tmp_path):
    path = tmp_path / "rows.safetensors"
    fastst.save_file(table(1000), path)
    with Loader(path, ["x", "y"], 50, shuffle="blocks", block_rows=100, window_blocks=2,
                seed=0) as loader:
        os.truncate(path, 4096)
        with pytest.raises(SafetensorError, match="truncated"):
            taken(loader)
    assert not loader_threads()


@pytest.mark.parametrize("shuffle", [False, True, "blocks"])
def test_empty_files_among_the_files_add_no_rows(tmp_path, shuffle):
    """A file of no rows (an empty shard), first, between others or last, is part of
    the dataset and adds nothing to it."""
    files = []
    for k, (start, rows) in enumerate([(0, 0), (0, 40), (40, 0), (40, 63), (103, 0)]):
        files.append(tmp_path / f"part-{k}.safetensors")
        fastst.save_file(table(rows, start), files[-1])
    with Loader(files, ["x", "y"], 16, shuffle=shuffle, seed=4, block_rows=10,
                window_blocks=2) as loader:
        batches = taken(loader)
    assert sorted(rows_of(batches).tolist()) == list(range(ROWS))
    assert all((batch["x"] == table(ROWS)["x"][batch["y"]]).all() for batch in batches)
    if not shuffle:
        assert rows_of(batches).tolist() == list(range(ROWS))


def test_an_epoch_over_unchanged_files_checks_each_once_not_each_batch(tmp_path):
    """Over many files, a file's length is checked when the epoch's gathers start and
    then only if the kernel says it changed (where it can: a local file system), not by
    every batch that takes rows from it: fstat of every file of a batch costs more
    than its copies where rows lie in many files."""
    files = []
    for k in range(10):                   # 103 rows in files of 10 (the last of 13)
        files.append(tmp_path / f"part-{k}.safetensors")
        fastst.save_file(table(13 if k == 9 else 10, 10 * k), files[-1])
    with fastst.safe_open(files[0]) as handle:    # a ring of one batch: is it watched?
        ring = fastst._core.BatchRing([handle], [0, 10], ("y",), np.arange(10), 10, 0, 1, 1,
                                      [{"y": np.empty(10, np.int64)}], 0, watch=True)
        watched = ring.files_watched
        ring.close()
    if not watched:
        pytest.skip("the kernel reports no changes of these files (no inotify here)")
    with Loader(files, ["x", "y"], 4, shuffle=True, seed=1) as loader:
        for epoch in range(2):
            before = fastst._core.read_counters()["files_checked"]
            assert sorted(rows_of(taken(loader)).tolist()) == list(range(ROWS))
            # 26 batches, most of them over four files
            assert fastst._core.read_counters()["files_checked"] - before == 10


BATCHES_OF_BLOCKS = [np.array(rows) for rows in        # 12 rows, blocks of 2
                     ([5, 1], [1, 0], [7, 9], [8, 6], [3, 2], [2, 4], [11, 10], [10, 11])]


def batches_of_blocks(first, stop):
    """The rows of BATCHES_OF_BLOCKS [first, stop), and where each batch begins."""
    return np.concatenate(BATCHES_OF_BLOCKS[first:stop]), np.arange(0, 2 * (stop - first), 2)


def test_a_block_shuffle_asks_for_the_blocks_a_window_of_batches_at_a_time():
    """A thread that starts gathering a batch asks for the windows of batches up to a
    window after it, each window's blocks not asked for yet in file order, after the
    blocks of the windows before (the first batch waits for its window's blocks, not
    for the next window's). Each batch waits for the blocks asked for up to its last
    one."""
    from fastst._data.pipeline import BlocksAhead

    class Reader:
        asked, waits = [], []
        want = asked.extend
        wait = waits.append

    hints = BlocksAhead(batches_of_blocks, len(BATCHES_OF_BLOCKS),
                        BlockEdges(2, 12), window=3, reader=Reader())
    assert hints.claim(0) == [0, 2, 3, 4, 1]        # batches 0-2, then 3-5
    assert hints.claim(1) == [] and hints.claim(0) == [] and hints.claim(2) == []
    assert hints.claim(4) == [5]                    # batches 6-7
    assert hints.claim(6) == [] and not hints.claim_next()
    assert Reader.asked == [0, 2, 3, 4, 1, 5]
    for position in range(len(BATCHES_OF_BLOCKS)):
        hints.wait(position)
    assert Reader.waits == [2, 1, 4, 4, 5, 5, 6, 6]    # 1 + its blocks' latest place


def test_the_reader_of_blocks_asks_for_the_next_windows_itself():
    """As it reads the blocks asked for, the page cache's reader claims the next
    windows itself: a dataset the page cache holds whole is read at the disk's pace,
    whatever the pace of the batches."""
    from fastst._data.pipeline import BlocksAhead
    from fastst._data.rowblocks import CachedBlocks

    read = []
    reader = CachedBlocks(lambda first, stop: read.append(first), BlockEdges(2, 12))
    try:
        hints = BlocksAhead(batches_of_blocks, len(BATCHES_OF_BLOCKS),
                            BlockEdges(2, 12), window=1, reader=reader)
        reader.ask_more(hints.claim_next)
        assert wait_until(lambda: reader.done == 6)     # no batch claimed any
        assert sorted(read) == [0, 2, 4, 6, 8, 10]
        assert hints.asked_to == len(BATCHES_OF_BLOCKS)
        assert hints.places.tolist() == [0, 4, 1, 2, 3, 5]     # window by window
        asking = next(thread for thread in reader.threads
                      if thread.name == "fastst-loader-claims")
        assert wait_until(lambda: not asking.is_alive())   # nothing left to claim
    finally:
        reader.stop()


@pytest.mark.parametrize("held", [False, True])
def test_the_reader_of_blocks_keeps_reads_in_flight_only_where_they_wait(held):
    """Blocks the page cache does not hold are read several at once (each thread
    wakes another before its read waits for the disk); blocks it holds, which a read
    finds so at once, are passed over by one thread, not by each thread in turn."""
    from fastst._data.rowblocks import CachedBlocks

    lock, reading, most, readers = threading.Lock(), [0], [0], set()

    def read(first, stop):
        with lock:
            reading[0] += 1
            most[0] = max(most[0], reading[0])
            readers.add(threading.current_thread())
        time.sleep(0 if held else 0.05)
        with lock:
            reading[0] -= 1

    reader = CachedBlocks(read, BlockEdges(2, 64), threads=4,
                          held=lambda first, stop: held)
    try:     # every thread started and waiting (threading.Condition's own list)
        assert wait_until(lambda: len(reader.to_read._waiters) == 4)
        reader.want(range(32))
        assert wait_until(lambda: reader.done == 32)
    finally:
        reader.stop()
    assert (most[0], len(readers)) == ((1, 1) if held else (4, 4))


def test_a_reader_of_blocks_with_no_thread_counts_them_read_as_asked():
    """With no reading thread (the page cache holds the dataset whole), the blocks
    asked for count as read at once, and a waiter is told so."""
    from fastst._data.rowblocks import CachedBlocks

    read, told = [], []
    reader = CachedBlocks(lambda first, stop: read.append(first), BlockEdges(2, 12),
                          threads=0)
    try:
        reader.follow(told.append, lambda: None)
        reader.want([3, 1])
        reader.wait(2)
        reader.want(range(4))
        assert (reader.done, told, read) == (6, [0, 2, 6], [])
    finally:
        reader.stop()


def test_an_epoch_over_files_the_page_cache_holds_starts_no_reading(tmp_path, monkeypatch):
    """Where the page cache holds the dataset whole (the epochs after the first), a
    shuffle reads nothing: no thread passes over its blocks, one by one, to find
    each held."""
    read = []
    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows",
                        lambda handle, name, first, stop: read.append(first))
    path = tmp_path / "rows.safetensors"
    fastst.save_file(table(), path)
    for shuffle in ("blocks", True):
        with Loader(path, ["x", "y"], 16, shuffle=shuffle, seed=0, block_rows=10,
                    window_blocks=2) as loader:
            rows, reading = [], set()
            for batch in loader:
                rows += batch["y"].tolist()
                reading |= {thread.name for thread in threading.enumerate()}
        assert sorted(rows) == list(range(ROWS))
        assert "fastst-loader-blocks" not in reading and read == []


@pytest.mark.parametrize("held", [True, False], ids=["held whole", "read"])
def test_a_block_shuffle_asks_for_its_claims_last_only_where_nothing_is_read(
        one_file, monkeypatch, held):
    """Where the page cache holds the dataset, the asking thread claims window after
    window at once: it starts once the ring follows the claims, not before, when the
    ring's ``follow`` waited for the claims' lock (the first batch tens of
    milliseconds late over millions of rows). Where blocks are read, it starts at
    once, so that the first reads begin while the ring is made."""
    monkeypatch.setattr(fastst._data.loader._Dataset, "rows_cached", lambda self, first, stop: held)
    followed_when_asked = []
    ask_more = fastst._data.rowblocks.CachedBlocks.ask_more

    def noted_ask_more(reader, more):
        followed_when_asked.append(more.__self__.on_claim is not None)
        ask_more(reader, more)

    monkeypatch.setattr(fastst._data.rowblocks.CachedBlocks, "ask_more", noted_ask_more)
    with Loader(one_file, "y", 8, shuffle="blocks", seed=0, block_rows=10,
                window_blocks=2) as loader:
        assert sorted(rows_of(taken(loader))) == list(range(ROWS))
    assert followed_when_asked == [held]


def test_the_reader_of_blocks_asks_for_more_before_it_runs_out():
    """The next window is asked for on a thread of its own once fewer than `queued`
    blocks are left to read, not once none is: the reading does not
    wait for the asking (a claim of a window, its shuffle included, takes
    milliseconds)."""
    from fastst._data.rowblocks import CachedBlocks

    def slow_read(first, stop):
        time.sleep(0.02)

    reader = CachedBlocks(slow_read, BlockEdges(2, 40), threads=1)
    left_when_asked = []

    def more():
        left_when_asked.append(len(reader.asked))
        reader.want(range(8, 12))
        return False

    try:
        reader.want(range(8))
        reader.ask_more(more)
        assert wait_until(lambda: reader.done == 12)
    finally:
        reader.stop()
    assert left_when_asked and 0 < left_when_asked[0] < CachedBlocks.queued
    assert not any(thread.is_alive() for thread in reader.threads)


def test_the_window_ahead_is_a_windows_share_of_this_iterations_batches(one_file):
    with Loader(one_file, "y", 4, shuffle="blocks", block_rows=10, window_blocks=3,
                world_size=2, rank=1, seed=0) as loader:
        assert loader._window_batches(1) == 4       # 30 rows: 15 a rank, 4 batches of 4
        assert loader._window_batches(2) == 2       # of which a worker of two takes every other


@pytest.mark.parametrize("layout,backend", [("list", "mmap"), ("glob", "mmap"),
                                            ("directory", "mmap"), ("list", "pread")])
def test_several_files_are_one_dataset(three_files, layout, backend):
    files = sorted(str(path) for path in three_files.iterdir())
    source = {"list": files, "glob": str(three_files / "train-*.safetensors"),
              "directory": three_files}[layout]
    with Loader(source, ["x", "y"], 16, shuffle=True, seed=1, threads=2,
                backend=backend) as loader:
        assert loader.rows == ROWS
        got = taken(loader)
    assert_same_batches(got, expected_batches(permutation(ROWS, 1, 0),
                                              16))
    with Loader(source, ["x", "y"], 16) as loader:      # batches across file boundaries
        assert_same_batches(taken(loader), expected_batches(np.arange(ROWS), 16))


def test_a_sharded_checkpoint_is_one_part(tmp_path):
    folder = tmp_path / "checkpoint"
    fastst.save_file(table(), folder, max_shard_size=2000)     # x and y in shards of their own
    assert (folder / "model.safetensors.index.json").exists()
    for source in (folder, folder / "model.safetensors.index.json"):
        with Loader(source, ["x", "y"], 32, shuffle=True, seed=2) as loader:
            got = taken(loader)
        assert_same_batches(got, expected_batches(
            permutation(ROWS, 2, 0), 32))


# ---------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_split_each_epoch_like_distributed_sampler(three_files, world_size, drop_last):
    epochs = []
    for epoch in range(2):
        parts = []
        for rank in range(world_size):
            with Loader(three_files, ["x", "y"], 8, shuffle=True, seed=9, rank=rank,
                        world_size=world_size, drop_last=drop_last) as loader:
                loader.set_epoch(epoch)
                parts.append(taken(loader))
        assert len({len(part) for part in parts}) == 1          # as many batches each
        order = permutation(ROWS, 9, epoch)
        per = ROWS // world_size if drop_last else -(-ROWS // world_size)
        padded = np.resize(order, per * world_size)
        for rank, part in enumerate(parts):
            assert_same_batches(part, expected_batches(padded[rank::world_size], 8, drop_last))
        seen = np.concatenate([rows_of(part) for part in parts])
        if not drop_last:
            assert set(seen.tolist()) == set(range(ROWS))       # every row at least once
            assert len(seen) == per * world_size                 # padded by < world_size
        assert len(seen) - len(set(seen.tolist())) == (len(seen) - ROWS if len(seen) > ROWS
                                                       else 0)
        epochs.append(seen)
    assert not np.array_equal(epochs[0], epochs[1])


def test_ranks_that_divide_the_rows_see_each_row_exactly_once(tmp_path):
    path = tmp_path / "96.safetensors"
    fastst.save_file({"y": np.arange(96)}, path)
    seen = []
    for rank in range(4):
        with Loader(path, "y", 5, shuffle=True, seed=0, rank=rank, world_size=4) as loader:
            seen += rows_of(taken(loader)).tolist()
    assert sorted(seen) == list(range(96))


def test_several_ranks_need_a_seed(one_file):
    with pytest.raises(ValueError, match="one seed"):
        Loader(one_file, "y", 4, shuffle=True, rank=0, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        Loader(one_file, "y", 4, rank=1)
    with pytest.raises(ValueError, match="rank must be"):
        Loader(one_file, "y", 4, rank=2, world_size=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 40), batch_size=st.integers(1, 9), world_size=st.integers(1, 5),
       drop_last=st.booleans(), shuffle=st.sampled_from([False, True, "blocks"]))
def test_any_split_gives_each_rank_as_many_batches_and_covers_the_rows(
        tmp_path_factory, rows, batch_size, world_size, drop_last, shuffle):
    path = tmp_path_factory.mktemp("h") / "rows.safetensors"
    fastst.save_file({"y": np.arange(rows)}, path)
    counts, seen = set(), []
    for rank in range(world_size):
        with Loader(path, "y", batch_size, shuffle=shuffle, seed=4, drop_last=drop_last,
                    rank=rank, world_size=world_size, threads=2, prefetch=2,
                    block_rows=3, window_blocks=2) as loader:
            batches = taken(loader)
        assert len(batches) == len(loader)
        assert all(len(batch["y"]) == batch_size for batch in batches[:-1])
        if drop_last and batches:
            assert len(batches[-1]["y"]) == batch_size
        counts.add(len(batches))
        seen += rows_of(batches).tolist()
    assert len(counts) == 1
    share = rows // world_size if drop_last else -(-rows // world_size)
    if not drop_last:
        assert set(seen) == set(range(rows)) and len(seen) == share * world_size
    else:
        assert len(seen) == len(set(seen)) == (share // batch_size) * batch_size * world_size


# ---------------------------------------------------------------------------
# resuming
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("stop_after", [0, 1, 6, 7, 9])
def test_a_loaded_state_continues_with_the_very_next_batch(three_files, stop_after):
    made = dict(source=three_files, names=["x", "y"], batch_size=15, shuffle=True, seed=11)
    with Loader(**made) as whole:
        uninterrupted = taken(whole) + taken(whole)      # two epochs of 7 batches
    with Loader(**made) as first:
        before, state = [], first.state_dict()
        for batch in first:
            if len(before) == stop_after:
                break
            before.append({name: np.array(array) for name, array in batch.items()})
            state = first.state_dict()
    assert len(str(state)) < 2000           # small: no rows in it
    with Loader(**made) as restarted:
        restarted.load_state_dict(state)
        after = taken(restarted)
        after += taken(restarted) if len(before) + len(after) < 14 else []
    assert_same_batches(before + after[:14 - len(before)], uninterrupted)


def test_set_epoch_keeps_a_resumed_position_in_that_epoch(one_file):
    with Loader(one_file, "y", 10, shuffle=True, seed=3) as loader:
        loader.set_epoch(2)
        whole = rows_of(taken(loader))
        loader.set_epoch(2)
        iterator = iter(loader)
        next(iterator)
        state = loader.state_dict()
        iterator.close()
    with Loader(one_file, "y", 10, shuffle=True, seed=3) as again:
        again.load_state_dict(state)
        again.set_epoch(2)                   # a loop that calls it each epoch
        assert rows_of(taken(again)).tolist() == whole[10:].tolist()
        assert again.epoch == 3


def stopped_after(made, batches):
    """The state of a Loader made with `made` after `batches` batches, and the batches
    that an uninterrupted run takes after them, to the end of the next epoch."""
    with Loader(**made) as loader:
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        state = loader.state_dict()
        iterator.close()
        return state, taken(loader) + taken(loader)


def fresh_copy(path):
    """`path` removed and copied back: the same bytes, another inode."""
    inode, kept = os.stat(path).st_ino, path.with_name(path.name + ".kept")
    shutil.copyfile(path, kept)
    os.replace(kept, path)
    assert os.stat(path).st_ino != inode


@pytest.mark.parametrize("layout", ["files", "checkpoint"])
@pytest.mark.parametrize("staged", ["elsewhere", "copied back"])
def test_a_state_continues_over_its_files_copied_to_another_path_or_back(tmp_path, three_files,
                                                                          layout, staged):
    """Each restart of a cluster job stages its data to local scratch again: the same
    files, another path or inode. A state names its files by what their headers say."""
    if layout == "checkpoint":
        source = tmp_path / "checkpoint"
        fastst.save_file(table(), source, max_shard_size=1000)
        assert len(list(source.glob("*.safetensors"))) == 2     # x's and y's
    else:
        source = three_files
    made = dict(names=["x", "y"], batch_size=15, shuffle=True, seed=11)
    state, rest = stopped_after(dict(source=source, **made), 3)
    if staged == "elsewhere":
        source = shutil.copytree(source, tmp_path / "scratch" / "staged")
    else:
        for path in source.iterdir():
            fresh_copy(path)
    with Loader(source, **made) as restarted:
        restarted.load_state_dict(state)
        assert_same_batches(taken(restarted) + taken(restarted), rest)


@pytest.mark.parametrize("changed,difference", [
    (table(24, 40), r"train-00001.safetensors has 24 rows, where file 2 of the state's, "
                    r".*train-00001.safetensors, had 23"),
    ({"features": table(23, 40)["x"], "y": table(23, 40)["y"]},
     r"train-00001.safetensors has another header than file 2 of the state's")],
    ids=["one more row", "a tensor renamed"])
def test_a_state_is_refused_over_a_file_whose_header_differs_naming_it(three_files, changed,
                                                                       difference):
    """A tensor renamed is one not read (the loader reads "y")."""
    state, _ = stopped_after(dict(source=three_files, names="y", batch_size=10), 1)
    fastst.save_file(changed, three_files / "train-00001.safetensors")
    with Loader(three_files, "y", 10) as again:
        with pytest.raises(SafetensorError, match=f"^the state is of another dataset: .*"
                                                  f"{difference}.*start a new run$"):
            again.load_state_dict(state)
        assert again.state_dict()["batch"] == 0


@pytest.mark.parametrize("checksum", [None, "xxh3_64"])
def test_a_state_sees_rows_changed_under_the_same_header_only_by_their_checksums(
        tmp_path, checksum):
    """What the documentation says a state does not see, and how a file saved with
    checksums (they are in its header) is told apart."""
    if checksum is not None:
        pytest.importorskip("xxhash")
    path = tmp_path / "rows.safetensors"
    fastst.save_file(table(), path, checksum=checksum)
    state, _ = stopped_after(dict(source=path, names="y", batch_size=10), 1)
    fastst.save_file({name: rows[::-1].copy() for name, rows in table().items()}, path,
                     checksum=checksum)
    with Loader(path, "y", 10) as again:
        if checksum is None:
            again.load_state_dict(state)
            assert again.state_dict()["batch"] == 1
        else:
            with pytest.raises(SafetensorError, match="rows.safetensors has another header"):
                again.load_state_dict(state)


def test_a_state_is_refused_over_its_files_in_another_order(three_files):
    files = sorted(three_files.iterdir())
    state, _ = stopped_after(dict(source=files, names="y", batch_size=10), 1)
    with Loader([files[1], files[0], files[2]], "y", 10) as again:
        with pytest.raises(SafetensorError, match=r"another dataset: its files \[.*\] are "
                                                  r"in another order here"):
            again.load_state_dict(state)


def test_a_state_of_an_earlier_fastst_is_taken_over_the_files_it_names(tmp_path, three_files):
    """Its fingerprint names each file by path, device, inode, size and mtime: taken
    over those files unchanged, as it was, and refused, saying why, over a copy."""
    state, rest = stopped_after(dict(source=three_files, names="y", batch_size=10), 2)
    files = []
    for path in sorted(three_files.iterdir()):
        with fastst.safe_open(path) as handle:
            identity = handle.file_identity
        files.append([os.fsdecode(identity[0]), list(identity[1:])])
    earlier = {**state, "fingerprint": {"files": files, "names": ["y"],
                                        "rows": [40, 23, 40]}}
    with Loader(three_files, "y", 10) as again:
        again.load_state_dict(earlier)
        assert_same_batches(taken(again) + taken(again), rest)
    staged = shutil.copytree(three_files, tmp_path / "staged")
    with Loader(staged, "y", 10) as again:
        with pytest.raises(SafetensorError, match="another dataset: .* names its files by "
                                                  "path and inode .* start a new run"):
            again.load_state_dict(earlier)
    fresh_copy(three_files / "train-00001.safetensors")
    with Loader(three_files, "y", 10) as again:
        with pytest.raises(SafetensorError, match="train-00001.safetensors: file changed "
                                                  "since the state was saved"):
            again.load_state_dict(earlier)


def test_a_state_is_refused_for_other_files_or_settings(three_files, one_file):
    with Loader(three_files, "y", 10) as loader:
        state = loader.state_dict()
    with Loader(one_file, "y", 10) as other:
        with pytest.raises(SafetensorError, match="another dataset"):
            other.load_state_dict(state)
    with Loader(three_files, "x", 10) as other:
        with pytest.raises(SafetensorError, match="another dataset"):
            other.load_state_dict(state)
    with Loader(three_files, "y", 12) as other:
        with pytest.raises(ValueError, match="batch_size"):
            other.load_state_dict(state)
    with Loader(three_files, "y", 10) as other:
        with pytest.raises(ValueError, match="not a Loader"):
            other.load_state_dict({"epoch": 0})


@pytest.mark.parametrize("field,value", [("seed", -1), ("seed", "3"), ("seed", 2.5),
                                         ("seed", True), ("seed", None), ("epoch", "1"),
                                         ("epoch", 1.0), ("epoch", -1), ("batch", "2"),
                                         ("batch", 2.0), ("batch", True), ("batch", 99)])
def test_a_state_with_a_field_of_another_type_or_out_of_range_is_refused_naming_it(
        one_file, field, value):
    """Checked whole when loaded, not by ``int()`` nor at the first batch: the loader
    stays where it was."""
    with Loader(one_file, "y", 10, shuffle=True, seed=3) as loader:
        next(iter(loader))
        state = loader.state_dict()
        with pytest.raises(ValueError, match=f"^the state's {field} must be .*, got {value!r}$"):
            loader.load_state_dict({**state, field: value})
        assert loader.state_dict() == state
        assert rows_of(taken(loader)).tolist() == permutation(ROWS, 3, 0)[10:].tolist()


@pytest.mark.parametrize("shuffle,versions", [("blocks", ["block_edges", "draws"]),
                                               (True, ["draws"])])
def test_a_state_of_an_order_drawn_by_an_earlier_version_is_refused(three_files, shuffle,
                                                                    versions):
    """A block shuffle's order gives each block's edge row to the block read later, and
    both shuffles draw by deal_rows and shuffle_rows, which earlier orders did not: a
    state from then, whose settings do not say so, is refused, saying why, rather than
    continued in another order."""
    with Loader(three_files, "y", 10, shuffle=shuffle, seed=1, block_rows=8) as loader:
        next(iter(loader))
        state = loader.state_dict()
    assert [key for key in versions if key in state["settings"]] == versions
    for key in versions:
        earlier = {**state, "settings": {k: v for k, v in state["settings"].items()
                                         if k != key}}
        with Loader(three_files, "y", 10, shuffle=shuffle, seed=1, block_rows=8) as again:
            with pytest.raises(ValueError, match="drawn by an earlier version"):
                again.load_state_dict(earlier)
            again.load_state_dict(state)
    with Loader(three_files, "y", 10, seed=1) as loader:
        assert not {"block_edges", "draws"} & set(loader.state_dict()["settings"])


# ---------------------------------------------------------------------------
# buffers
# ---------------------------------------------------------------------------

def test_batches_reuse_the_ring_and_hold_until_prefetch_more_are_taken(one_file):
    prefetch = 2
    with Loader(one_file, ["x", "y"], 5, prefetch=prefetch, threads=2) as loader:
        batches, copies = [], []
        for batch in loader:
            batches.append(batch)
            copies.append({name: array.copy() for name, array in batch.items()})
            for held in range(max(0, len(batches) - prefetch), len(batches)):
                for name in batch:      # this one and the `prefetch - 1` before: intact
                    np.testing.assert_array_equal(batches[held][name], copies[held][name])
    ring = 2 * prefetch
    assert np.shares_memory(batches[0]["x"], batches[ring]["x"])       # reused
    assert not np.shares_memory(batches[0]["x"], batches[1]["x"])
    assert not np.array_equal(batches[0]["y"], copies[0]["y"])         # now a later batch


def test_the_ring_buffers_start_on_a_cache_line(one_file):
    """So that rows of whole lines can be copied in with stores that bypass the cache."""
    with Loader(one_file, ["x", "y"], 10) as loader:
        assert all(array.ctypes.data % 64 == 0 for batch in loader for array in batch.values())


def test_copy_gives_each_batch_its_own_arrays(one_file):
    with Loader(one_file, ["x", "y"], 5, prefetch=1, copy=True) as loader:
        batches = list(loader)
    assert_same_batches(batches, expected_batches(np.arange(ROWS), 5))
    assert not any(np.shares_memory(a["x"], b["x"]) for a in batches for b in batches
                   if a is not b)


@pytest.mark.parametrize("options,batches,most_threads", [
    (dict(batch_size=10**12), 1, 2),
    (dict(batch_size=10**12, shuffle=True, seed=1), 1, 2),
    (dict(batch_size=10**12, shuffle="blocks", seed=1, backend="pread"), 1, 2),
    (dict(batch_size=100, prefetch=10**9, threads=10**9), 40, 41),
    (dict(batch_size=1, threads=10**9), 4000, 5),
    (dict(batch_size=1, threads=10**9, backend="pread"), 4000, 5),
    (dict(batch_size=100, rank=7, world_size=10**9), 1, 1),
])
def test_no_buffer_order_or_thread_is_sized_by_a_number_past_what_the_rows_need(
        tmp_path, options, batches, most_threads):
    """A batch holds at most this rank's share of the rows, the ring at most the
    epoch's batches, the gathering threads at most the batches that may be in flight
    (`prefetch` beyond the one taken), a rank's order its share: nothing is sized by
    the number given alone."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file(table(4000), path)
    out = run_bounded(f"""
        import threading
        from fastst.data import Loader
        most = 0
        with Loader({str(path)!r}, ["x", "y"], **{options!r}) as loader:
            sizes = []
            for batch in loader:
                sizes.append(len(batch["y"]))
                gathering = [thread for thread in threading.enumerate()
                             if thread.name.startswith("fastst-loader-")
                             and thread.name[len("fastst-loader-"):].isdigit()]
                most = max(most, len(gathering))
        print(len(sizes), sum(sizes), most)
    """, memory=1 << 30, timeout=60)
    count, rows, threads = map(int, out.split())
    rows_needed = 1 if "world_size" in options else 4000
    assert (count, rows) == (batches, rows_needed)
    assert threads <= most_threads


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

def test_tensors_of_different_lengths_are_refused(tmp_path):
    path = tmp_path / "uneven.safetensors"
    fastst.save_file({"x": np.zeros((5, 2)), "y": np.zeros(4)}, path)
    with pytest.raises(SafetensorError, match="uneven.safetensors: tensors must have as many"):
        Loader(path, ["x", "y"], 2)


def test_a_file_without_a_tensor_is_refused_by_name(three_files):
    fastst.save_file({"x": table(23, 40)["x"]}, three_files / "train-00001.safetensors")
    with pytest.raises(TensorNotFoundError,
                       match=r"train-00001.safetensors: no tensor named 'y'"):
        Loader(three_files, ["x", "y"], 8)


@pytest.mark.parametrize("changed", [{"x": np.zeros((23, 4), np.float64)},
                                     {"x": np.zeros((23, 5), np.float32)}])
def test_rows_of_another_dtype_or_shape_are_refused_by_file(three_files, changed):
    fastst.save_file({**table(23, 40), **changed}, three_files / "train-00002.safetensors")
    with pytest.raises(SafetensorError, match=r"train-00002.safetensors: tensor 'x' has rows "
                                              r"of .* where .*train-00000.safetensors"):
        Loader(three_files, ["x", "y"], 8)


@pytest.mark.parametrize("argument,value", [("seed", -1), ("seed", "3"), ("seed", 2.5),
                                            ("seed", True), ("batch_size", 2.5),
                                            ("batch_size", True), ("batch_size", "2"),
                                            ("prefetch", 2.0), ("threads", False),
                                            ("block_rows", 0)])
def test_an_argument_of_another_type_or_out_of_range_is_refused_naming_it(one_file, argument,
                                                                          value):
    with pytest.raises(ValueError, match=f"^{argument} must be .*, got {value!r}$"):
        Loader(one_file, "y", **{"batch_size": 10, "shuffle": True, argument: value})


def test_patterns_and_folders_with_no_file_are_refused(tmp_path):
    with pytest.raises(SafetensorError, match="no file matches"):
        Loader(str(tmp_path / "none-*.safetensors"), "y", 2)
    with pytest.raises(SafetensorError, match="no .safetensors file"):
        Loader(tmp_path, "y", 2)
    with pytest.raises(ValueError, match="batch_size"):
        Loader([], "y", 0)


@pytest.mark.usefixtures("every_block_read")
def test_an_error_in_a_thread_is_raised_where_its_batch_is_taken(one_file):
    loader = Loader(one_file, "y", 10, threads=2, backend="pread")    # gathers in Python
    fill = loader._dataset.fill

    def failing(buffers, rows):
        if rows[0] == 50:
            raise OSError("the disk is gone")
        fill(buffers, rows)

    loader._dataset.fill = failing
    got = []
    with pytest.raises(OSError, match="the disk is gone"):
        for batch in loader:
            got.append(batch["y"].copy())
    assert rows_of([{"y": y} for y in got]).tolist() == list(range(50))
    assert not loader_threads()
    loader.close()


@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("shuffle", ["blocks", True])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_failed_read_ahead_is_raised_where_a_batch_waits_for_it(one_file, monkeypatch,
                                                                  shuffle, backend):
    cache_rows = fastst.NumpyHandle.cache_rows

    def failing(handle, name, first, stop):
        if first >= 60:
            raise OSError("the disk is gone")
        return cache_rows(handle, name, first, stop)

    monkeypatch.setattr(fastst.NumpyHandle, "cache_rows", failing)
    with Loader(one_file, "y", 10, shuffle=shuffle, block_rows=20, window_blocks=1, seed=0,
                backend=backend) as loader:
        with pytest.raises(OSError, match="the disk is gone"):
            taken(loader)
    assert not loader_threads()


@LINUX_ONLY
@pytest.mark.parametrize("shuffle", [False, True, "blocks"])
def test_a_closed_loader_leaves_no_map_of_its_files(one_file, shuffle):
    """Its files' maps go with the handles as it closes (no collection needed), after
    an iteration that ended and one left at a break."""
    with Loader(one_file, ["x", "y"], 10, shuffle=shuffle, seed=0) as loader:
        taken(loader)
        for _ in loader:
            break
    with open("/proc/self/maps") as maps:
        assert str(one_file) not in maps.read()


# ---------------------------------------------------------------------------
# the threads end
# ---------------------------------------------------------------------------

def loader_threads():
    return [thread for thread in threading.enumerate() if thread.name.startswith("fastst-loader")]


@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("shuffle, thread", [(False, "fastst-loader-0"),
                                             ("blocks", "fastst-loader-blocks"),
                                             (True, "fastst-loader-blocks")])
def test_threads_end_on_break_on_an_exception_and_when_collected(one_file, shuffle, thread):
    """The gathering threads, and a shuffle's reading threads."""
    gc.collect()
    fds = open_descriptors()
    with Loader(one_file, ["x", "y"], 4, shuffle=shuffle, seed=0, threads=3) as loader:
        for batch in loader:
            assert thread in {running.name for running in loader_threads()}
            break
        assert not loader_threads()
        with pytest.raises(ZeroDivisionError):
            for batch in loader:
                1 / 0
        assert not loader_threads()
        iterator = iter(loader)
        next(iterator)
        del iterator
        gc.collect()
        assert not loader_threads()
        assert len(taken(loader)) == len(loader) - 3      # a loop left early is continued
    assert opened_since(fds) == {}


@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("shuffle,failing,before", [   # the second gatherer, reader; the asker
    (False, "fastst-loader-1", 0), (True, "fastst-loader-1", 0), ("blocks", "fastst-loader-1", 0),
    (True, "fastst-loader-blocks", 1), ("blocks", "fastst-loader-blocks", 1),
    ("blocks", "fastst-loader-claims", 0)])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_threads_started_end_when_the_next_cannot_start(one_file, monkeypatch, shuffle,
                                                        failing, before, backend):
    """A thread the system will not start (its limit of threads, of memory) is an
    error at the first batch; those started before it end, and the loader goes on."""
    start, started = threading.Thread.start, []

    def fails(thread):
        if thread.name == failing and started.count(failing) == before:
            raise RuntimeError("can't start new thread")
        started.append(thread.name)
        start(thread)

    with Loader(one_file, "y", 10, shuffle=shuffle, seed=0, threads=2,
                backend=backend) as loader:
        monkeypatch.setattr(threading.Thread, "start", fails)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            next(iter(loader))
        assert wait_until(lambda: not loader_threads(), timeout=10)
        monkeypatch.undo()
        assert sorted(rows_of(taken(loader)).tolist()) == list(range(ROWS))


def test_threads_end_at_interpreter_exit(one_file):
    code = textwrap.dedent(f"""
        import os, threading, numpy as np
        from fastst.data import Loader
        fds = len(os.listdir("/proc/self/fd"))
        loader = Loader({str(one_file)!r}, ["x", "y"], 2, threads=2, prefetch=3)
        left = iter(loader)          # left unfinished, in a global, threads waiting
        next(left)
        print(threading.active_count())
        """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3"]
    counting = textwrap.dedent(f"""
        import os, threading
        from fastst.data import Loader
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            with Loader({str(one_file)!r}, ["x", "y"], 2) as loader:
                for batch in loader:
                    break
        print(threading.active_count() - threads, len(os.listdir("/proc/self/fd")) - fds)
        """)
    done = subprocess.run([sys.executable, "-c", counting], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0"]


def test_numpy_batches_need_no_torch(one_file):
    loaded = modules_loaded_by(
        f"from fastst.data import Loader; [b for b in Loader({str(one_file)!r}, 'y', 7)]",
        ["torch", "jax"])
    assert loaded == []


# ---------------------------------------------------------------------------
# sources other than local files
# ---------------------------------------------------------------------------

@pytest.fixture
def big_file(tmp_path):
    """4000 rows of 1 KiB: more than a URL's first request reads."""
    path = tmp_path / "big.safetensors"
    fastst.save_file({"x": np.arange(4000 * 256, dtype=np.float32).reshape(4000, 256),
                      "y": np.arange(4000)}, path)
    return path


def test_batches_over_a_url_are_ranged_requests_a_tensor(big_file, one_file):
    with RangeServer({"/big.safetensors": big_file.read_bytes()}) as server:
        url = f"{server.url}/big.safetensors"
        with Loader(url, ["x", "y"], 500, threads=2) as loader:
            server.reset_counts()
            got = taken(loader)
            gets = len(server.gets())
        assert len(got) == 8
        expected = fastst.load_file(big_file)
        for k, batch in enumerate(got):
            for name in ("x", "y"):
                np.testing.assert_array_equal(batch[name], expected[name][500 * k:500 * k + 500])
        assert len(got) <= gets <= 2 * len(got)     # adjacent rows: a request at most
        with Loader([url, one_file], "y", 300, shuffle=True, seed=0) as loader:
            order = permutation(4000 + ROWS, 0, 0)
            assert rows_of(taken(loader)).tolist() == np.where(order < 4000, order,
                                                               order - 4000).tolist()


def test_a_url_that_changes_under_the_loader_is_an_error(big_file):
    with RangeServer({"/big.safetensors": big_file.read_bytes()}) as server:
        with Loader(f"{server.url}/big.safetensors", "x", 500) as loader:
            server.mode = "change"
            with pytest.raises(SafetensorError, match="big.safetensors"):
                taken(loader)
        assert not loader_threads()


class CountedRowBlocks(fastst._data.rowblocks.RowBlocks):
    """RowBlocks that keep a list of themselves, for tests to read their counts."""
    made: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountedRowBlocks.made.append(self)


@pytest.fixture
def counted_row_blocks(monkeypatch):
    CountedRowBlocks.made = []
    monkeypatch.setattr(fastst._data.pipeline, "RowBlocks", CountedRowBlocks)
    return CountedRowBlocks.made


@pytest.mark.parametrize("rank", [None, 1])
def test_a_block_shuffle_over_a_url_reads_each_block_whole_once_an_epoch(
        big_file, counted_row_blocks, rank):
    """16 blocks of 250 rows, windows of 4: the batches of the local file, each block
    fetched once (adjacent ones in one request), never more than two windows held."""
    ranks = {} if rank is None else {"rank": rank, "world_size": 2}
    settings = dict(shuffle="blocks", seed=5, block_rows=250, window_blocks=4, threads=2,
                    **ranks)
    data = big_file.read_bytes()
    with RangeServer({"/big.safetensors": data}) as server:
        url = f"{server.url}/big.safetensors"
        with Loader(big_file, ["x", "y"], 100, **settings) as local, \
                Loader(url, ["x", "y"], 100, **settings) as remote:
            expected = taken(local)
            server.reset_counts()
            assert_same_batches(taken(remote), expected)
            gets, sent = len(server.gets()), server.bytes_sent
            assert_same_batches(taken(remote), taken(local))      # the next epoch too
    (blocks, *_) = counted_row_blocks
    wanted = {row // 250 for batch in expected for row in batch["y"].tolist()}
    assert blocks.fetches == len(wanted) and blocks.most_held <= 2 * 4
    assert gets <= 2 * len(wanted)                  # a request a block and tensor at most
    assert sent <= len(wanted) * 250 * (256 * 4 + 8) + (64 << 10)   # their rows, once
    assert not loader_threads()


def test_a_block_shuffle_over_a_url_ends_its_fetches_on_break_and_on_errors(big_file):
    with RangeServer({"/big.safetensors": big_file.read_bytes()}) as server:
        url = f"{server.url}/big.safetensors"
        with Loader(url, "x", 100, shuffle="blocks", seed=1, block_rows=250,
                    window_blocks=4) as loader:
            for k, _ in enumerate(loader):
                if k == 3:
                    break
            assert not loader_threads()
            server.mode = "change"       # a new version under the loader
            with pytest.raises(SafetensorError, match="changed since it was opened"):
                taken(loader)
    assert not loader_threads()


def test_batches_over_fsspec_memory(one_file):
    fsspec = pytest.importorskip("fsspec")
    with fsspec.open("memory://loader/rows.safetensors", "wb") as target:
        target.write(one_file.read_bytes())
    with Loader("memory://loader/rows.safetensors", ["x", "y"], 25, shuffle=True,
                seed=8) as loader:
        assert_same_batches(taken(loader), expected_batches(
            permutation(ROWS, 8, 0), 25))


# ---------------------------------------------------------------------------
# frameworks
# ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")     # JAX, imported by others
@pytest.mark.usefixtures("every_block_read")
@pytest.mark.parametrize("shuffle", [True, "blocks"])
def test_torch_batches_and_workers_that_split_the_batches(one_file, shuffle):
    """Each of a DataLoader's workers gathers every other batch (a block shuffle's
    claims then take its batches' rows a batch at a time, not as one slice)."""
    torch = pytest.importorskip("torch")
    loader = Loader(one_file, ["x", "y"], 10, shuffle=shuffle, seed=6, framework="pt",
                    copy=True, block_rows=10, window_blocks=2)
    batches = list(loader)
    assert all(isinstance(batch["x"], torch.Tensor) for batch in batches)
    order = epoch_order(ROWS, shuffle, 6, 0, 10, 2)
    assert_same_batches([{k: v.numpy() for k, v in b.items()} for b in batches],
                        expected_batches(order, 10))
    loader.set_epoch(0)
    for workers in (0, 1, 2):
        through = torch.utils.data.DataLoader(loader.torch_dataset(), batch_size=None,
                                              num_workers=workers)
        got = [{k: v.numpy() for k, v in batch.items()} for batch in through]
        assert_same_batches(got, expected_batches(order, 10))     # each batch once, in order
    loader.close()


def test_jax_batches(one_file):
    jax = pytest.importorskip("jax")
    with Loader(one_file, ["x", "y"], 50, framework="jax") as loader:
        batches = list(loader)
    assert all(isinstance(batch["x"], jax.Array) for batch in batches)
    np.testing.assert_array_equal(np.asarray(batches[0]["y"]), np.arange(50))
    np.testing.assert_array_equal(np.asarray(batches[2]["y"]), np.arange(100, ROWS))


def test_rank_and_world_size_come_from_torch_distributed_when_initialised(one_file,
                                                                        monkeypatch):
    torch = pytest.importorskip("torch")
    distributed = torch.distributed
    monkeypatch.setattr(distributed, "is_available", lambda: True)
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "get_rank", lambda: 2)
    monkeypatch.setattr(distributed, "get_world_size", lambda: 3)
    with Loader(one_file, "y", 5, shuffle=True, seed=1) as loader:
        assert (loader.rank, loader.world_size) == (2, 3)
        order = permutation(ROWS, 1, 0)
        assert rows_of(taken(loader)).tolist() == np.resize(order, 35 * 3)[2::3].tolist()


def test_a_spawned_worker_reopens_the_files(three_files):
    torch = pytest.importorskip("torch")
    with Loader(three_files, ["x", "y"], 10, shuffle=True, seed=2, threads=1) as loader:
        through = torch.utils.data.DataLoader(loader.torch_dataset(), batch_size=None,
                                              num_workers=1, multiprocessing_context="spawn",
                                              timeout=120)
        got = [{k: v.numpy() for k, v in batch.items()} for batch in through]
    assert_same_batches(got, expected_batches(permutation(ROWS, 2, 0),
                                              10))


def test_pinned_memory_needs_torch_batches_and_an_accelerator(one_file):
    with pytest.raises(ValueError, match="pin_memory=True needs framework='pt'"):
        Loader(one_file, "y", 4, pin_memory=True)
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with Loader(one_file, "y", 4, framework="pt", pin_memory=True) as loader:
            batch = next(iter(loader))
            assert batch["y"].is_pinned() and batch["y"].tolist() == [0, 1, 2, 3]
    else:
        with pytest.raises(RuntimeError, match="pin_memory=True needs pinned memory"):
            Loader(one_file, "y", 4, framework="pt", pin_memory=True)
