"""Drop-in replacement for ``safetensors.numpy``: same functions, same signatures,
and the names it takes from ``safetensors`` (``safe_open``, ``serialize``...).

Each is the function of the same name in ``fastst``, documented there.

Examples
--------
>>> import numpy as np
>>> from fastst.numpy import load, save
>>> load(save({"x": np.arange(3, dtype=np.int8)}))
{'x': array([0, 1, 2], dtype=int8)}
"""
from ._api import load, load_file, safe_open, save, save_file
from ._lowlevel import TensorSpec, deserialize, serialize, serialize_file

__all__ = ["save", "save_file", "load", "load_file", "safe_open", "serialize", "serialize_file",
           "deserialize", "TensorSpec"]
