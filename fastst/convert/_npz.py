"""NumPy's ``.npy`` and ``.npz`` files -> declared tensors, read without pickle:
each array's dtype and shape come from its ``.npy`` header, checked against the
bytes the file (or the archive member) holds before anything is written. Its
bytes are read a chunk at a time when it is written: a ``.npy`` file and a
stored ``.npz`` member are mapped, a compressed member is decompressed as it is
read (a Fortran-ordered one is read whole: its C order is not a stream)."""
from __future__ import annotations

import contextlib
import io
import os
import tokenize
import zipfile
from typing import Any, Callable, Iterator, List, Tuple

import numpy as np

from .._core import SafetensorError, spec_of_array
from ._output import TensorToWrite
from ._torch import c_order_blocks
from ._torch_files import PIECE_BYTES, ZIP_ERRORS, check_members

__all__ = ["declared_arrays", "NPY_NAME"]

NPY_NAME = "array"      # the tensor a lone .npy file becomes
NPY_MAGIC = b"\x93NUMPY"
NPY_VERSIONS = ((1, 0), (2, 0), (3, 0))
NPY_MAX_HEADER = 10_000     # what NumPy reads by default (max_header_size)

Header = Tuple[Tuple[int, ...], bool, np.dtype]
# What NumPy's parser of a .npy header raises on a malformed one (the tokenizer it
# runs first lets TokenError through).
HEADER_ERRORS = (ValueError, SyntaxError, TypeError, tokenize.TokenError, RecursionError)


def _header(fp: Any, source: str) -> Header:
    """The shape, order and dtype of the .npy header at the start of `fp`, its
    length checked before it is read (NumPy reads the length a header declares,
    up to 4 GiB, before it compares it with its own bound)."""
    prefix = fp.read(len(NPY_MAGIC) + 2)
    version = tuple(prefix[len(NPY_MAGIC):])
    if prefix[:len(NPY_MAGIC)] != NPY_MAGIC or version not in NPY_VERSIONS:
        raise SafetensorError(f"{source}: not a .npy file of version 1, 2 or 3 (it starts "
                              f"with {prefix!r})")
    field = fp.read(2 if version == (1, 0) else 4)
    length = int.from_bytes(field, "little")
    if len(field) not in (2, 4) or length > NPY_MAX_HEADER:
        raise SafetensorError(f"{source}: a .npy header of {length} bytes (at most "
                              f"{NPY_MAX_HEADER} are read)")
    header = io.BytesIO(field + fp.read(length))
    try:
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(header)
        return np.lib.format.read_array_header_2_0(header)
    except HEADER_ERRORS as error:
        raise SafetensorError(f"{source}: not a readable .npy header ({type(error).__name__}: "
                              f"{error})") from None


def _code(name: str, dtype: np.dtype, source: str) -> str:
    if dtype.hasobject:
        raise SafetensorError(f"{source}: array {name!r} holds Python objects, which only "
                              f"pickle can read: refused")
    try:
        return spec_of_array(name, np.empty(0, dtype.newbyteorder("<"))).dtype
    except TypeError as error:
        raise SafetensorError(f"{source}: array {name!r}: {error}") from None


def _nbytes(header: Header) -> int:
    shape, _, dtype = header
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize


def _little(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _blocks(array: np.ndarray) -> Iterator[memoryview]:
    """The bytes of `array` in C order, little-endian, a chunk at a time."""
    for block in c_order_blocks(array, PIECE_BYTES):
        compact = np.ascontiguousarray(block.astype(_little(array.dtype), copy=False))
        yield compact.reshape(-1).view(np.uint8).data


def _stream(read: Callable[[int], bytes], header: Header, what: str) -> Iterator[memoryview]:
    """The bytes of a C-ordered array read from a stream, a chunk at a time."""
    dtype = header[2]
    step = max(PIECE_BYTES - PIECE_BYTES % dtype.itemsize, dtype.itemsize)
    left = _nbytes(header)
    while left:
        data = read(min(step, left))
        if len(data) != min(step, left):
            raise SafetensorError(f"{what} ends {left - len(data)} bytes before the end of the "
                                  f"array its header declares")
        if dtype.byteorder == ">":
            data = np.frombuffer(data, dtype).astype(_little(dtype)).tobytes()
        yield memoryview(data)
        left -= len(data)


def _declared(name: str, header: Header, source: str, origin: str,
              chunks: Callable[[], Iterator[memoryview]]) -> TensorToWrite:
    shape, _, dtype = header
    return TensorToWrite(name, _code(name, dtype, source), tuple(shape), _nbytes(header), chunks,
                    f"shape {list(shape)}, dtype {dtype.str}, {origin}")


def _mapped(path: str, offset: int, header: Header) -> np.ndarray:
    shape, fortran, dtype = header
    if not _nbytes(header):
        return np.empty(shape, dtype)
    return np.memmap(path, dtype, "r", offset, tuple(shape), "F" if fortran else "C")


@contextlib.contextmanager
def declared_arrays(source: str) -> Iterator[List[TensorToWrite]]:
    """The arrays of the ``.npy`` or ``.npz`` file `source` as TensorToWrite tensors,
    readable while the context lasts."""
    with open(source, "rb") as fh:
        is_npy = fh.read(len(NPY_MAGIC)) == NPY_MAGIC
    if is_npy:
        yield [_npy(source)]
        return
    try:
        archive = zipfile.ZipFile(source)
    except ZIP_ERRORS as error:
        raise SafetensorError(f"{source}: neither a .npy file nor a readable zip archive "
                              f"({error})") from None
    with archive:
        infos = archive.infolist()
        starts = check_members(archive.fp.fileno(), infos, source)  # type: ignore[union-attr]
        yield [_member(archive, info, starts[info.filename], source) for info in infos]


def _npy(source: str) -> TensorToWrite:
    with open(source, "rb") as fh:
        header = _header(fh, source)
        offset = fh.tell()
        size = os.fstat(fh.fileno()).st_size
    _code(NPY_NAME, header[2], source)
    if offset + _nbytes(header) > size:
        raise SafetensorError(f"{source}: its header declares {_nbytes(header)} bytes of "
                              f"array from byte {offset}, past the end of the {size}-byte file")
    return _declared(NPY_NAME, header, source, f"{size} bytes in the file",
                     lambda: _blocks(_mapped(source, offset, header)))


def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, start: int,
            source: str) -> TensorToWrite:
    """Member `info` of the .npz `archive` (its data at byte `start`), its header
    read and its size checked against the one its entry declares."""
    what = f"{source}: member {info.filename!r}"
    if not info.filename.endswith(".npy"):
        raise SafetensorError(f"{what} is not a .npy file")
    name = info.filename[:-4]
    try:
        with archive.open(info) as member:
            header = _header(member, what)
            offset = member.tell()
    except ZIP_ERRORS as error:
        raise SafetensorError(f"{what} cannot be read ({type(error).__name__}: {error})"
                              ) from None
    _code(name, header[2], source)
    if info.file_size != offset + _nbytes(header):
        raise SafetensorError(f"{what} holds {info.file_size} bytes, but its header declares "
                              f"{offset} and {_nbytes(header)} bytes of array")
    origin = f"{info.compress_size} bytes in the archive"
    if info.compress_type == zipfile.ZIP_STORED:
        return _declared(name, header, source, origin,
                         lambda: _blocks(_mapped(source, start + offset, header)))
    return _declared(name, header, source, origin,
                     lambda: _member_chunks(archive, info, offset, header, what))


def _member_chunks(archive: zipfile.ZipFile, info: zipfile.ZipInfo, offset: int,
                   header: Header, what: str) -> Iterator[memoryview]:
    try:
        with archive.open(info) as member:
            member.seek(offset)
            if header[1]:       # Fortran order: the whole array, then its C order
                data = member.read(_nbytes(header))
                if len(data) != _nbytes(header):
                    raise SafetensorError(f"{what} ends early")
                shape, _, dtype = header
                yield from _blocks(np.frombuffer(data, dtype).reshape(shape, order="F"))
            else:
                yield from _stream(member.read, header, what)
    except ZIP_ERRORS as error:
        raise SafetensorError(f"{what} cannot be read ({type(error).__name__}: {error})"
                              ) from None
