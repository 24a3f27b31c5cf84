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

from .._core import Reader, SafetensorError, WriteSpec
from .._io.files import PathLike, write_atomically
from .checksums import plan_with_checksums
from .torch_dtypes import CODE_OF_TORCH_NAME, PACKED_PAIRS

__all__ = ["TensorSpec", "deserialize", "serialize", "serialize_file"]

UINT64_MAX = (1 << 64) - 1


class TensorSpec:
    """One tensor for `serialize` and `serialize_file`, by a raw pointer to its bytes.

    The drop-in for ``safetensors.TensorSpec``, the reference's low-level API.

    UNSAFE, as in the reference: `data_ptr` is a raw address of `data_len`
    bytes that the caller must keep valid and unchanged until every
    ``serialize`` call using this spec has returned. A wrong address crashes
    the interpreter. A list of ``fastst.writer.WriteSpec`` holding the arrays
    themselves needs no pointer.

    Parameters
    ----------
    dtype : str
        A torch-style dtype name (``"float32"``, ``"bfloat16"``,
        ``"float4_e2m1fn_x2"``...), kept as its header code (``"F32"``).
    shape : sequence of int
        The header shape; for ``float4_e2m1fn_x2``, the storage shape (two
        values a byte), whose last axis is doubled, as the reference does.
    data_ptr : int
        The address of the tensor's bytes (C order, little-endian).
    data_len : int
        The number of bytes at `data_ptr`.

    Attributes
    ----------
    dtype : str
        The header dtype code, e.g. ``"F32"``.
    shape : list of int
        The header shape (for float4 pairs, the last axis doubled).
    data_ptr : int
        The raw address of the tensor's bytes.
    data_len : int
        The number of bytes at `data_ptr`.

    Raises
    ------
    SafetensorError
        When `dtype` is not a known name.
    TypeError
        When `dtype` is not a str or `shape` not a sequence.
    OverflowError
        When a dimension, `data_ptr` or `data_len` is negative or does not
        fit in 64 bits.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> array = np.arange(3, dtype=np.float32)
    >>> spec = fastst.TensorSpec(dtype="float32", shape=[3], data_ptr=array.ctypes.data,
    ...                          data_len=array.nbytes)
    >>> spec.dtype, spec.shape, spec.data_len
    ('F32', [3], 12)
    >>> fastst.load(fastst.serialize({"x": spec}))["x"]
    array([0., 1., 2.], dtype=float32)
    """

    __module__ = "fastst"

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
    """The bytes of a safetensors file holding the tensors described.

    The drop-in for ``safetensors.serialize``, through the same plan as every
    other writer: the bytes ``fastst.save`` gives for the same tensors.

    Parameters
    ----------
    tensor_dict : mapping of str to TensorSpec, or iterable of WriteSpec
        The tensors: by raw pointers (see `TensorSpec` and its warning), or as
        ``fastst.writer.WriteSpec`` holding their arrays.
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    header_padding : int, default 0
        Bytes of spaces reserved after the header, room for later metadata
        edits (``fastst.update_metadata``).
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata (see ``fastst.save``).

    Returns
    -------
    bytes
        The whole file.

    Raises
    ------
    TypeError
        When `tensor_dict` is neither a mapping of str to `TensorSpec` nor an
        iterable of specs.
    SafetensorError
        When a tensor's bytes are not what its dtype and shape need, a name
        is given twice, or a pointer is NULL with bytes to read.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> from fastst.writer import WriteSpec
    >>> data = fastst.serialize([WriteSpec("x", "I16", (2,), np.array([1, 2], np.int16))])
    >>> data == fastst.save({"x": np.array([1, 2], np.int16)})
    True
    """
    return plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding).to_bytes()


def serialize_file(tensor_dict: Union[Mapping[str, TensorSpec], Iterable[WriteSpec]],
                   filename: PathLike, metadata: Optional[Dict[str, str]] = None, *,
                   fsync: bool = False, header_padding: int = 0,
                   checksum: Optional[str] = None) -> None:
    """Write the tensors described to `filename`, atomically.

    The drop-in for ``safetensors.serialize_file``; the file is written as
    ``fastst.save_file`` writes it (beside the target, then renamed over it).

    Parameters
    ----------
    tensor_dict : mapping of str to TensorSpec, or iterable of WriteSpec
        The tensors (see `serialize`).
    filename : str or bytes or os.PathLike
        The file to write.
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk before returning.
    header_padding : int, default 0
        Bytes of spaces reserved after the header (see `serialize`).
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata.

    Raises
    ------
    SafetensorError
        When the file cannot be written (as the reference, with the `OSError`
        as its cause), or when the tensors are not valid (see `serialize`).
    TypeError
        When `tensor_dict` is not a mapping of str to `TensorSpec` nor an
        iterable of specs.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.writer import WriteSpec
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.serialize_file([WriteSpec("x", "U8", (3,), np.arange(3, dtype=np.uint8))], path)
    >>> fastst.load_file(path)["x"].tolist()
    [0, 1, 2]
    """
    plan = plan_with_checksums(_write_specs(tensor_dict), metadata, checksum,
                               header_padding=header_padding)
    try:
        write_atomically(plan, filename, fsync=fsync)
    except OSError as error:
        raise SafetensorError(f"{os.fsdecode(filename)}: cannot write: {error}") from error


def deserialize(bytes: Any) -> List[Tuple[str, Dict[str, Any]]]:
    """Every tensor of the bytes of a safetensors file, as names, dtype codes,
    shapes and bytes.

    The drop-in for ``safetensors.deserialize``. The header is validated in
    full first; each tensor's bytes are copied.

    Parameters
    ----------
    bytes : bytes-like object
        The whole file (bytes, bytearray, memoryview, mmap).

    Returns
    -------
    list of (str, dict)
        In buffer order, ``(name, {"dtype": code, "shape": [...], "data":
        bytearray})``.

    Raises
    ------
    SafetensorError
        When the bytes break a rule of the format.

    Examples
    --------
    >>> import numpy as np, fastst
    >>> fastst.deserialize(fastst.save({"x": np.array([104, 105], np.uint8)}))
    [('x', {'dtype': 'U8', 'shape': [2], 'data': bytearray(b'hi')})]
    """
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
