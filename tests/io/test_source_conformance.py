"""The tests of tests/conformance.py over every kind of Source and every ranged fetch:
local files (mapped and read), buffers, file objects, HTTP (fastst's client and
fsspec's), memory:// and S3 (moto, and the loopback server as an S3 endpoint)."""
import io
import os

import pytest

from conformance import RangedFetchTests, SourceTests
from fastst._io.source import Buffer, as_source
from fastst.remote import open_object
from servers import http_store, moto_s3, served  # noqa: F401


@pytest.fixture
def memory_folder():
    """put(name, data) -> the memory:// URL of an object holding `data`."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")

    def put(name, data):
        fs.pipe(f"/conformance/{name}", bytes(data))
        return f"memory://conformance/{name}"

    yield put
    if fs.exists("/conformance"):
        fs.rm("/conformance", recursive=True)


@pytest.fixture(scope="module")
def moto_bucket():
    """put(name, data) -> (the s3:// URL of an object holding `data`, storage_options),
    on moto."""
    with moto_s3() as options:
        import s3fs

        fs = s3fs.S3FileSystem(**options)

        def put(name, data):
            fs.pipe(f"fastst/{name}", bytes(data))
            return f"s3://fastst/{name}", options

        yield put


def s3_on(server):
    """storage_options that reach `server` as an S3 endpoint (objects at /bucket/key)."""
    pytest.importorskip("s3fs")
    return {"key": "k", "secret": "s", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": server.url, "region_name": "eu-west-1"}}


# ---------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------


class LocalFiles(SourceTests):
    backend = ""    # the subclass's: "mmap" or "pread"

    @pytest.fixture
    def put(self, tmp_path):
        def put(name, data):
            # replaced as a save replaces it: a new file in its place
            (tmp_path / ".part").write_bytes(data)
            os.replace(tmp_path / ".part", tmp_path / name)
            return as_source(str(tmp_path / name), backend=self.backend)

        return put


    def test_a_folder_is_a_directory_named_as_it_is(self, tmp_path):
        folder = as_source(str(tmp_path), backend=self.backend)
        assert folder.is_directory() is True and folder.name == tmp_path.name


class TestMappedLocalFile(LocalFiles):
    backend = "mmap"


class TestReadLocalFile(LocalFiles):
    backend = "pread"


class InMemory(SourceTests):
    # Bytes or a file object in memory: nothing tells one version of them from the
    # next, so a handle on them is not opened again; they are in no folder, and a
    # checkpoint's index is read from a path or a URL only.
    can_change = can_reopen = reads_whole = in_folder = False


class TestBuffer(InMemory):
    @pytest.fixture
    def put(self):
        return lambda name, data: Buffer(data)


class TestBytesIO(InMemory):
    @pytest.fixture
    def put(self):
        return lambda name, data: as_source(io.BytesIO(data))


class TestOpenFileObject(InMemory):
    @pytest.fixture
    def put(self, tmp_path):
        opened = []

        def put(name, data):
            (tmp_path / name).write_bytes(data)
            opened.append(open(tmp_path / name, "rb"))
            return as_source(opened[-1])

        yield put
        for file in opened:
            file.close()


class TestHttp(SourceTests):
    options = None
    query = "?download=true"

    @pytest.fixture
    def put(self, served):
        _, put = served
        return lambda name, data: as_source(put(name, data), self.options)


class TestHttpThroughFsspec(TestHttp):
    options = {"transport": "fsspec"}


class TestMemory(SourceTests):
    @pytest.fixture
    def put(self, memory_folder):
        return lambda name, data: as_source(memory_folder(name, data))


class TestS3(SourceTests):
    @pytest.fixture
    def put(self, moto_bucket):
        return lambda name, data: as_source(*moto_bucket(name, data))


# ---------------------------------------------------------------------------
# Ranged fetches
# ---------------------------------------------------------------------------


class TestHttpRanges(RangedFetchTests):
    options = None

    @pytest.fixture
    def server(self, served):
        return served[0]

    @pytest.fixture
    def fetch_of(self, served):
        _, put = served
        return lambda data: open_object(put("bucket/object", data), self.options)


class TestFsspecHttpRanges(TestHttpRanges):
    options = {"transport": "fsspec"}


class TestS3Ranges(TestHttpRanges):
    @pytest.fixture
    def fetch_of(self, served):
        server, put = served
        options = s3_on(server)

        def fetch_of(data):
            put("bucket/object", data)
            return open_object("s3://bucket/object", options)

        return fetch_of


class TestMemoryRanges(RangedFetchTests):
    @pytest.fixture
    def fetch_of(self, memory_folder):
        return lambda data: open_object(memory_folder("object", data), None)


class TestMotoS3Ranges(RangedFetchTests):
    @pytest.fixture
    def fetch_of(self, moto_bucket):
        return lambda data: open_object(*moto_bucket("object", data))
