"""The reference's next API (safetensors 0.9): get_tensor_meta, the header's word on a
tensor without its bytes, on every kind of handle."""
import io
import json
import struct

import numpy as np
import pytest

import fastst
from servers import http_store, served  # noqa: F401  (fixtures)

KIB = 1 << 10


def header_of(data):
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return header


def meta_in(header, name):
    entry = header[name]
    return fastst.TensorMeta(entry["dtype"], entry["shape"], tuple(entry["data_offsets"]))


def mixed_tensors():
    return {"fp32_2d": np.arange(12, dtype=np.float32).reshape(3, 4),
            "fp16_3d": np.arange(24, dtype=np.float16).reshape(2, 3, 4),
            "scalar": np.array(7.5, np.float32),
            "empty_2d": np.empty((0, 5), np.float16),
            "i64_1d": np.arange(5, dtype=np.int64)}


class CountingFile(io.BytesIO):
    """A file object that counts the bytes read from it."""

    def __init__(self, data):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        got = super().read(size)
        self.bytes_read += len(got)
        return got

    def readinto(self, buffer):
        got = super().readinto(buffer)
        self.bytes_read += got
        return got


def opened_every_way(tmp_path, data, url):
    """(what, handle) of the file `data` opened every way a handle reads one."""
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    buffer = fastst.NumpyHandle()
    buffer.open_buffer(data)
    yield "mmap", fastst.safe_open(path)
    yield "pread", fastst.safe_open(path, backend="pread")
    yield "torch", fastst.safe_open(path, framework="pt")
    yield "jax", fastst.safe_open(path, framework="jax")
    yield "url", fastst.safe_open(url)
    yield "file object", fastst.safe_open(io.BytesIO(data))
    yield "buffer", buffer


@pytest.mark.needs("torch", "jax")
def test_get_tensor_meta_matches_the_header_for_every_kind_of_handle(tmp_path, served):
    server, put = served
    data = fastst.save(mixed_tensors(), {"foo": "bar"})
    url = put("x.safetensors", data)
    for what, handle in opened_every_way(tmp_path, data, url):
        with handle as f:
            for name in header_of(data):
                meta = f.get_tensor_meta(name)
                assert type(meta) is fastst.TensorMeta, what
                assert meta == meta_in(header_of(data), name), (what, name)
            with pytest.raises(fastst.TensorNotFoundError):
                f.get_tensor_meta("nope")


def test_get_tensor_meta_of_a_checkpoint_is_its_shards(tmp_path):
    tensors = {f"w{k}": np.full((10, 10), k, np.float32) for k in range(3)}
    fastst.save_file(tensors, tmp_path, max_shard_size=800)
    with fastst.safe_open(tmp_path) as f:
        for name in tensors:
            shard = (tmp_path / f.shard_file(name)).read_bytes()
            assert f.get_tensor_meta(name) == meta_in(header_of(shard), name)
        with pytest.raises(fastst.TensorNotFoundError, match="no tensor named 'nope'"):
            f.get_tensor_meta("nope")


def test_get_tensor_meta_is_frozen():
    meta = fastst.TensorMeta("F32", [3, 4], (0, 48))
    for field, value in (("dtype", "F16"), ("shape", [4]), ("data_offsets", (0, 1))):
        with pytest.raises(AttributeError):
            setattr(meta, field, value)


def test_get_tensor_meta_reads_no_tensor_bytes(served):
    server, put = served
    data = fastst.save({"big": np.zeros(1 << 20, np.uint8), "small": np.ones(3)})
    url = put("meta.safetensors", data)
    with fastst.safe_open(url) as f:
        server.reset_counts()
        assert f.get_tensor_meta("big").shape == [1 << 20]
        assert server.requests == [] and server.bytes_sent == 0
    file = CountingFile(data)
    with fastst.safe_open(file) as f:
        opened = file.bytes_read
        assert f.get_tensor_meta("big").data_offsets == (24, 24 + (1 << 20))
        assert file.bytes_read == opened < 1 << 20


def test_get_tensor_meta_of_a_closed_handle_is_a_clear_error(tmp_path):
    fastst.save_file({"x": np.zeros(2)}, tmp_path / "x.safetensors")
    f = fastst.safe_open(tmp_path / "x.safetensors", framework="np")
    f.close()
    with pytest.raises(fastst.SafetensorError, match="file is closed"):
        f.get_tensor_meta("x")
