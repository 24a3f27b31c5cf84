"""What the header says of one tensor, as ``get_tensor_meta`` gives it: imported on
the first such call, so that opening a file does not pay for the class (a typed
named tuple costs about 0.3 ms to make)."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Tuple

if TYPE_CHECKING:
    from .._core import TensorInfo

__all__ = ["TensorMeta", "meta_of"]


class TensorMeta(NamedTuple):
    """What the header says of one tensor, as ``get_tensor_meta(name)`` gives it,
    read without touching its bytes: the reference's ``TensorMeta``.

    Attributes
    ----------
    dtype : str
        The header dtype code, e.g. ``"F32"``.
    shape : list of int
        The shape the header gives.
    data_offsets : tuple of (int, int)
        The tensor's bytes, ``[begin, end)``, counted from the start of the data
        that follows the header (of its shard, in a sharded checkpoint).

    Examples
    --------
    >>> import numpy as np, fastst, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
    >>> fastst.save_file({"w": np.zeros((2, 3), np.float32)}, path)
    >>> with fastst.safe_open(path) as f:
    ...     f.get_tensor_meta("w")
    TensorMeta(dtype='F32', shape=[2, 3], data_offsets=(0, 24))
    """

    __module__ = "fastst"

    dtype: str
    shape: List[int]
    data_offsets: Tuple[int, int]


def meta_of(info: TensorInfo) -> TensorMeta:
    """The TensorMeta of a tensor described by `info`."""
    return TensorMeta(info.dtype, list(info.shape), info.data_offsets)

