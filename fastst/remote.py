"""File objects and URLs as safetensors files: the header first, then only the byte
ranges asked for, and uploads of whole files to URLs.

The knobs users set, and the parts they use, of the reading and writing that
``fastst._io`` does for a binary file object or a URL (``s3://``, ``gs://``,
``http(s)://``, ``memory://``...); nothing here is imported by ``import fastst``. A URL is read by one of two transports (`open_object`
chooses): ``http(s)://`` by fastst's own HTTP client (``fastst._io.http``: the standard
library's ``http.client`` in threads, each part read from its socket straight into
its array), every other URL, and an ``http(s)://`` one whose ``storage_options`` only
fsspec takes, through fsspec (with s3fs or aiohttp behind it), imported only when
such a URL is opened. The compiled Reader does the rest (``Reader.open_ranges``): it
reads the prefix and header in one request (two for a header over 64 KiB), coalesces
the byte ranges of neighbouring tensors, cuts big ones into parts fetched in
parallel, and checks that every range came back whole.

A URL is read with a precondition where the store has one: S3 reads carry
``If-Match: <ETag>`` (through s3fs) and HTTP reads the ``If-Match`` header, so an
object replaced after it was opened gives a ``SafetensorError``, never a mix of two
versions. A store may ignore it, or ignore the range: each S3 and HTTP answer is
also held to what it says of itself (status 206, its Content-Range, ETag and
Last-Modified against the object seen at opening), and its body is read in pieces,
never past the bytes asked for (``fastst._io.ranged.checked_answer``). Other stores
are checked for length (and to answer with bytes) only; every store's calls are
bounded by their deadline.

Examples
--------
Any fsspec URL is read and written as a path is (``memory://`` needs no server):

>>> import numpy as np, fastst, fsspec
>>> fastst.save_file({"x": np.arange(4, dtype=np.int8)}, "memory://docs/x.safetensors")
>>> with fastst.safe_open("memory://docs/x.safetensors") as f:
...     f.backend, f.get_slice("x")[1:3].tolist()
('ranges', [1, 2])
>>> fsspec.filesystem("memory").rm("/docs", recursive=True)
"""
import sys
import types

from ._io import limits
from ._io.fileobj import FileObjectRanges
from ._io.fsspec import UrlRanges, with_default_timeouts
from ._io.limits import (CONNECT_TIMEOUT, MAX_REQUESTS, MAX_WHOLE_READ, PART_SIZE, READ_TIMEOUT,
                         START_REQUESTS)
from ._io.ranged import Pace
from ._io.transports import open_object, read_object
from ._io.upload import SpooledUpload, save_plan

__all__ = ["CONNECT_TIMEOUT", "MAX_REQUESTS", "MAX_WHOLE_READ", "PART_SIZE", "READ_TIMEOUT",
           "START_REQUESTS", "FileObjectRanges", "Pace", "SpooledUpload", "UrlRanges",
           "open_object", "read_object", "save_plan", "with_default_timeouts"]

# the public names whose home is _io/limits: set here, set there
KNOBS = frozenset(name for name in __all__ if hasattr(limits, name))


class _Face(types.ModuleType):
    """This module, whose knobs, when set, are set where every read looks them up."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in KNOBS:
            setattr(limits, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
