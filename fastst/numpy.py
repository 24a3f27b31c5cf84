"""Drop-in replacement for ``safetensors.numpy``: same functions, same signatures,
and the names it takes from ``safetensors`` (``safe_open``, ``serialize``...).

Each is the function of the same name in ``fastst``, documented there, but for
`load`, which returns writable arrays of their own as the reference's does
(``fastst.load`` views the bytes given).

Examples
--------
>>> import numpy as np
>>> from fastst.numpy import load, save
>>> load(save({"x": np.arange(3, dtype=np.int8)}))
{'x': array([0, 1, 2], dtype=int8)}
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from ._api import (LOWLEVEL, load as _load_viewing, load_file, lowlevel_name, safe_open, save,
                   save_file)
from ._core import DEFAULT_MAX_HEADER_SIZE

if TYPE_CHECKING:
    import numpy.typing as npt

    from ._format.lowlevel import TensorSpec, deserialize, serialize, serialize_file

__all__ = ["save", "save_file", "load", "load_file", "safe_open", "serialize", "serialize_file",
           "deserialize", "TensorSpec"]


# serialize, deserialize... (fastst._api.LOWLEVEL): imported on first use
def __getattr__(name: str) -> Any:
    return lowlevel_name(__name__, name, globals())


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(LOWLEVEL))


def load(data: Any, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
         ) -> Dict[str, npt.NDArray[Any]]:
    """Load the tensors of a safetensors file held in memory, as
    ``safetensors.numpy.load`` does: each into writable memory of its own.

    ``fastst.load(data)`` views `data` instead, copying nothing (its arrays
    are read-only when `data` is ``bytes``).

    Parameters
    ----------
    data : bytes-like object
        The whole file: bytes, bytearray, memoryview, mmap, or a 1-d uint8
        NumPy array.
    max_header_size : int, default 100,000,000
        The largest header accepted, in bytes.

    Returns
    -------
    dict of str to numpy.ndarray
        Every tensor, by name, in the order of its bytes in `data`.

    Raises
    ------
    SafetensorError
        When the bytes break a rule of the format.
    SafetensorTypeError
        When `data` is not a bytes-like object.

    Examples
    --------
    >>> import numpy as np
    >>> from fastst.numpy import load, save
    >>> arrays = load(save({"x": np.arange(3, dtype=np.uint8)}))
    >>> arrays["x"] += 1
    >>> arrays["x"].tolist(), arrays["x"].flags.writeable
    ([1, 2, 3], True)
    """
    return _load_viewing(data, copy=True, max_header_size=max_header_size)
