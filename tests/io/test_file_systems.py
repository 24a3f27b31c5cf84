"""Local files on file systems that refuse things, mounted for these tests: ramfs, which
refuses O_DIRECT (EINVAL); a read-only tmpfs; a tmpfs with no room left. Every read
option reads the same bytes from each; a save that cannot be made raises an OSError
naming the file and leaves the old file whole, with nothing beside it. Mounting needs
root (CAP_SYS_ADMIN): elsewhere these tests are skipped."""
import errno
import itertools
import os
import subprocess

import numpy as np
import pytest

import fastst
from fastst._core import read_counters

pytestmark = pytest.mark.usefixtures("restore_read_options")

KIB = 1 << 10
MIB = 1 << 20
TENSORS = {"a": np.arange(MIB // 4, dtype=np.float32),
           "odd": np.arange(3, 300_003, dtype=np.uint8),
           "empty": np.zeros(0, np.int8)}
OPTIONS = [dict(threads=threads, request_bytes=256 * KIB, direct=direct, hints=hints,
                huge_pages=huge_pages)
           for threads, direct, hints, huge_pages in itertools.product((1, 3), (False, True),
                                                                      (False, True),
                                                                      (False, True))]
FILE_SYSTEMS = ["tmpfs", "ramfs", "read-only", "full"]


def mount(kind, folder, options=None):
    """Mount a file system of `kind` on `folder`, or skip the test where that is not
    permitted."""
    command = ["mount", "-t", kind] + (["-o", options] if options else []) + [kind, folder]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        pytest.skip("no mount command")
    if done.returncode != 0:
        pytest.skip(f"cannot mount {kind} here: {done.stderr.strip()}")


def unmount(folder):
    subprocess.run(["umount", "--lazy", folder], capture_output=True, timeout=30)


def fill(folder):
    """Write a file in `folder` until the file system has no room left."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4 * KIB))
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)


@pytest.fixture(scope="module")
def file_systems(tmp_path_factory):
    """{name: folder} of the file systems above, each holding x.safetensors (TENSORS),
    aligned.safetensors (the same, saved with align=4096) and a sharded checkpoint of
    them in checkpoint/."""
    root = tmp_path_factory.mktemp("mounts")
    folders = {name: str(root / name) for name in FILE_SYSTEMS}
    mounted = []
    try:
        for name, (kind, options) in {"tmpfs": ("tmpfs", "size=8m"), "ramfs": ("ramfs", None),
                                      "read-only": ("tmpfs", "size=8m"),
                                      "full": ("tmpfs", "size=8m")}.items():
            os.mkdir(folders[name])
            mount(kind, folders[name], options)
            mounted.append(folders[name])
            fastst.save_file(TENSORS, os.path.join(folders[name], "x.safetensors"))
            fastst.save_file(TENSORS, os.path.join(folders[name], "aligned.safetensors"),
                             align=4096)
            fastst.save_file(TENSORS, os.path.join(folders[name], "checkpoint"),
                             max_shard_size=MIB)
        subprocess.run(["mount", "-o", "remount,ro", folders["read-only"]], check=True,
                       capture_output=True, timeout=30)
        fill(folders["full"])
        yield folders
    finally:
        for folder in mounted:
            unmount(folder)


def reads_of(path):
    """What each way of reading a local file gives for `path`."""
    into = {name: np.empty_like(array) for name, array in TENSORS.items()}
    fastst.load_into(path, into)
    with fastst.safe_open(path) as f:
        walked = dict(f.iter_tensors(prefetch_bytes=100 * KIB))
    return [fastst.load_file(path), fastst.load_file(path, copy=True),
            fastst.load_file(path, backend="pread"), into, walked]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda options: "-".join(
    f"{key}={value}" for key, value in options.items() if key != "request_bytes"))
@pytest.mark.parametrize("system", FILE_SYSTEMS)
def test_every_read_option_reads_the_same_bytes_on_every_file_system(file_systems, system,
                                                                      options):
    fastst.read_options(**options)
    for name in ("x.safetensors", "aligned.safetensors"):
        before = read_counters()
        for result in reads_of(os.path.join(file_systems[system], name)):
            assert sorted(result) == sorted(TENSORS)
            for tensor, array in TENSORS.items():
                assert result[tensor].dtype == array.dtype
                assert result[tensor].tobytes() == array.tobytes(), (name, tensor)
        if system == "ramfs":
            refused = read_counters()["direct_refused"] - before["direct_refused"]
            direct = read_counters()["direct_requests"] - before["direct_requests"]
            assert direct == 0 and (refused > 0) == options["direct"]


def saves(folder):
    """(target, save()) for each way of saving into `folder`, each over what is there."""
    big = {"w": np.ones(2 * MIB, np.uint8)}
    small = {"w": np.ones(1, np.uint8)}
    path = os.path.join(folder, "x.safetensors")

    def stream():
        with fastst.StreamWriter(path, {"w": ("U8", (2 * MIB,))}) as writer:
            writer.write("w", big["w"])

    return [(path, lambda: fastst.save_file(big, path)),
            (path, lambda: fastst.save_file(small, path)),
            (path, lambda: fastst.save_file(big, path, fsync=True)),
            (path, stream),
            (os.path.join(folder, "checkpoint"), lambda: fastst.save_file(
                {"w": big["w"], "v": big["w"]}, os.path.join(folder, "checkpoint"),
                max_shard_size=3 * MIB))]


def names(error, target):
    """Whether `error` names `target`: the file, its temporary file beside it, or for a
    checkpoint's folder, a file in it."""
    if os.path.splitext(target)[1] != ".safetensors":
        return os.path.dirname(error.filename) == target
    return error.filename == target or (
        os.path.dirname(error.filename) == os.path.dirname(target)
        and os.path.basename(error.filename).startswith(f".{os.path.basename(target)}."))


def contents(folder):
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, found in os.walk(folder) for name in found)


@pytest.mark.parametrize("system, error", [("full", errno.ENOSPC), ("read-only", errno.EROFS)])
def test_a_save_that_finds_no_room_or_a_read_only_file_system_names_the_file(
        file_systems, system, error):
    folder = file_systems[system]
    files = contents(folder)
    for target, save in saves(folder):
        with pytest.raises(OSError) as raised:
            save()
        assert raised.value.errno == error and raised.value.filename is not None, target
        assert names(raised.value, target), (raised.value, target)
        assert contents(folder) == files            # nothing left beside
        for whole in (os.path.join(folder, "x.safetensors"), os.path.join(folder, "checkpoint")):
            loaded = fastst.load_file(whole)
            assert all(loaded[name].tobytes() == array.tobytes()
                       for name, array in TENSORS.items())
