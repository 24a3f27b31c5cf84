"""fastst: fast, strict, zero-copy safetensors for NumPy.

A drop-in replacement for huggingface ``safetensors``: ``safe_open``, ``load_file``,
``load``, ``save_file``, ``save`` and ``fastst.numpy`` take the same arguments and
write byte-identical files. ``fastst.torch`` and ``fastst.flax`` do the same for
``safetensors.torch`` and ``safetensors.flax``; they import their framework only when
imported themselves.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
>>> fastst.save_file({"embed": np.ones((4, 2), np.float32)}, path, metadata={"step": "1"})
>>> with fastst.safe_open(path) as f:
...     f.metadata(), f.get_slice("embed")[1:3].tolist()
({'step': '1'}, [[1.0, 1.0], [1.0, 1.0]])
"""
# typing's flag, without importing typing: what the interpreter starts with (the
# switch's .pth file imports this package) stays small
TYPE_CHECKING = False

if TYPE_CHECKING:   # what mypy sees; at run time each comes from LAZY on first use
    from . import numpy, writer
    from ._api import _safe_open_handle as _safe_open_handle
    from ._api import load, load_file, load_into, safe_open, save, save_file
    from ._core import (DEFAULT_MAX_HEADER_SIZE, DTYPE_CODES, DTYPES, DtypeInfo, SafetensorError,
                        SafetensorIndexError, SafetensorNotImplementedError, SafetensorTypeError,
                        TensorInfo, TensorNotFoundError, read_options)
    from ._format.lowlevel import TensorSpec, deserialize, serialize, serialize_file
    from ._handles.edit import update_metadata
    from ._handles.handle import FrameworkHandle, NumpyHandle
    from ._handles.meta import TensorMeta
    from ._handles.prefetch import PrefetchLoader
    from ._handles.slicing import SafeSlice
    from ._switch import patch_safetensors
    from ._version import __version__
    from .state import load_state, save_state
    from .writer import StreamWriter, save_file_from

# name -> the module that holds it, imported on first use (None: the module itself).
# `import fastst` imports nothing more, not even the compiled core (nor NumPy with
# it); the first name used from here loads its module, and the name is then an
# attribute like any other.
LAZY = {"DEFAULT_MAX_HEADER_SIZE": "_core", "DTYPE_CODES": "_core", "DTYPES": "_core",
        "DtypeInfo": "_core", "SafetensorError": "_core", "SafetensorIndexError": "_core",
        "SafetensorNotImplementedError": "_core", "SafetensorTypeError": "_core",
        "TensorInfo": "_core", "TensorNotFoundError": "_core", "read_options": "_core",
        "safe_open": "_api", "_safe_open_handle": "_api", "load": "_api",
        "load_file": "_api", "load_into": "_api", "save": "_api", "save_file": "_api",
        "NumpyHandle": "_handles.handle", "FrameworkHandle": "_handles.handle",
        "TensorMeta": "_handles.meta", "PrefetchLoader": "_handles.prefetch",
        "SafeSlice": "_handles.slicing", "update_metadata": "_handles.edit",
        "StreamWriter": "writer", "save_file_from": "writer",
        "TensorSpec": "_format.lowlevel", "serialize": "_format.lowlevel",
        "serialize_file": "_format.lowlevel", "deserialize": "_format.lowlevel",
        "save_state": "state", "load_state": "state", "patch_safetensors": "_switch",
        "__version__": "_version", "numpy": None, "writer": None}


def __getattr__(name: str) -> object:
    if name not in LAZY:
        raise AttributeError(f"module 'fastst' has no attribute {name!r}")
    from importlib import import_module

    module = import_module(f"fastst.{LAZY[name] or name}")
    value = module if LAZY[name] is None else getattr(module, name)
    globals()[name] = value   # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))


__all__ = [
    "DEFAULT_MAX_HEADER_SIZE",
    "DTYPE_CODES",
    "DTYPES",
    "DtypeInfo",
    "FrameworkHandle",
    "NumpyHandle",
    "PrefetchLoader",
    "SafeSlice",
    "SafetensorError",
    "SafetensorIndexError",
    "SafetensorNotImplementedError",
    "SafetensorTypeError",
    "StreamWriter",
    "TensorInfo",
    "TensorMeta",
    "TensorNotFoundError",
    "TensorSpec",
    "deserialize",
    "load",
    "load_file",
    "load_into",
    "load_state",
    "patch_safetensors",
    "read_options",
    "safe_open",
    "save",
    "save_file",
    "save_state",
    "save_file_from",
    "serialize",
    "serialize_file",
    "update_metadata",
    "numpy",
    "writer",
    "__version__",
]
