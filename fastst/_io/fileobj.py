"""A binary file object (``open(path, "rb")``, ``io.BytesIO``, a socket's file...)
read as a safetensors file by byte ranges: the `FileObjectRanges` the compiled Reader
fetches through."""
from __future__ import annotations

import os
import threading
from typing import Any, List, Sequence

from .._core import SafetensorError
from .ranged import Range


class FileObjectRanges:
    """Byte ranges of a binary file object: the ``fetch`` through which
    ``safe_open`` reads a file object.

    Called with a list of ``(offset, length)``, it returns the bytes of each,
    read one range at a time under a lock (the object has one position),
    through ``readinto`` where the object has it. An answer longer than asked,
    or not bytes, is refused; a short one is returned as it is (the reader
    reports it, naming the tensor).

    Parameters
    ----------
    file : binary file object
        Open, with ``seek`` and ``read``.
    label : str
        What messages call it.

    Attributes
    ----------
    size : int
        The file's size (found by seeking to its end).

    Raises
    ------
    SafetensorError
        When the file object is closed or cannot seek (a pipe, a socket).

    Examples
    --------
    >>> import io
    >>> from fastst.remote import FileObjectRanges
    >>> ranges = FileObjectRanges(io.BytesIO(b"0123456789"), "<digits>")
    >>> ranges.size, [bytes(part) for part in ranges([(2, 3), (8, 2)])]
    (10, [b'234', b'89'])
    """

    __module__ = "fastst.remote"

    def __init__(self, file: Any, label: str) -> None:
        self.file = file
        self.source = label     # what messages call it
        self.lock = threading.Lock()
        self.readinto = getattr(file, "readinto", None)
        try:
            end = file.seek(0, os.SEEK_END)
            self.size = end if isinstance(end, int) else file.tell()
        except (OSError, ValueError) as error:   # a pipe, a socket, a closed file
            raise SafetensorError(f"{self.source}: a file object is read by byte ranges and "
                                  f"must be open and seekable ({error})") from None

    def __call__(self, ranges: Sequence[Range]) -> List[Any]:
        with self.lock:
            return [self.read(offset, length) for offset, length in ranges]

    def read(self, offset: int, length: int) -> Any:
        """Up to `length` bytes at `offset`: fewer only at the end of the file (the
        core then reports the short read).

        Raises
        ------
        SafetensorError
            When the file object gives more bytes than asked for, or something
            else than bytes.
        """
        self.file.seek(offset)
        if self.readinto is None:
            pieces, done = [], 0
            while done < length:
                piece = self.file.read(length - done)
                if not piece:
                    break
                if not isinstance(piece, (bytes, bytearray, memoryview)):
                    raise SafetensorError(f"{self.source}: the file object's read returned "
                                          f"a {type(piece).__name__}, not bytes")
                done += self.within(memoryview(piece).nbytes, length - done, "read")
                pieces.append(piece)
            return b"".join(pieces)
        buffer = bytearray(length)
        view, done = memoryview(buffer), 0
        while done < length:
            count = self.readinto(view[done:])
            if not count:
                break
            done += self.within(count, length - done, "readinto")
        return view[:done]

    def within(self, count: Any, room: int, call: str) -> int:
        """`count`, the bytes the file object's `call` says it gave when asked for at
        most `room`.

        Raises
        ------
        SafetensorError
            When `count` is more than `room`, or not a count.
        """
        if not isinstance(count, int) or count < 0:
            raise SafetensorError(f"{self.source}: the file object's {call} returned "
                                  f"{count!r}, not a count of bytes")
        if count > room:
            raise SafetensorError(f"{self.source}: the file object's {call} gave {count} "
                                  f"bytes when asked for {room} (too long)")
        return count


