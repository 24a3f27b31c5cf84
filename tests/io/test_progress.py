"""Progress bars: drawn on a terminal for long work (convert, verify, sharded
conversions and saves, loads from a URL), never into a pipe; without any library installed.

Each command runs in a child whose stdout and stderr are a pseudo-terminal (or
pipes), and the test reads what it drew. The child hides tqdm, as a fresh
``pip install .`` has none, and sets the size from which a bar is drawn."""
from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pytest

import fastst

BAR = re.compile(r"\r(reading|writing|verifying|verify|save|download) +(\d+)% \|[# ]+\| "
                 r"\d+/\d+ MiB")
CONVERT_PHASES = ["reading", "writing", "verifying"]
CHILD = """
import sys
sys.modules["tqdm"] = None          # not installed
import fastst._io.progress
min_bytes = {min_bytes!r}
if min_bytes is not None:
    fastst._io.progress.PROGRESS_MIN_BYTES = min_bytes
from fastst.cli import main
sys.exit(main({argv!r}))
"""
TIMEOUT = 60


def child_command(argv, min_bytes):
    return [sys.executable, "-c", CHILD.format(argv=[str(a) for a in argv], min_bytes=min_bytes)]


def run_on_terminal(argv, *, min_bytes=0, size=(24, 80)):
    """Run ``fastst argv`` on a pseudo-terminal of `size` (rows, columns); its exit
    status and everything it wrote there."""
    return run_command_on_terminal(child_command(argv, min_bytes), size)


def run_command_on_terminal(command, size=(24, 80)):
    """Run `command` on a pseudo-terminal of `size` (rows, columns): its exit status
    and everything it wrote there."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", *size, 0, 0))
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                             stdout=follower, stderr=follower)
    os.close(follower)
    drawn = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:       # EIO: the child closed the terminal
                break
            if not chunk:
                break
            drawn.append(chunk)
        code = child.wait(timeout=TIMEOUT)
    finally:
        child.kill()
        os.close(leader)
    return code, b"".join(drawn).decode()


def run_in_pipes(argv, *, min_bytes=0):
    """Run ``fastst argv`` with stdout and stderr piped: status, stdout, stderr."""
    done = subprocess.run(child_command(argv, min_bytes), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT)
    return done.returncode, done.stdout, done.stderr


def bars(text):
    return [(match.group(1), int(match.group(2))) for match in BAR.finditer(text)]


@pytest.fixture
def npy(tmp_path):
    path = tmp_path / "weights.npy"
    np.save(path, np.arange(1 << 16, dtype=np.float32))
    return path


@pytest.fixture
def checked(tmp_path):
    path = tmp_path / "checked.safetensors"
    fastst.save_file({"a": np.ones(1 << 15), "b": np.zeros(1 << 15)}, path, checksum="xxh3_64")
    return path


def test_convert_draws_a_bar_on_a_terminal_and_erases_it(npy, tmp_path):
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "out.safetensors"])
    assert code == 0, drawn
    shown = bars(drawn)
    percents = [percent for _, percent in shown]
    assert percents == sorted(percents) and percents[-1] >= 99, drawn
    table = drawn.index("out.safetensors")
    assert drawn.rindex("%") < table and "\r" + " " * 40 in drawn[:table]   # erased first
    assert fastst.load_file(tmp_path / "out.safetensors")["array"].shape == (1 << 16,)


def test_a_conversion_bar_names_each_phase_and_counts_the_check_as_work(npy, tmp_path):
    """Writing, then reading back and comparing, each shows under its name as its share
    of the bar: the bar does not sit at 99% while the file is checked."""
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "out.safetensors"])
    assert code == 0, drawn
    shown = bars(drawn)
    phases = [kind for kind, _ in shown]
    assert sorted(set(phases), key=CONVERT_PHASES.index) == CONVERT_PHASES, drawn
    assert phases == sorted(phases, key=CONVERT_PHASES.index), drawn     # one after the other
    assert 45 <= max(percent for kind, percent in shown if kind == "writing") <= 50, drawn
    assert shown[-1][0] == "verifying" and shown[-1][1] >= 99, drawn


def test_verify_draws_a_bar_on_a_terminal(checked):
    code, drawn = run_on_terminal(["verify", checked])
    assert code == 0 and "ok: 2 tensors" in drawn, drawn
    assert bars(drawn)[-1] == ("verify", 100), drawn


def test_a_sharded_conversion_draws_a_bar(tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "pytorch_model.bin"
    torch.save({f"w{k}": torch.ones(1 << 12) for k in range(4)}, src)
    code, drawn = run_on_terminal(["convert", src, tmp_path / "model.safetensors",
                                   "--max-shard-size", "20000"])
    assert code == 0 and "(5 files)" in drawn, drawn
    assert bars(drawn)[-1][1] >= 95, drawn


def test_no_bar_in_a_pipe(npy, checked, tmp_path):
    code, out, err = run_in_pipes(["convert", npy, tmp_path / "out.safetensors"])
    assert code == 0 and "1 file(s)" in out and err == ""
    code, out, err = run_in_pipes(["verify", checked])
    assert code == 0 and "ok: 2 tensors" in out and err == ""


def test_no_bar_for_short_work_or_when_told(npy, checked, tmp_path):
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "a.safetensors"], min_bytes=None)
    assert code == 0 and "1 file(s)" in drawn and "%" not in drawn, drawn     # 256 KiB
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "b.safetensors",
                                   "--no-progress"])
    assert code == 0 and "1 file(s)" in drawn and "%" not in drawn, drawn
    code, drawn = run_on_terminal(["verify", checked, "--no-progress"])
    assert code == 0 and "%" not in drawn, drawn


def test_a_terminal_that_gives_no_width_still_gets_a_bar(npy, tmp_path):
    """A pty of 0 x 0 (``script`` without a terminal behind it, some CI runners):
    the bar is drawn 80 columns wide."""
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "out.safetensors"], size=(0, 0))
    assert code == 0 and bars(drawn)[-1][1] >= 99, drawn
    assert max(len(line) for line in drawn.split("\r")) < 80


def test_a_narrow_terminal_gets_a_line_that_fits(npy, tmp_path):
    code, drawn = run_on_terminal(["convert", npy, tmp_path / "out.safetensors"], size=(24, 30))
    assert code == 0, drawn
    table = drawn.index("file ")
    assert "verifying" in drawn[:table]
    assert max(len(line) for line in drawn[:table].split("\r")) < 30


SHARDED_SAVE = """
import sys
import numpy as np
import fastst, fastst._io.progress
fastst._io.progress.PROGRESS_MIN_BYTES = 0
arrays = {{f"layer{{k}}": np.full(1 << 18, k, np.float32) for k in range(8)}}
fastst.save_file(arrays, {folder!r}, max_shard_size=2 << 20)
print("saved", file=sys.stderr)
"""


def test_a_sharded_save_draws_a_bar_on_a_terminal_and_none_in_a_pipe(tmp_path):
    """The library's sharded save shows its bytes on a terminal, never in a pipe."""
    script = SHARDED_SAVE.format(folder=str(tmp_path / "on-terminal"))
    code, text = run_command_on_terminal([sys.executable, "-c", script])
    assert code == 0, text
    shown = [percent for kind, percent in bars(text) if kind == "save"]
    assert shown and shown[-1] == 100 and shown == sorted(shown), text
    piped = subprocess.run([sys.executable, "-c", SHARDED_SAVE.format(
        folder=str(tmp_path / "in-pipe"))], capture_output=True, text=True, timeout=TIMEOUT)
    assert piped.returncode == 0 and piped.stderr == "saved\n"
    assert fastst.load_file(tmp_path / "in-pipe").keys() == \
        fastst.load_file(tmp_path / "on-terminal").keys()


REMOTE_LOAD = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
import fastst, fastst._io.progress
from servers import RangeServer
fastst._io.progress.PROGRESS_MIN_BYTES = 0
arrays = {{f"layer{{k}}": np.full(1 << 18, k, np.float32) for k in range(8)}}
if {scheme!r} == "memory":
    import fsspec
    url = "memory://bars/model.safetensors"
    fsspec.filesystem("memory").pipe_file(url, fastst.save(arrays))
    loaded = fastst.load_file(url)
else:
    with RangeServer({{"/model.safetensors": fastst.save(arrays)}}) as server:
        loaded = fastst.load_file(server.url + "/model.safetensors")
assert all((loaded[name] == array).all() for name, array in arrays.items())
print("loaded", file=sys.stderr)
"""


@pytest.mark.needs("fsspec", "aiohttp")
@pytest.mark.parametrize("scheme", ["memory", "http"])
def test_a_load_from_a_url_draws_a_bar_on_a_terminal_and_none_in_a_pipe(scheme):
    """The bytes a load brings from a store, on a terminal; nothing in a pipe."""
    script = REMOTE_LOAD.format(tests=os.path.dirname(os.path.dirname(__file__)), scheme=scheme)
    code, drawn = run_command_on_terminal([sys.executable, "-c", script])
    assert code == 0, drawn
    shown = [percent for kind, percent in bars(drawn) if kind == "download"]
    assert shown and shown[-1] >= 99 and shown == sorted(shown), drawn
    piped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=TIMEOUT)
    assert piped.returncode == 0 and piped.stderr == "loaded\n", piped.stderr

