"""Editing a file's ``__metadata__``: in place when the new header fits the old
one's room (``header_padding`` reserves it), else by an atomic rewrite that copies
the tensor bytes in bounded memory.
"""
from __future__ import annotations

import os
from typing import List, Mapping, Optional

from .._core import (ALIGNED_HEADER_SPACES, MAX_ALIGN, Reader, SafetensorError, WritePlan,
                     WriteSpec, plan_write)
from .._format.checksums import CHECKSUM_KEY
from .._frameworks.specs import specs_of
from .._io.files import AtomicFile, PathLike, copy_range

__all__ = ["update_metadata"]


def update_metadata(filename: PathLike, metadata: Optional[Mapping[str, str]], *,
                    fsync: bool = False, header_padding: int = 0, in_place: bool = True) -> bool:
    """Replace the ``__metadata__`` of a safetensors file, without rewriting its
    tensors when the new header fits.

    When the new header, with `header_padding` bytes to spare, fits in the old
    header's room (a header may end in spaces, which ``header_padding`` on the
    writers reserves), only the header bytes are rewritten, in place: the
    tensors are not touched. Otherwise the file is rewritten atomically: the
    new header with `header_padding` spaces of room for later edits, then the
    tensor bytes copied in bounded memory.

    A file saved with ``align=`` stays aligned: its header ends in 8 spaces
    or more (the format's layout leaves fewer), an edit in place keeps 8 of
    them, and a rewrite starts the data at a multiple of the largest power of
    two (up to 1 MiB) that the old data start was. Other files are rewritten
    as ``save`` writes them.

    An in-place edit is one write of the header bytes, not atomic: a reader,
    or a crash, in the middle of it may see a header part old, part new. Where
    that matters, pass ``in_place=False`` for an atomic rewrite.

    The tensors' checksums (``fastst.integrity``), which describe bytes the
    edit does not change, are kept unless `metadata` gives that key itself.

    Parameters
    ----------
    filename : str or bytes or os.PathLike
        A local safetensors file.
    metadata : mapping of str to str or None
        The new ``__metadata__``, replacing the old one whole; None removes it.
    fsync : bool, default False
        Flush the edit to disk before returning.
    header_padding : int, default 0
        Bytes of room to keep after the new header: an edit that cannot keep
        them is a rewrite, which reserves them for the next edit.
    in_place : bool, default True
        Allow an in-place edit; False always rewrites the file atomically.

    Returns
    -------
    bool
        True when the edit was made in place, False when the file was
        rewritten.

    Raises
    ------
    FileNotFoundError
        When the file does not exist.
    SafetensorError
        When the file breaks a rule of the format, or changed while it was
        being edited.
    TypeError
        When a metadata key or value is not a str.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> fastst.save_file({"w": np.zeros(4)}, path, header_padding=128)
    >>> fastst.update_metadata(path, {"epoch": "7"})           # in the room reserved
    True
    >>> fastst.update_metadata(path, {"notes": "x" * 1000})    # too long: a rewrite
    False
    >>> with fastst.safe_open(path) as f:
    ...     f.metadata()["notes"][:3], f.get_tensor("w").tolist()
    ('xxx', [0.0, 0.0, 0.0, 0.0])
    """
    reader = Reader()
    reader.open_file(filename, "pread")
    try:
        metadata = _keeping_checksums(reader.metadata(), metadata)
        specs = specs_of(reader)
        old_room = reader.data_start - 8
        align = _alignment_kept(filename, reader.data_start)
        plan = plan_write(specs, metadata, keep_order=True)
        _check_same_layout(reader, plan, specs)
        room = max(header_padding, ALIGNED_HEADER_SPACES) if align else header_padding
        if in_place and len(plan.prefix.rstrip(b" ")) - 8 + room <= old_room:
            _rewrite_header(plan_write(specs, metadata, keep_order=True, header_size=old_room),
                            filename, fsync)
            return True
        plan = plan_write(specs, metadata, keep_order=True, header_padding=header_padding,
                          align=align)
        _rewrite_file(plan, reader, filename, fsync)
        return False
    finally:
        reader.close()


def _alignment_kept(filename: PathLike, data_start: int) -> int:
    """The alignment a rewrite of the file keeps: for a header that ends in
    ALIGNED_HEADER_SPACES spaces or more, as an aligned file's does, the largest power
    of two above 8, up to MAX_ALIGN, that divides its data start; else 0."""
    alignment = min(data_start & -data_start, MAX_ALIGN)
    if alignment <= 8 or data_start - 8 < ALIGNED_HEADER_SPACES:
        return 0
    with open(filename, "rb") as file:
        file.seek(data_start - ALIGNED_HEADER_SPACES)
        tail = file.read(ALIGNED_HEADER_SPACES)
    return alignment if tail == b" " * ALIGNED_HEADER_SPACES else 0


def _keeping_checksums(old: Optional[Mapping[str, str]],
                       new: Optional[Mapping[str, str]]) -> Optional[Mapping[str, str]]:
    if old is None or CHECKSUM_KEY not in old or (new is not None and CHECKSUM_KEY in new):
        return new
    return {**(new or {}), CHECKSUM_KEY: old[CHECKSUM_KEY]}


def _check_same_layout(reader: Reader, plan: WritePlan, specs: List[WriteSpec]) -> None:
    for spec in specs:
        if plan.info(spec.name).data_offsets != reader.info(spec.name).data_offsets:
            raise SafetensorError(f"{reader.source}: tensor {spec.name!r}: its bytes are not "
                                  f"where a rewritten header would place them")


def _rewrite_header(plan: WritePlan, filename: PathLike, fsync: bool) -> None:
    fd = os.open(filename, os.O_WRONLY | os.O_CLOEXEC)
    try:
        plan.write_prefix(fd, os.fsdecode(filename))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _rewrite_file(plan: WritePlan, reader: Reader, filename: PathLike, fsync: bool) -> None:
    data_size = plan.total_size - plan.data_start
    file = AtomicFile(filename, plan.total_size)
    try:
        plan.write_prefix(file.fd, file.target)
        source = os.open(filename, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(source).st_size != reader.data_start + data_size:
                raise SafetensorError(f"{reader.source}: the file changed while its "
                                      f"metadata was being edited")
            copy_range(source, reader.data_start, file.fd, plan.data_start, data_size)
        finally:
            os.close(source)
    except BaseException:
        file.abort()
        raise
    file.commit(fsync=fsync)
