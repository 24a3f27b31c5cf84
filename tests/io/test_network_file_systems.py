"""Files on network file systems (NFS, FUSE, Lustre, CephFS, SMB...), told by statfs's
f_type, are read by a plan of parallel preads into fresh memory, shared by more threads
than a local disk's, where faulting a map waits for a round trip a page; elsewhere they
are mapped. The caller's backend and read_options always win. The file system type is
faked through ``fastst._io.source.file_system_type``, and read for real from a FUSE mount
where one can be made here (see fuse_mount.py)."""
import os

import numpy as np
import pytest

import fastst
import fastst._io.source
from fastst._core import read_counters, read_threads
from fastst._io.limits import DEFAULT_BACKEND
from fastst._io.source import NETWORK_READ_THREADS
from fastst.checkpoint import open_checkpoint
from fuse_mount import passthrough_mount

pytestmark = pytest.mark.usefixtures("restore_read_options")

MIB = 1 << 20
TENSORS = {"w": np.arange(MIB, dtype=np.float32), "b": np.arange(1000, dtype=np.int16)}
NETWORK = {"NFS": 0x6969, "FUSE": 0x65735546, "Lustre": 0x0BD00BD0, "CephFS": 0x00C36400,
           "9p": 0x01021997, "CIFS": 0xFF534D42, "SMB2": 0xFE534D42, "SMB": 0x517B,
           "AFS": 0x5346414F, "GPFS": 0x47504653}
LOCAL = {"ext4": 0xEF53, "xfs": 0x58465342, "btrfs": 0x9123683E, "tmpfs": 0x01021994,
         "overlayfs": 0x794C7630}


def data_bytes(tensors):
    return sum(array.nbytes for array in tensors.values())


@pytest.fixture
def statfs_calls(monkeypatch):
    """Make every path's file system the one `statfs_calls.kind` says, and count the
    paths asked about."""
    class Fake:
        def __init__(self):
            self.kind = LOCAL["ext4"]
            self.paths = []

        def __call__(self, path):
            self.paths.append(path)
            return self.kind

    fake = Fake()
    monkeypatch.setattr(fastst._io.source, "file_system_type", fake)
    return fake


def loaded_by_plan(load, *args, **kwargs):
    """What `load` returned, and the bytes read plans read meanwhile."""
    before = read_counters()["bytes"]
    loaded = load(*args, **kwargs)
    return loaded, read_counters()["bytes"] - before


def threads_sharing_a_plan(path):
    """The threads that read the file's tensors: those started, and the caller's."""
    before = read_counters()["threads_started"]
    fastst.load_file(path, copy=True)
    return read_counters()["threads_started"] - before + 1


@pytest.mark.parametrize("system, kind, planned",
                         [(name, kind, "pread") for name, kind in NETWORK.items()]
                         + [(name, kind, "mmap") for name, kind in LOCAL.items()])
def test_a_file_on_a_network_file_system_is_read_by_a_plan_and_elsewhere_mapped(
        tmp_path, statfs_calls, system, kind, planned):
    path = tmp_path / "model.safetensors"
    fastst.save_file(TENSORS, path)
    statfs_calls.kind, statfs_calls.paths = kind, []
    with fastst.safe_open(path) as handle:
        assert handle.backend == planned
    loaded, read = loaded_by_plan(fastst.load_file, path)
    assert read == (data_bytes(TENSORS) if planned == "pread" else 0)
    assert all(np.array_equal(loaded[name], TENSORS[name]) for name in TENSORS)
    assert statfs_calls.paths == [os.path.abspath(path)] * 2


@pytest.mark.parametrize("kind, backend", [(NETWORK["NFS"], "mmap"), (LOCAL["ext4"], "pread")])
def test_the_callers_backend_wins_over_the_file_system(tmp_path, statfs_calls, kind, backend):
    path = tmp_path / "model.safetensors"
    fastst.save_file(TENSORS, path)
    statfs_calls.kind, statfs_calls.paths = kind, []
    with fastst.safe_open(path, backend=backend) as handle:
        assert handle.backend == backend


@pytest.mark.parametrize("kind, threads", [(NETWORK["NFS"], NETWORK_READ_THREADS),
                                           (LOCAL["ext4"], read_threads())])
def test_a_plan_on_a_network_file_system_is_shared_by_more_threads(tmp_path, statfs_calls,
                                                                    kind, threads):
    path = tmp_path / "model.safetensors"
    fastst.save_file(TENSORS, path)
    fastst.read_options(request_bytes=64 << 10)     # 64 requests: more than any thread count
    statfs_calls.kind = kind
    assert threads_sharing_a_plan(path) == threads


def test_the_callers_threads_win_over_the_file_system(tmp_path, statfs_calls):
    path = tmp_path / "model.safetensors"
    fastst.save_file(TENSORS, path)
    fastst.read_options(threads=3, request_bytes=64 << 10)
    statfs_calls.kind = NETWORK["Lustre"]
    assert threads_sharing_a_plan(path) == 3


def test_every_shard_of_a_checkpoint_on_a_network_file_system_is_read_by_a_plan(
        tmp_path, statfs_calls):
    fastst.save_file(TENSORS, tmp_path, max_shard_size=MIB)
    statfs_calls.kind = NETWORK["CephFS"]
    with open_checkpoint(tmp_path) as handle:
        assert handle.backend == "pread"
    loaded, read = loaded_by_plan(fastst.load_file, tmp_path)
    assert read == data_bytes(TENSORS)
    assert sorted(loaded) == sorted(TENSORS)


def test_a_path_whose_file_system_cannot_be_told_is_mapped_or_refused_as_before(tmp_path):
    missing = tmp_path / "gone.safetensors"
    assert fastst._io.source.planned_reading(str(missing), DEFAULT_BACKEND) == ("mmap", 0)
    with pytest.raises(FileNotFoundError):
        fastst.load_file(missing)


@pytest.mark.needs("mfusepy")     # in the FUSE daemon, a child process
def test_a_load_from_a_fuse_mount_reads_each_byte_once_by_a_plan(tmp_path):
    served, mountpoint = tmp_path / "served", tmp_path / "mount"
    served.mkdir()
    mountpoint.mkdir()
    fastst.save_file(TENSORS, served / "model.safetensors")
    size = os.path.getsize(served / "model.safetensors")
    with passthrough_mount(served, mountpoint) as reads:
        loaded, read = loaded_by_plan(fastst.load_file, mountpoint / "model.safetensors")
        served_reads = sorted(reads())
    assert read == data_bytes(TENSORS)
    assert all(np.array_equal(loaded[name], TENSORS[name]) for name in TENSORS)
    covered = 0
    for name, offset, length in served_reads:
        assert (name, offset) == ("model.safetensors", covered), served_reads
        covered += length
    assert covered == size
