"""Drop-in replacement for ``safetensors.numpy``: same functions, same signatures."""
from ._api import load, load_file, save, save_file

__all__ = ["save", "save_file", "load", "load_file"]
