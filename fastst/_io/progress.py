"""Progress bars over bytes, drawn on stderr when it is a terminal (and never when
it is a pipe or a file), by fastst itself: no library is needed."""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

# Less work than this is done before a bar would tell anything.
PROGRESS_MIN_BYTES = 64 << 20
BAR_CELLS = 30
DEFAULT_COLUMNS = 80      # a terminal that gives no width (a pty of size 0 x 0)


class ByteBar:
    """A one-line bar over `total` bytes on the terminal `stream`:
    ``writing  42% |############                  | 161/384 MiB, 512 MiB/s``.
    ``update(nbytes)`` counts work done, ``phase(desc)`` says what the work does
    now; the line is drawn again only when either changes (at most 101 times for
    the percentage), and erased by ``close()``."""

    def __init__(self, total: int, desc: str, stream: TextIO, done: int = 0) -> None:
        self.total, self.desc, self.stream = max(total, 1), desc, stream
        self.done = done
        self.start = time.monotonic()
        self.shown_percent = -1
        self.width = 0
        self._draw()

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._percent() != self.shown_percent:
            self._draw()

    def phase(self, desc: str) -> None:
        if desc != self.desc:
            self.desc = desc
            self._draw()

    def close(self) -> None:
        if self.width:
            self._write("\r" + " " * self.width + "\r")
            self.width = 0

    def _percent(self) -> int:
        return min(100, self.done * 100 // self.total)

    def _draw(self) -> None:
        percent = self._percent()
        self.shown_percent = percent
        filled = percent * BAR_CELLS // 100
        elapsed = time.monotonic() - self.start
        rate = f", {self.done / elapsed / 2**20:.0f} MiB/s" if elapsed > 0.05 else ""
        line = (f"{self.desc} {percent:3d}% |{'#' * filled}{' ' * (BAR_CELLS - filled)}| "
                f"{self.done / 2**20:.0f}/{self.total / 2**20:.0f} MiB{rate}")
        line = line[:_columns(self.stream) - 1]
        self._write("\r" + line.ljust(self.width))
        self.width = max(self.width, len(line))

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):     # the terminal went away: the work goes on
            self.width = 0


def _columns(stream: TextIO) -> int:
    try:
        columns = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        columns = 0
    return columns if columns > 1 else DEFAULT_COLUMNS


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is open on a terminal (False for a pipe, a file, or a
    stream without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def byte_bar(total: int, desc: str, min_bytes: Optional[int] = None,
             done: int = 0) -> Optional[ByteBar]:
    """A bar over `total` bytes on stderr, `done` of them done already, whose
    ``update(nbytes)`` counts work done; None when stderr is not a terminal or the
    work is under `min_bytes` (default: `PROGRESS_MIN_BYTES`, 64 MiB)."""
    least = PROGRESS_MIN_BYTES if min_bytes is None else min_bytes
    if total < least or not is_terminal(sys.stderr):
        return None
    return ByteBar(total, desc, sys.stderr, done)
