"""Runs of bytes inside a tensor: the part a shard owns."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

from .reader import Reader

def read_runs(
    reader: Reader, name: str, offsets: npt.ArrayLike, length: int, out: npt.NDArray[Any], /
) -> npt.NDArray[Any]:
    """Read runs of bytes of one tensor, and nothing else, one after another into `out`.

    What a shard of a tensor (a box of it: ``[start, stop)`` along each axis)
    needs: the pread backend reads each run (runs adjacent in the file in one
    call), a file read by ranges asks for them, a mapped file or a buffer copies
    them. ``NumpyHandle.read_runs`` calls it (and checks the checksum first when
    the handle verifies).

    Parameters
    ----------
    reader : Reader
        The open file.
    name : str
        The tensor's name.
    offsets : sequence or array of int
        Where each run starts, in bytes from the tensor's first byte.
    length : int
        The length of every run, in bytes; each run must lie inside the tensor.
    out : numpy.ndarray
        A C-contiguous, writable array of exactly ``len(offsets) * length``
        bytes; returned.

    Returns
    -------
    numpy.ndarray
        `out`.

    Raises
    ------
    TensorNotFoundError
        When the file has no tensor `name`.
    SafetensorIndexError
        When a run reaches outside the tensor.
    SafetensorTypeError
        When `offsets` are not integers, or `length` is not an integer.
    ValueError
        When `out` is not C-contiguous and writable, or holds another number
        of bytes.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst._core import read_runs
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"x": np.arange(12, dtype=np.int32).reshape(3, 4)}, path)
    >>> with fastst.safe_open(path, backend="pread") as f:     # column 1 and 2 of each row
    ...     read_runs(f, "x", [4, 20, 36], 8, np.empty((3, 2), np.int32)).tolist()
    [[1, 2], [5, 6], [9, 10]]
    """
