"""Drop-in replacement for ``safetensors.numpy``: same functions, same signatures,
and the names it takes from ``safetensors`` (``safe_open``, ``serialize``...)."""
from ._api import load, load_file, safe_open, save, save_file
from ._lowlevel import TensorSpec, deserialize, serialize, serialize_file

__all__ = ["save", "save_file", "load", "load_file", "safe_open", "serialize", "serialize_file",
           "deserialize", "TensorSpec"]
