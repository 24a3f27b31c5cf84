"""The header: its size limit, what it says of a tensor, and what a file is when it is no safetensors file."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

DEFAULT_MAX_HEADER_SIZE: Final[int]
"""The largest header a reader accepts unless ``max_header_size`` says otherwise, in
bytes (100,000,000: 100 MB, as the reference's limit).

A file whose 8-byte prefix announces a longer header is refused with a
`SafetensorError` before anything more is read.

Examples
--------
>>> import fastst
>>> fastst.DEFAULT_MAX_HEADER_SIZE
100000000
"""

class TensorInfo(NamedTuple):
    """What a file's header says of one tensor, as ``info(name)`` gives it.

    A named tuple of the tensor's dtype code, its shape, its byte range in the
    tensor data, and the shape of the NumPy array it loads as.

    Attributes
    ----------
    dtype : str
        The header dtype code, e.g. ``"F32"`` (see `DTYPE_CODES`).
    shape : list of int
        The shape the header gives.
    data_offsets : tuple of (int, int)
        The tensor's bytes, ``[begin, end)``, counted from the start of the
        tensor data (which starts after the 8-byte prefix and the header).
    array_shape : tuple of int or None
        The shape of the NumPy array it loads as: `shape`, except for the
        sub-byte dtypes (F4, F6_*), whose packed bytes load as ``uint8`` with
        the last axis shrunk (or flat when the last axis does not hold whole
        bytes). None when NumPy cannot hold the shape (more than 64 axes, or a
        dimension or size past what an index of this platform reaches).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"w": np.zeros((2, 3), np.float32)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     info = f.info("w")
    >>> info
    TensorInfo(dtype='F32', shape=[2, 3], data_offsets=(0, 24), array_shape=(2, 3))
    >>> info.data_offsets[1] - info.data_offsets[0]
    24
    """
    dtype: str
    shape: list[int]
    data_offsets: tuple[int, int]
    array_shape: tuple[int, ...] | None

def foreign_format(head: Buffer, /) -> str | None:
    """What the first bytes of a file say it is, when its length prefix is no
    length (``"it is a NumPy .npy file"``, ``"it is text"``...): the rest of the
    message "not a safetensors file: ...", which every way of opening a file gives
    for one whose prefix is wrong; None when they do not tell.

    Looks at the first 64 bytes at most: a NumPy ``.npy`` file, a zip archive
    (``.npz``, ``.pt``), HDF5, GGUF, a pickle, gzip or zstd data, an HTML page,
    a Git LFS pointer, JSON or other text. A real safetensors file may begin
    as one of these binary formats does (a prefix of 0x480 begins as a pickle
    does): ask only of a file whose prefix was found wrong; and a JSON header
    that begins after the prefix is taken for one (None: a file cut short).

    Examples
    --------
    >>> import io, numpy as np
    >>> from fastst._core import foreign_format
    >>> npy = io.BytesIO()
    >>> np.save(npy, np.zeros(3))
    >>> foreign_format(npy.getvalue())
    'it is a NumPy .npy file'
    >>> foreign_format(b"<!DOCTYPE html><html><body>Index of /</body></html>")
    'it is an HTML page (a web page or a folder listing, not the file itself)'
    >>> import fastst
    >>> foreign_format(fastst.save({"x": np.zeros(2)})) is None   # a header follows
    True
    """
