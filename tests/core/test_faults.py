"""Files cut short under copies from their maps: a SafetensorError naming the file,
never a SIGBUS, whenever the cut comes (the copies are guarded: see fastst/_core/faults.h); and a
SIGBUS raised anywhere else still reaches the handler there was before, or kills."""
import random
import signal
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fastst

from helpers import bounded_ending

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="SIGBUS on a file cut short under its map is Linux's")

FILES = 8              # files of a dataset: their lengths are watched (inotify)
FILE_ROWS = 1024       # rows of 4 KiB: 4 MiB a file
TRIALS = 30


def write_files(folder):
    """FILES files of FILE_ROWS rows of 4 KiB in `folder`, file k's rows all k."""
    folder.mkdir()
    for k in range(FILES):
        rewrite(folder, k)
    return folder


def rewrite(folder, k):
    fastst.save_file({"x": np.full((FILE_ROWS, 1024), k, np.float32)},
                     folder / f"part-{k}.safetensors")


CUT_DURING_AN_EPOCH = """
import os, threading, time
from fastst.data import Loader
cut = threading.Event()
def cut_short():
    time.sleep({delay})
    os.truncate({victim!r}, os.path.getsize({victim!r}) // 2)
    cut.set()
try:
    with Loader({folder!r}, "x", 256, shuffle={shuffle!r}, seed=1) as loader:
        threading.Thread(target=cut_short, daemon=True).start()
        while True:                        # until an epoch began after the cut
            after_the_cut = cut.is_set()
            for batch in loader:
                pass
            if after_the_cut:
                break
    print("completed")
except fastst.SafetensorError as error:
    print("error:", error)
"""


def cut_during_an_epoch(folder, k, delay, shuffle):
    """How a child's epochs over `folder` ended, file k cut to half its length after
    `delay` seconds; file k is then written again."""
    victim = str(folder / f"part-{k}.safetensors")
    try:
        return bounded_ending(CUT_DURING_AN_EPOCH.format(
            folder=str(folder), victim=victim, delay=delay, shuffle=shuffle), timeout=60)
    finally:
        rewrite(folder, k)


def test_a_file_cut_short_during_an_epoch_is_an_error_not_a_fault(tmp_path):
    """Eight files of 4 MiB, one cut to half its length 20-200 ms into an epoch, in
    fresh processes, unshuffled and both shuffles: each ends with a SafetensorError
    naming the file cut. Before the copies were guarded, where the file's watch had
    not yet told the batch being copied, 7 to 9 of 30 such processes died of SIGBUS."""
    folders = [write_files(tmp_path / "a"), write_files(tmp_path / "b")]
    draw = random.Random(0)
    trials = [(draw.randrange(FILES), draw.uniform(0.02, 0.2), shuffle)
              for shuffle in [False, True, "blocks"] * (TRIALS // 3)]

    def run(side):      # two children at once, each over a folder of its own
        return [cut_during_an_epoch(folders[side], *trial) for trial in trials[side::2]]

    with ThreadPoolExecutor(2) as pool:
        even, odd = pool.map(run, [0, 1])
    endings = [ending for pair in zip(even, odd) for ending in pair]
    signalled = [(trial, ending.returncode) for trial, ending in zip(trials, endings)
                 if ending.returncode < 0]
    assert not signalled, f"{len(signalled)} of {TRIALS} died of a signal: {signalled}"
    for (k, _, _), ending in zip(trials, endings):
        assert ending.returncode == 0, ending.stderr[-3000:]
        assert f"error: {tmp_path}" in ending.stdout
        assert f"part-{k}.safetensors: file was truncated" in ending.stdout


def test_a_copy_from_a_buffer_whose_mapped_file_was_cut_short_is_an_error(tmp_path):
    """A buffer mapped from a file (an mmap the caller made) whose file was cut short:
    a copy of its tensors ends with a SafetensorError, where it died of SIGBUS."""
    path = tmp_path / "mapped.safetensors"
    fastst.save_file({"x": np.ones((64, 1024), np.float32)}, path)
    ending = bounded_ending(f"""
        import mmap, os
        with open({str(path)!r}, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate({str(path)!r}, 4096)
        try:
            fastst.load(mapped, copy=True)
            print("copied")
        except fastst.SafetensorError as error:
            print("error:", error)
        """)
    assert ending.returncode == 0, ending.stderr[-3000:]
    assert ending.stdout.startswith("error: <buffer>: tensor 'x': file was truncated")


def test_a_gather_from_a_map_whose_file_is_cut_short_during_the_copy_is_an_error(tmp_path):
    """A mapped file is checked before a gather copies its rows; one cut short after
    the check, while the rows are copied, ends the gather with a SafetensorError (it
    died of SIGBUS). The rows of the file's first half are gathered 8 times, then
    those of its second half, cut off as soon as the first row is in."""
    path = tmp_path / "rows.safetensors"
    ending = bounded_ending(f"""
        import os, threading
        import numpy as np
        path, rows = {str(path)!r}, 4096
        order = np.concatenate([np.tile(np.arange(rows // 2), 8), np.arange(rows // 2, rows)])
        for attempt in range(5):           # until the cut comes before the copy ends
            fastst.save_file({{"x": np.ones((rows, 1024), np.float32)}}, path)
            out = np.zeros((len(order), 1024), np.float32)
            def cut_once_copying():
                while out[0, 0] == 0:
                    pass
                os.truncate(path, os.path.getsize(path) // 2)
            cutting = threading.Thread(target=cut_once_copying)
            with fastst.safe_open(path) as handle:
                cutting.start()
                try:
                    handle.gather("x", order, out=out)
                    print("copied")
                except fastst.SafetensorError as error:
                    print("error:", error)
                    break
                finally:
                    cutting.join()
        """, timeout=60)
    assert ending.returncode == 0, ending.stderr[-3000:]
    assert f"error: {path}: tensor 'x': file was truncated" in ending.stdout


TOUCH_A_VIEW_CUT_SHORT = """
import faulthandler, os, signal
from fastst.data import Loader
path = {path!r}
faulthandler.disable()       # whatever the environment asked
def loader():                # puts the handler of guarded copies in place
    with Loader(path, "x", 4) as rows:
        next(iter(rows))
{steps}
with fastst.safe_open(path) as handle:
    view = handle.get_tensor("x")       # a view of the map: not guarded
    os.truncate(path, 4096)
    {touch}
print("survived")
"""


@pytest.mark.parametrize("steps, touch, killed, reports", [
    ("faulthandler.enable(); loader()", "view[-1].sum()", True, 1),
    ("loader(); faulthandler.enable()", "view[-1].sum()", True, 1),
    ("loader(); faulthandler.enable(); loader()", "view[-1].sum()", True, 1),
    ("loader(); faulthandler.enable(); loader(); faulthandler.disable()", "view[-1].sum()",
     True, 0),
    ("loader()", "view[-1].sum()", True, 0),
    ("loader()", "os.kill(os.getpid(), signal.SIGBUS)", True, 0),
    ("signal.signal(signal.SIGBUS, signal.SIG_IGN); loader()",
     "os.kill(os.getpid(), signal.SIGBUS)", False, 0),
], ids=["faulthandler-then-loader", "loader-then-faulthandler",
        "faulthandler-between-loaders", "faulthandler-disabled-between-loaders",
        "no-faulthandler", "sent", "sent-and-ignored"])
def test_a_sigbus_outside_the_guarded_copies_goes_where_it_went_before(
        tmp_path, steps, touch, killed, reports):
    """A view of a file cut short, touched past the file's end, still kills the
    process with SIGBUS, after faulthandler's report where it is enabled (one, in
    whichever order it and the handler of the guarded copies were set), and so does
    a SIGBUS sent to it; one sent while SIGBUS was ignored is still ignored."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.ones((64, 1024), np.float32)}, path)
    ending = bounded_ending(TOUCH_A_VIEW_CUT_SHORT.format(
        path=str(path), steps="\n".join(steps.split("; ")), touch=touch))
    assert ending.returncode == (-signal.SIGBUS if killed else 0), ending.stderr[-3000:]
    assert ending.stderr.count("Fatal Python error: Bus error") == reports, ending.stderr
    assert ("survived" in ending.stdout) != killed


def test_a_guarded_copy_is_an_error_with_faulthandler_enabled_after_the_handler(tmp_path):
    """faulthandler enabled once the handler of guarded copies is in place would see
    a guarded copy's fault first, report it as fatal and raise it again: the next
    guarded copy puts the handler back above it, and its fault is an error, with no
    report."""
    path = tmp_path / "rows.safetensors"
    fastst.save_file({"x": np.ones((64, 1024), np.float32)}, path)
    ending = bounded_ending(f"""
        import faulthandler, mmap, os
        from fastst.data import Loader
        with Loader({str(path)!r}, "x", 4) as rows:
            next(iter(rows))
        faulthandler.enable()
        with open({str(path)!r}, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        os.truncate({str(path)!r}, 4096)
        try:
            fastst.load(mapped, copy=True)
        except fastst.SafetensorError as error:
            print("error:", error)
        """)
    assert ending.returncode == 0, ending.stderr[-3000:]
    assert "Fatal Python error" not in ending.stderr
    assert ending.stdout.startswith("error: <buffer>: tensor 'x': file was truncated")
