"""Tests that every kind of Source, and every ranged fetch, passes whatever carries its
bytes (import it as ``conformance``): a kind's test class subclasses `SourceTests` or
`RangedFetchTests` and gives the fixture that makes one
(tests/io/test_source_conformance.py). A new transport gets every test by writing one
class; where a kind differs on purpose, its class says so by a flag, with why."""
import contextlib
import os
import pickle
import re

import numpy as np
import pytest

import fastst
from fastst import SafetensorError
from fastst._core import DEFAULT_MAX_HEADER_SIZE, Reader
from servers import new_version

NAME = "model.safetensors"
# 'big' is past the first request (64 KiB) and fetched straight into its array
TENSORS = {"big": np.arange(64 * 1024, dtype=np.float64),
           "small": np.arange(12, dtype=np.int16).reshape(3, 4),
           "empty": np.zeros((0, 3), np.float32),
           "tail": np.ones(16, np.uint8)}
DATA = fastst.save(TENSORS, metadata={"format": "np"})
OTHER = {"other": np.full(5, 7, np.int32)}


def assert_tensors(read, expected=TENSORS):
    """`read(name)` gives each tensor of `expected`, as it was saved."""
    for name, array in expected.items():
        got = read(name)
        assert got.dtype == array.dtype and got.shape == array.shape, name
        assert got.tobytes() == array.tobytes(), name


def reopen(source, seen, reader):
    source.reopen(reader, seen, max_header_size=DEFAULT_MAX_HEADER_SIZE, what="file",
                  since="it was seen", remedy="open it again")


class SourceTests:
    """What every Source does. A subclass gives the fixture `put`: put(name, data) -> the
    Source (``fastst._io.source.as_source``'s) of a file called `name` that holds `data`;
    putting the same name again replaces its bytes, where the kind can (`can_change`)."""

    can_change = True    # its bytes can be replaced under an open source
    can_reopen = True    # it tells its version (an Identity), so handles on it pickle
    reads_whole = True   # read_all reads it (a checkpoint's index)
    in_folder = True     # it has a name, and siblings beside it
    query = None         # what may follow its name (a URL's query), not part of it

    @pytest.fixture
    def put(self):
        raise NotImplementedError

    def test_every_tensor_reads_right_through_safe_open(self, put):
        source = put(NAME, DATA)
        with fastst.safe_open(source) as f:
            assert f.keys() == sorted(TENSORS)
            assert f.metadata() == {"format": "np"}
            assert_tensors(f.get_tensor)
            assert f.get_slice("big")[100:103].tolist() == [100.0, 101.0, 102.0]

    def test_every_tensor_reads_right_through_the_sources_own_open(self, put):
        source = put(NAME, DATA)
        reader = Reader()
        source.open(reader, max_header_size=DEFAULT_MAX_HEADER_SIZE)
        try:
            assert_tensors(reader.get_tensor)
            assert_tensors(reader.get_tensors().__getitem__)
        finally:
            reader.close()

    def test_a_pickled_handle_opens_the_same_version_again(self, put):
        source = put(NAME, DATA)
        with fastst.safe_open(source) as f:
            if not self.can_reopen:
                with pytest.raises(SafetensorError, match=re.escape(source.cannot_reopen())):
                    pickle.dumps(f)
                return
            again = pickle.loads(pickle.dumps(f))
        with again:
            assert_tensors(again.get_tensor)

    def test_the_version_seen_is_opened_again(self, put):
        source = put(NAME, DATA)
        seen = source.identity()
        reader = Reader()
        if not self.can_reopen:
            assert seen is None
            with pytest.raises(SafetensorError, match=re.escape(
                    f"{source.label}: {source.cannot_reopen()}")):
                reopen(source, seen, reader)
            return
        assert seen.location == (os.path.abspath(source.label) if seen.is_local()
                                 else source.label)
        reopen(source, seen, reader)
        try:
            assert_tensors(reader.get_tensor)
        finally:
            reader.close()

    def test_a_changed_version_is_refused_naming_the_location(self, put):
        if not self.can_change:
            pytest.skip(f"{type(self).__name__}: its bytes cannot change under it")
        source = put(NAME, DATA)
        seen = source.identity()
        with fastst.safe_open(source) as f:
            pickled = pickle.dumps(f)
        put(NAME, new_version(DATA))
        assert source.identity() != seen
        with pytest.raises(SafetensorError, match="changed since it was seen") as error:
            reopen(source, seen, Reader())
        assert str(error.value).startswith(f"{seen.location}: file changed")
        with pytest.raises(SafetensorError, match="changed since the handle was pickled"):
            pickle.loads(pickled)

    def test_read_all_gives_the_bytes_within_its_limit_and_refuses_more(self, put):
        source = put(NAME, DATA)
        if not self.reads_whole:
            with pytest.raises(SafetensorError, match=re.escape(
                    f"{source.label}: index must be a local file or a URL")):
                source.read_all(len(DATA), "index")
            return
        assert source.read_all(len(DATA), "index") == DATA
        with pytest.raises(SafetensorError) as error:
            source.read_all(len(DATA) - 1, "index")
        assert str(error.value).endswith(f": index of {len(DATA)} bytes exceeds the limit of "
                                         f"{len(DATA) - 1} bytes")
        assert source.name in str(error.value)

    def test_a_sibling_is_the_file_beside_it(self, put):
        source = put(NAME, DATA)
        if not self.in_folder:
            with pytest.raises(SafetensorError, match=re.escape(f"{source.label}: has no "
                                                                f"folder")):
                source.sibling("other.safetensors")
            return
        put("other.safetensors", fastst.save(OTHER))
        sibling = source.sibling("other.safetensors")
        assert sibling.name == "other.safetensors"
        assert sibling.label == source.label[:-len(NAME)] + "other.safetensors"
        with fastst.safe_open(sibling) as f:
            assert_tensors(f.get_tensor, OTHER)

    def test_a_missing_file_has_no_version_and_is_not_found(self, put):
        if not self.in_folder:
            pytest.skip(f"{type(self).__name__}: has no siblings")
        missing = put(NAME, DATA).sibling("missing.safetensors")
        assert missing.identity() is None
        with pytest.raises(FileNotFoundError, match="missing.safetensors"):
            fastst.safe_open(missing)

    def test_a_query_is_no_part_of_its_name(self, put, tmp_path):
        if self.query is None:
            pytest.skip(f"{type(self).__name__}: nothing follows its name")
        assert put(NAME + self.query, DATA).name == NAME
        fastst.save_file(TENSORS, tmp_path / NAME, max_shard_size=4096)
        for shard in tmp_path.glob("*-of-*.safetensors"):
            put(shard.name, shard.read_bytes())
        index = tmp_path / f"{NAME}.index.json"
        # a checkpoint, its shards beside its index
        with fastst.safe_open(put(index.name + self.query, index.read_bytes())) as f:
            assert_tensors(f.get_tensor)

    def test_a_truncated_file_is_refused_naming_it(self, put):
        source = put(NAME, DATA[:-10])
        with pytest.raises(SafetensorError, match="truncated") as error:
            fastst.safe_open(source)
        assert str(error.value).startswith(f"{source.label}: ")

    def test_its_name_is_the_files_and_it_is_no_folder(self, put):
        source = put(NAME, DATA)
        assert source.name == (NAME if self.in_folder else "")
        assert source.is_directory() is False


class RangedFetchTests:
    """What every ranged fetch (``fastst._io.ranged.RangedFetch``) does. A subclass gives the
    fixtures `fetch_of`: fetch_of(data) -> a RangedFetch of an object that holds `data`;
    and `server`: the tests.servers.RangeServer it is on, whose modes make it answer
    wrongly, or None for a store that cannot be made to (`memory://`)."""

    @pytest.fixture
    def fetch_of(self):
        raise NotImplementedError

    @pytest.fixture
    def server(self):
        return None

    @pytest.fixture
    def hostile(self, server):
        if server is None:
            pytest.skip(f"{type(self).__name__}: its store cannot be made to answer wrongly")
        return server

    def test_ranges_come_back_exactly_as_asked(self, fetch_of):
        fetch = fetch_of(DATA)
        assert fetch.size == len(DATA) and fetch.version.size == len(DATA)
        assert fetch.ranges_ignored is False
        ranges = [(0, 8), (8, 100), (108, 4), (200_000, 3), (len(DATA) - 7, 7),
                  (50, 20), (60, 0)]    # adjacent, far apart, at the end, overlapping, empty
        got = fetch(ranges)
        assert [bytes(item) for item in got] == [DATA[at:at + n] for at, n in ranges]

    def test_fetch_into_fills_the_buffers_given_and_nothing_else(self, fetch_of):
        fetch = fetch_of(DATA)
        ranges = [(300_000, 70_000), (16, 40), (56, 8), (100_000, 1), (len(DATA) - 3, 3)]
        guard = 64
        memory = bytearray(b"\xa5" * (sum(n for _, n in ranges) + guard * (len(ranges) + 1)))
        views, at = [], guard
        for _, length in ranges:
            views.append(memoryview(memory)[at:at + length])
            at += length + guard
        assert fetch.fetch_into(ranges, views) == [n for _, n in ranges]
        at = guard
        for offset, length in ranges:
            assert memory[at - guard:at] == b"\xa5" * guard
            assert memory[at:at + length] == DATA[offset:offset + length], offset
            at += length + guard
        assert memory[at - guard:] == b"\xa5" * guard

    def test_a_range_past_the_end_comes_back_cut_at_the_end(self, fetch_of):
        fetch = fetch_of(DATA)
        ranges = [(len(DATA) - 2, 10), (0, 4)]
        assert [bytes(item) for item in fetch(ranges)] == [DATA[-2:], DATA[:4]]
        buffers = [memoryview(bytearray(10)), memoryview(bytearray(4))]
        assert fetch.fetch_into(ranges, buffers) == [2, 4]
        assert bytes(buffers[0][:2]) == DATA[-2:] and bytes(buffers[1]) == DATA[:4]

    def test_fetch_into_refuses_a_buffer_not_as_long_as_its_range(self, fetch_of):
        fetch = fetch_of(DATA)
        with pytest.raises(ValueError, match=r"bytes \[8, 18\) need a writable buffer of 10 "
                                             r"bytes"):
            fetch.fetch_into([(8, 10)], [memoryview(bytearray(9))])

    @pytest.mark.parametrize("mode", ["short", "short-length"])
    def test_a_short_answer_is_refused_naming_the_object_and_tensor(self, fetch_of, hostile,
                                                                      mode):
        with self.opened(fetch_of(DATA)) as reader:
            hostile.mode = mode
            with pytest.raises(SafetensorError) as error:
                reader.get_tensor("big")
        assert str(error.value).startswith(f"{reader.source}: ")
        assert "short read" in str(error.value) or "cut short" in str(error.value)

    def test_a_long_answer_is_refused_unread(self, fetch_of, hostile):
        with self.opened(fetch_of(DATA)) as reader:
            hostile.mode = "overlong"
            hostile.reset_counts()
            with pytest.raises(SafetensorError, match="too long") as error:
                reader.get_tensor("big")
        assert str(error.value).startswith(f"{reader.source}: ")
        assert hostile.bytes_sent < 64 << 20    # what the sockets' buffers took in, at most

    def test_a_server_that_ignores_ranges_is_read_whole_once(self, fetch_of, hostile):
        hostile.mode = "ignore-range"
        fetch = fetch_of(DATA)
        hostile.reset_counts()
        assert bytes(fetch([(0, 64)])[0]) == DATA[:64]    # the start of the whole object
        assert fetch.ranges_ignored is True
        ranges = [(300_000, 10), (70_000, 5)]
        assert [bytes(item) for item in fetch(ranges)] == [DATA[at:at + n] for at, n in ranges]
        assert [bytes(item) for item in fetch(ranges[::-1])] == [DATA[70_000:70_005],
                                                                 DATA[300_000:300_010]]
        assert len(hostile.gets()) == 2     # its start, then the whole of it, once

    @staticmethod
    @contextlib.contextmanager
    def opened(fetch):
        """A Reader open on `fetch`, as ``fastst._io.source.Url`` opens one."""
        reader = Reader()
        reader.open_ranges(fetch.label, fetch.size, fetch, identity=fetch.identity)
        try:
            yield reader
        finally:
            reader.close()

