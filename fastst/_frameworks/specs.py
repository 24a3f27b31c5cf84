"""Any value a writer takes, as what the write plan needs: a ``WriteSpec`` (name,
header dtype code, shape, and a NumPy array of the bytes) for a whole tensor, or a
NumPy array for a piece of one. NumPy arrays, scalars and buffers are taken as they
are; a framework's tensors through its adapter (``fastst._frameworks.registry``): the same
registry that reading uses, so nothing here asks which frameworks are imported.
"""
from __future__ import annotations

from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._core import DTYPES, SafetensorTypeError, WriteSpec, spec_of_array
from .._format.torch_dtypes import CODE_OF_TORCH_NAME, PACKED_PAIRS
from .registry import tensor_adapter

__all__ = ["Declared", "declared_specs", "is_tensor", "piece_of", "spec_of", "specs_of"]

# every tensor of a file, declared as a mapping name -> (dtype, shape), or as
# (name, dtype, shape) triples
Declared = Union[Mapping[str, Tuple[Any, Sequence[int]]], Iterable[Tuple[str, Any, Sequence[int]]]]
# NumPy dtype name -> header code: NumPy knows ml_dtypes' names only once it is imported
CODE_OF_NUMPY_NAME = {row.numpy: row.code for row in DTYPES if row.bits >= 8}


def spec_of(name: str, value: Any) -> WriteSpec:
    """The WriteSpec that writes `value` whole as tensor `name`: a NumPy array or
    scalar, a framework's tensor (through its adapter), or anything NumPy can view
    (a JAX array, a buffer)."""
    adapter = tensor_adapter(value)
    if adapter is not None:
        spec: WriteSpec = adapter.spec_of_tensor(name, value)
        return spec
    return spec_of_array(name, np.asarray(value))


def is_tensor(value: Any) -> bool:
    """Whether `value` is an array a writer takes whole: NumPy's, a framework's, or
    anything with a dtype and a shape that NumPy can view."""
    if isinstance(value, (np.ndarray, np.generic)) or tensor_adapter(value) is not None:
        return True
    return hasattr(value, "__array__") and hasattr(value, "dtype") and hasattr(value, "shape")


def declared_specs(specs: Declared) -> List[WriteSpec]:
    """The `WriteSpec` of each tensor declared, without data: what a streaming
    writer needs before its first byte.

    Parameters
    ----------
    specs : mapping or iterable
        A mapping ``name -> (dtype, shape)``, or ``(name, dtype, shape)``
        triples (``WriteSpec`` too). A dtype is a header code (``"F32"``), a
        NumPy dtype (ml_dtypes' included), or a torch dtype; for
        ``torch.float4_e2m1fn_x2`` the shape is torch's, whose last axis
        holds two values a byte.

    Returns
    -------
    list of WriteSpec
        In the order given, each with ``data=None``.

    Raises
    ------
    SafetensorTypeError
        When an item is not ``(dtype, shape)`` or ``(name, dtype, shape)``, or
        a dtype has no safetensors code.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.writer import declared_specs
    >>> declared_specs({"x": (np.float16, (2, 3)), "y": ("BF16", [4])})
    [WriteSpec(name='x', dtype='F16', shape=(2, 3), data=None), WriteSpec(name='y', dtype='BF16', shape=[4], data=None)]
    """
    items = specs.items() if isinstance(specs, Mapping) else specs
    declared = []
    for item in items:
        if isinstance(specs, Mapping):
            name, (dtype, shape) = item[0], _pair(item)
        else:
            name, dtype, shape = _triple(item)
        code, shape = _code_and_shape(name, dtype, shape)
        declared.append(WriteSpec(name, code, shape, None))
    return declared


def _pair(item: Any) -> Tuple[Any, Any]:
    try:
        dtype, shape = item[1]
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"tensor {item[0]!r}: declare it as (dtype, shape), got "
                                  f"{type(item[1]).__name__}") from None
    return dtype, shape


def _triple(item: Any) -> Tuple[Any, Any, Any]:
    if isinstance(item, WriteSpec):
        return item.name, item.dtype, item.shape
    try:
        name, dtype, shape = item
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"declare each tensor as (name, dtype, shape), got "
                                  f"{type(item).__name__}") from None
    return name, dtype, shape


def _code_and_shape(name: Any, dtype: Any, shape: Any) -> Tuple[str, Any]:
    """The header code and shape a declared dtype stands for."""
    if isinstance(dtype, str) and dtype.isupper():
        return dtype, shape    # header codes are upper case; plan_write says if it is unknown
    if isinstance(dtype, str) and dtype in CODE_OF_NUMPY_NAME:
        return CODE_OF_NUMPY_NAME[dtype], shape
    text = str(dtype)
    if text.startswith("torch."):
        code = CODE_OF_TORCH_NAME.get(text[len("torch."):])
        if code in PACKED_PAIRS and len(shape):
            shape = (*shape[:-1], shape[-1] * 2)
        if code is not None:
            return code, shape
    try:
        code = spec_of_array(str(name), np.empty(0, np.dtype(dtype))).dtype
    except (TypeError, ValueError):
        raise SafetensorTypeError(f"tensor {name!r}: dtype {dtype!r} has no safetensors "
                                  f"code") from None
    return code, shape


def piece_of(target: str, name: str, data: Any) -> Tuple[np.ndarray, Optional[str]]:
    """A piece of tensor `name` of the file `target` (an array, a buffer, a framework's
    tensor) as a NumPy array of its bytes, in the NumPy dtype of its code, and None;
    or, for a framework's tensor of a dtype NumPy has only from ml_dtypes (bfloat16,
    float8), as the integers of its bits and its header code."""
    if isinstance(data, np.ndarray):
        return data, None
    if isinstance(data, np.generic):
        return np.asarray(data), None
    adapter = tensor_adapter(data)
    if adapter is not None:
        piece: Tuple[np.ndarray, Optional[str]] = adapter.piece_of_tensor(data)
        return piece
    try:
        return np.asarray(memoryview(data)), None
    except TypeError:
        pass
    if hasattr(data, "__array__") or hasattr(data, "__dlpack__"):
        try:
            return np.asarray(data), None
        except (TypeError, ValueError, RuntimeError) as error:
            raise SafetensorTypeError(
                f"{target}: tensor {name!r}: NumPy cannot view this "
                f"{type(data).__name__} ({error}); write its raw bytes with write_bytes") from None
    raise SafetensorTypeError(f"{target}: tensor {name!r}: expected an array or a buffer, got "
                              f"{type(data).__name__}")


def specs_of(handle: Any) -> List[WriteSpec]:
    """The declared specs of every tensor of an open file, in its buffer order:
    what ``save_file_from`` needs to copy it.

    Parameters
    ----------
    handle : NumpyHandle or FrameworkHandle or ShardedHandle
        An open file (what ``safe_open`` returns).

    Returns
    -------
    list of WriteSpec
        Each tensor's name, dtype code and shape, with ``data=None``.

    Raises
    ------
    SafetensorError
        When the handle is closed.

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> from fastst.writer import save_file_from, specs_of
    >>> folder = tempfile.mkdtemp()
    >>> old, new = (os.path.join(folder, name) for name in ("old.safetensors", "new.safetensors"))
    >>> fastst.save_file({"a": np.ones(2), "b": np.zeros(3, np.int8)}, old)
    >>> with fastst.safe_open(old) as f:                     # a copy, a tensor at a time
    ...     specs_of(f)
    ...     save_file_from(specs_of(f), f, new)
    [WriteSpec(name='a', dtype='F64', shape=[2], data=None), WriteSpec(name='b', dtype='I8', shape=[3], data=None)]
    >>> import filecmp
    >>> filecmp.cmp(old, new, shallow=False)
    True
    """
    specs = []
    for name in handle.offset_keys():
        info = handle.info(name)
        specs.append(WriteSpec(name, info.dtype, info.shape, None))
    return specs
