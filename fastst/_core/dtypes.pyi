"""The dtype table, from which every other list of dtypes derives."""
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
import os
from typing import Any, Final, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
from collections.abc import Mapping
from typing_extensions import Buffer

DTYPE_CODES: Final[tuple[str, ...]]
"""The header codes of the format's dtypes (``"F32"``, ``"BF16"``...), in the order the
format ranks them: the codes of `DTYPES`, in its order.

Examples
--------
>>> import fastst
>>> fastst.DTYPE_CODES[:6]
('BOOL', 'F4', 'F6_E2M3', 'F6_E3M2', 'U8', 'I8')
>>> "BF16" in fastst.DTYPE_CODES
True
"""

class DtypeInfo(NamedTuple):
    """One dtype of the format: a row of `DTYPES`.

    Attributes
    ----------
    code : str
        The header code, e.g. ``"BF16"``.
    bits : int
        Bits per element (4 and 6 for the packed sub-byte dtypes).
    numpy : str
        The name of the NumPy dtype its tensors load as: ``"bfloat16"`` and the
        float8 names are ml_dtypes', and the sub-byte codes load as their
        packed bytes, ``"uint8"``.
    torch : str or None
        The name of the torch dtype (``"bfloat16"``, ``"float4_e2m1fn_x2"``...),
        or None where torch has none (the F6 codes).

    Examples
    --------
    >>> import fastst
    >>> {row.code: row for row in fastst.DTYPES}["BF16"]
    DtypeInfo(code='BF16', bits=16, numpy='bfloat16', torch='bfloat16')
    """
    code: str
    bits: int
    numpy: str
    torch: str | None

DTYPES: Final[tuple[DtypeInfo, ...]]
"""The one table of the format's dtypes, a `DtypeInfo` a row, in the order the format
ranks them (writers place tensors by descending rank, then by name).

Every dtype fastst reads and writes is here, with the NumPy dtype it loads as and the
torch dtype it matches; the other tables (`DTYPE_CODES`,
``fastst.torch.TORCH_DTYPES``) derive from it. See the guide's page on dtypes.

Examples
--------
>>> import fastst
>>> len(fastst.DTYPES), fastst.DTYPES[0]
(22, DtypeInfo(code='BOOL', bits=8, numpy='bool', torch='bool'))
>>> [row.code for row in fastst.DTYPES if row.bits < 8]
['F4', 'F6_E2M3', 'F6_E3M2']
"""

def numpy_dtype(code: str, /) -> np.dtype[Any]:
    """The NumPy dtype that tensors of header dtype `code` load as.

    ml_dtypes' dtypes for bfloat16 and float8 (ml_dtypes imported by the first call
    that needs it), ``uint8`` for the packed sub-byte codes.

    Raises
    ------
    SafetensorError
        When `code` is not a dtype of the format.
    """
def dtype_bits(code: str, /) -> int:
    """Bits per element of header dtype `code`.

    Raises
    ------
    SafetensorError
        When `code` is not a dtype of the format.
    """
