"""NumPy's ``.npy`` and ``.npz`` files -> declared tensors, read without pickle:
each array's dtype and shape come from its ``.npy`` header, its bytes when it is
written (one array in memory at a time; a ``.npy`` file is mapped)."""
from __future__ import annotations

import contextlib
import zipfile
from typing import Any, Iterator, List, Tuple

import numpy as np

from .. import SafetensorError
from ..writer import spec_of_array
from ._output import Declared
from ._torch_files import CHUNK

__all__ = ["declared_arrays", "NPY_NAME"]

NPY_NAME = "array"      # the tensor a lone .npy file becomes


def _header(fp: Any, source: str) -> Tuple[Tuple[int, ...], bool, np.dtype]:
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(fp)
        return np.lib.format.read_array_header_2_0(fp)
    except ValueError as error:
        raise SafetensorError(f"{source}: not a readable .npy header ({error})") from None


def _code(name: str, dtype: np.dtype, source: str) -> str:
    if dtype.hasobject:
        raise SafetensorError(f"{source}: array {name!r} holds Python objects, which only "
                              f"pickle can read: refused")
    try:
        return spec_of_array(name, np.empty(0, dtype.newbyteorder("<"))).dtype
    except TypeError as error:
        raise SafetensorError(f"{source}: array {name!r}: {error}") from None


def _in_c_order(array: np.ndarray) -> np.ndarray:
    little = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    return np.ascontiguousarray(array.astype(little, copy=False))


def _declared(name: str, shape: Tuple[int, ...], dtype: np.dtype, source: str,
              load: Any) -> Declared:
    code = _code(name, dtype, source)
    count = 1
    for dim in shape:
        count *= dim

    def chunks() -> Iterator[memoryview]:
        flat = _in_c_order(load()).reshape(-1).view(np.uint8)
        for position in range(0, flat.size, CHUNK):
            yield flat[position:position + CHUNK].data

    return Declared(name, code, tuple(shape), count * dtype.itemsize, chunks)


@contextlib.contextmanager
def declared_arrays(source: str) -> Iterator[List[Declared]]:
    """The arrays of the ``.npy`` or ``.npz`` file `source` as Declared tensors,
    readable while the context lasts."""
    with open(source, "rb") as fh:
        is_npy = fh.read(6) == b"\x93NUMPY"
    if is_npy:
        with open(source, "rb") as fh:
            shape, _, dtype = _header(fh, source)

        def load() -> np.ndarray:
            mapped: np.ndarray = np.load(source, mmap_mode="r", allow_pickle=False)
            return mapped

        yield [_declared(NPY_NAME, shape, dtype, source, load)]
        return
    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as error:
        raise SafetensorError(f"{source}: neither a .npy file nor a zip archive ({error})"
                              ) from None
    with archive:
        declared = []
        for info in archive.infolist():
            if not info.filename.endswith(".npy"):
                raise SafetensorError(f"{source}: member {info.filename!r} is not a .npy file")
            with archive.open(info) as member:
                shape, _, dtype = _header(member, source)
            declared.append(_declared(info.filename[:-4], shape, dtype, source,
                                      _member_loader(archive, info, source)))
        yield declared


def _member_loader(archive: zipfile.ZipFile, info: zipfile.ZipInfo, source: str) -> Any:
    def load() -> np.ndarray:
        with archive.open(info) as member:
            try:
                array: np.ndarray = np.lib.format.read_array(member, allow_pickle=False)
                return array
            except ValueError as error:
                raise SafetensorError(f"{source}: member {info.filename!r}: {error}") from None
    return load

