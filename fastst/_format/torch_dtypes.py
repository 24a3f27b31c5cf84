"""THE map between header dtype codes and torch's dtypes, derived from the dtype table
(``fastst.DTYPES``), and the same-width integers through which torch and NumPy share
the bytes of a dtype one of them lacks (bfloat16 and float8 have no NumPy twin torch
knows; float4 and float6 are packed bytes in NumPy).

The names need no torch: the converter reads pickles without it, and writers take
torch dtypes declared by name. The ``torch.dtype`` objects are made on first use.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Dict, FrozenSet, Optional

import numpy as np

from .._core import DTYPES, SafetensorError

if TYPE_CHECKING:
    import torch  # type: ignore[import-not-found, unused-ignore]

# torch dtype name -> header code (torch has no dtype for the F6 codes)
CODE_OF_TORCH_NAME: Dict[str, str] = {row.torch: row.code for row in DTYPES if row.torch}
# codes whose torch dtype packs two values a byte along the last dim (float4_e2m1fn_x2)
PACKED_PAIRS: FrozenSet[str] = frozenset(row.code for row in DTYPES
                                         if row.torch and row.bits == 4)
# bytes an element -> the integer dtype, of that width, that NumPy and torch both have
SAME_WIDTH_INTEGER: Dict[int, str] = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
# torch dtype names whose memory NumPy views as it is (the others go through an integer)
NUMPY_VIEWS_TORCH = frozenset({"bool", "uint8", "int8", "int16", "float16", "int32",
                               "float32", "complex64", "float64", "int64"})


# codes whose NumPy dtype ml_dtypes adds (bfloat16, float8): torch takes such arrays,
# and their bits, only through a same-width integer
FROM_ML_DTYPES: FrozenSet[str] = frozenset(row.code for row in DTYPES
                                           if not hasattr(np, row.numpy))


@functools.lru_cache(maxsize=None)
def torch_dtypes() -> Dict[str, Optional[torch.dtype]]:
    """Header code -> torch dtype; None where torch, or this version of it, has none."""
    import torch

    return {row.code: getattr(torch, row.torch, None) if row.torch else None for row in DTYPES}


@functools.lru_cache(maxsize=None)
def codes_of_torch() -> Dict[torch.dtype, str]:
    """torch dtype -> header code, for the dtypes that have one."""
    return {dtype: code for code, dtype in torch_dtypes().items() if dtype is not None}


def torch_dtype(code: str, where: str) -> torch.dtype:
    """The torch dtype of header code `code`; an error naming `where` (a file and
    tensor) when this torch has none."""
    dtype = torch_dtypes()[code]
    if dtype is None:
        import torch

        raise SafetensorError(f"{where}: this torch ({torch.__version__}) has no dtype for "
                              f"{code}")
    return dtype


def torch_dtype_of_bytes(code: str, where: str) -> torch.dtype:
    """`torch_dtype`, but uint8 for the packed codes torch has no dtype for (F6),
    whose bytes come as they are, as in NumPy."""
    if code in CODE_OF_TORCH_NAME.values():
        return torch_dtype(code, where)
    import torch

    return torch.uint8


def same_width_torch(itemsize: int) -> torch.dtype:
    """The integer torch dtype of `itemsize` bytes (see SAME_WIDTH_INTEGER)."""
    import torch

    dtype: torch.dtype = getattr(torch, SAME_WIDTH_INTEGER[itemsize])
    return dtype


@functools.lru_cache(maxsize=None)
def numpy_array_torch_dtypes() -> Dict[str, torch.dtype]:
    """Header code -> the torch dtype of fastst's NumPy array of it (packed sub-byte
    tensors as their bytes): what reaches other frameworks through DLPack."""
    import torch

    return {row.code: getattr(torch, row.numpy) for row in DTYPES}
