"""A FUSE file system for tests: a read-only view of a folder, served by a child
process (with mfusepy over libfuse), that logs each read the kernel asks of it.

``with passthrough_mount(folder, mountpoint) as reads`` mounts `folder` on
`mountpoint` within a few seconds (or skips the test, saying why: no /dev/fuse, no
mfusepy, no libfuse, no right to mount) and unmounts it on leaving; ``reads()`` is
the list of (name, offset, length) read from the daemon so far.

Run as a script (``python fuse_mount.py FOLDER MOUNTPOINT LOG``), it is the daemon.
"""
import contextlib
import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

MOUNT_SECONDS = 10


@contextlib.contextmanager
def passthrough_mount(folder, mountpoint):
    reason = _why_not_mountable()
    if reason:
        pytest.skip(f"no FUSE mount here: {reason}")
    log = f"{mountpoint}.reads"
    daemon = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(folder),
                               str(mountpoint), log],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for_mount(daemon, mountpoint)
        yield lambda: _reads_in(log)
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                       timeout=MOUNT_SECONDS)
        try:
            daemon.communicate(timeout=MOUNT_SECONDS)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.communicate()


def _why_not_mountable():
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 (fuse3) is not installed"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed"
    return None


def _wait_for_mount(daemon, mountpoint):
    deadline = time.monotonic() + MOUNT_SECONDS
    while not os.path.ismount(mountpoint):
        if daemon.poll() is not None:
            output = daemon.communicate()[0].decode(errors="replace").strip()
            pytest.skip(f"no FUSE mount here: the daemon ended ({output[-300:]})")
        if time.monotonic() > deadline:
            daemon.kill()
            pytest.fail(f"the FUSE daemon did not mount {mountpoint} in {MOUNT_SECONDS} s")
        time.sleep(0.02)


def _reads_in(log):
    with open(log) as lines:
        return [(name, int(offset), int(length))
                for name, offset, length in (line.split() for line in lines)]


def _serve(folder, mountpoint, log):
    import mfusepy

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def __init__(self):
            self.log = open(log, "a", buffering=1)

        def _real(self, path):
            return os.path.join(folder, path.lstrip("/"))

        def getattr(self, path, fh=None):
            found = os.lstat(self._real(path))
            return {key: getattr(found, key) for key in (
                "st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns",
                "st_mtime_ns", "st_ctime_ns")}

        def readdir(self, path, fh):
            return [".", ".."] + os.listdir(self._real(path))

        def open(self, path, flags):
            if flags & (os.O_WRONLY | os.O_RDWR):
                raise mfusepy.FuseOSError(errno.EROFS)
            return os.open(self._real(path), os.O_RDONLY)

        def read(self, path, size, offset, fh):
            data = os.pread(fh, size, offset)
            self.log.write(f"{path.lstrip('/')} {offset} {len(data)}\n")
            return data

        def release(self, path, fh):
            os.close(fh)
            return 0

    mfusepy.FUSE(Passthrough(), mountpoint, foreground=True, ro=True)


if __name__ == "__main__":
    _serve(*sys.argv[1:4])
