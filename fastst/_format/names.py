"""How a sharded checkpoint is named and found: the rules by which ``safe_open``
decides that a path is a checkpoint (a folder, or an ``*.index.json``), apart from
the index itself (``index``), which a first open of a single file does not need.
"""
from __future__ import annotations

import os
from typing import Any

from .._io.source import Source, as_source

__all__ = ["DEFAULT_PATTERN", "INDEX_SUFFIX", "is_checkpoint", "is_checkpoint_path",
           "is_index_name"]

DEFAULT_PATTERN = "model{suffix}.safetensors"
"""The names of a checkpoint's files saved into a directory: ``{suffix}`` is
``-00001-of-00003`` for a shard, empty for the one file of a checkpoint that fits in
one shard (``model.safetensors``); the index is this name plus `INDEX_SUFFIX`."""
INDEX_SUFFIX = ".index.json"
"""What the name of a checkpoint's index ends with: a file whose name ends so is opened
as a sharded checkpoint (``model.safetensors.index.json``)."""


def is_index_name(name: str) -> bool:
    """Whether a file called `name` is taken for a checkpoint's index."""
    return name.endswith(INDEX_SUFFIX)


def is_checkpoint(source: Source) -> bool:
    """Whether `source` is a sharded checkpoint: a folder, or an ``*.index.json``.

    Parameters
    ----------
    source : Source
        Where the bytes are, as ``fastst._io.source.as_source`` makes it from a
        path, a URL or a file object (`is_checkpoint_path` takes those).

    Returns
    -------
    bool

    Examples
    --------
    >>> import tempfile
    >>> from fastst._io.source import as_source
    >>> from fastst._format.names import is_checkpoint
    >>> is_checkpoint(as_source(tempfile.mkdtemp())), is_checkpoint(as_source("model.safetensors"))
    (True, False)
    """
    return source.is_directory() or is_index_name(source.name)


def is_checkpoint_path(filename: Any) -> bool:
    """Whether `filename` names a sharded checkpoint: a directory, an
    ``*.index.json``, or the URL of an index.

    Parameters
    ----------
    filename : object
        A path or a URL; anything else (a file object) is not a checkpoint.

    Returns
    -------
    bool
        What ``safe_open`` decides: True opens a `ShardedHandle` (or, for a
        directory holding one unsharded file, that file's handle).

    Examples
    --------
    >>> import tempfile
    >>> from fastst.checkpoint import is_checkpoint_path
    >>> is_checkpoint_path("model.safetensors.index.json"), is_checkpoint_path("model.safetensors")
    (True, False)
    >>> is_checkpoint_path(tempfile.mkdtemp())
    True
    """
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    return is_checkpoint(as_source(filename))
