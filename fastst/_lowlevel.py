"""The reference's low-level API, as ``safetensors`` has it: ``TensorSpec`` (raw
pointers and all), ``serialize``, ``serialize_file`` and ``deserialize``. Each takes
a list of ``WriteSpec`` too, which needs no pointer, and writes through the same
plan and output loop as every other writer: byte-identical to ``save_file``.
"""
from __future__ import annotations

import operator
import os
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ._checksums import plan_with_checksums
from ._core import Reader, SafetensorError, WriteSpec
from ._files import PathLike, write_atomically
from ._torch_dtypes import CODE_OF_TORCH_NAME, PACKED_PAIRS

__all__ = ["TensorSpec", "deserialize", "serialize", "serialize_file"]

UINT64_MAX = (1 << 64) - 1


class TensorSpec:
    """One tensor for ``serialize`` / ``serialize_file``, as ``safetensors.TensorSpec``.

    ``TensorSpec(*, dtype, shape, data_ptr, data_len)``: `dtype` is a torch-style
    name ("float32", "bfloat16", "float4_e2m1fn_x2") and is kept as its header code
    ("F32"); `shape` is the header shape, except for ``float4_e2m1fn_x2``, whose
    storage shape (two values a byte) has its last axis doubled, as the reference does.

    UNSAFE, as in the reference: `data_ptr` is a raw address of `data_len` bytes that
    the caller must keep valid and unchanged until every ``serialize`` call using
    this spec has returned. A wrong address crashes the interpreter. A list of
    ``WriteSpec`` holding the arrays themselves needs no pointer.
    """

    __slots__ = ("_dtype", "_shape", "_data_ptr", "_data_len")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int,
                 data_len: int) -> None:
        if type(dtype) is not str:
            raise TypeError(f"argument 'dtype': {type(dtype).__name__!r} object is not an "
                            f"instance of 'str'")
        dims = _unsigned_dims(shape)
        self._data_ptr = _unsigned("data_ptr", data_ptr)
        self._data_len = _unsigned("data_len", data_len)
        code = CODE_OF_TORCH_NAME.get(dtype)
        if code is None:
            raise SafetensorError(f"Unknown dtype {dtype!r}. Supported dtypes: "
                                  f"{', '.join(CODE_OF_TORCH_NAME)}")
        if code in PACKED_PAIRS and dims:
            dims[-1] = _unsigned("shape", dims[-1] * 2)
        self._dtype, self._shape = code, dims

    dtype = property(operator.attrgetter("_dtype"),
                     doc='The header dtype code, e.g. ``"F32"`` (str).')
    data_ptr = property(operator.attrgetter("_data_ptr"),
                        doc="The raw address of the tensor's bytes (int).")
    data_len = property(operator.attrgetter("_data_len"),
                        doc="The number of bytes at `data_ptr` (int).")

    @property
    def shape(self) -> List[int]:
        """The header shape (for float4 pairs, the last axis doubled)."""
        return list(self._shape)

    def __repr__(self) -> str:
        return (f"TensorSpec(dtype={self._dtype!r}, shape={self._shape!r}, "
                f"data_ptr={self._data_ptr}, data_len={self._data_len})")


def _unsigned(what: str, value: Any) -> int:
    number = operator.index(value)
    if number < 0:
        raise OverflowError(f"argument {what!r}: can't convert negative int to unsigned")
    if number > UINT64_MAX:
        raise OverflowError(f"argument {what!r}: int too big to convert")
    return number


def _unsigned_dims(shape: Any) -> List[int]:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__len__"):
        raise TypeError(f"argument 'shape': {type(shape).__name__!r} object is not a "
                        f"sequence of integers")
    return [_unsigned("shape", dim) for dim in shape]


def serialize(tensor_dict: Union[Mapping[str, TensorSpec], Iterable[WriteSpec]],
              metadata: Optional[Dict[str, str]] = None, *, header_padding: int = 0,
              checksum: Optional[str] = None) -> bytes:
    """The bytes of a safetensors file holding the tensors described, as
    ``safetensors.serialize``: `tensor_dict` maps names to ``TensorSpec`` (raw
    pointers, see its warning), or is a list of ``WriteSpec`` (arrays).
    `header_padding` reserves room for later metadata edits (``update_metadata``);
    `checksum` is that of ``fastst.save``."""
    return plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding).to_bytes()


def serialize_file(tensor_dict: Union[Mapping[str, TensorSpec], Iterable[WriteSpec]],
                   filename: PathLike, metadata: Optional[Dict[str, str]] = None, *,
                   fsync: bool = False, header_padding: int = 0,
                   checksum: Optional[str] = None) -> None:
    """Write the tensors described to `filename`, atomically (see ``save_file``),
    as ``safetensors.serialize_file``. A failure to write is a SafetensorError, as
    there, with the OSError as its cause. `header_padding` reserves room for later
    metadata edits (``update_metadata``); `checksum` is that of ``fastst.save``."""
    plan = plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding)
    try:
        write_atomically(plan, filename, fsync=fsync)
    except OSError as error:
        raise SafetensorError(f"{os.fsdecode(filename)}: cannot write: {error}") from error


def deserialize(bytes: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """Every tensor of a safetensors buffer, in buffer order, as
    ``[(name, {"dtype": code, "shape": [...], "data": bytearray}), ...]``, as
    ``safetensors.deserialize``. The header is validated in full first."""
    reader = Reader()
    reader.open_buffer(bytes)
    try:
        data, start = memoryview(bytes).cast("B"), reader.data_start
        out = []
        for name in reader.offset_keys():
            info = reader.info(name)
            begin, end = info.data_offsets
            out.append((name, {"dtype": info.dtype, "shape": info.shape,
                               "data": bytearray(data[start + begin:start + end])}))
        return out
    finally:
        reader.close()


def _write_specs(tensor_dict: Any) -> List[WriteSpec]:
    if not isinstance(tensor_dict, Mapping):
        if isinstance(tensor_dict, (str, bytes)) or not hasattr(tensor_dict, "__iter__"):
            raise TypeError(f"tensor_dict must be a dict of str to TensorSpec, got "
                            f"{type(tensor_dict).__name__}")
        return list(tensor_dict)
    specs = []
    for name, spec in tensor_dict.items():
        if type(name) is not str:
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"tensor {name!r}: expected a fastst.TensorSpec, got "
                            f"{type(spec).__name__}")
        specs.append(WriteSpec(name, spec.dtype, spec.shape,
                               _bytes_at(name, spec.data_ptr, spec.data_len)))
    return specs


def _bytes_at(name: str, address: int, length: int) -> np.ndarray:
    """The `length` bytes at a raw address, as a uint8 array (not copied)."""
    if length == 0:
        return np.empty(0, np.uint8)
    if address == 0:
        raise SafetensorError(f"tensor {name!r}: data_ptr is NULL but data_len is {length}")
    import ctypes
    return np.frombuffer(memoryview((ctypes.c_char * length).from_address(address)).cast("B"),
                         dtype=np.uint8)
