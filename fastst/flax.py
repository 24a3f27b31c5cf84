"""Drop-in replacement for ``safetensors.flax``: the same functions and signatures,
``jax.Array``s in and out.

Saving turns each array into NumPy (``np.asarray``, no copy for CPU arrays) and
writes it with fastst; bfloat16 and float8 keep their dtypes. Loading goes
through ``fastst.jax``.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

import numpy as np

from .jax import converter  # first: without JAX, its ImportError says how to install it

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._api import save as save_numpy, save_file as save_numpy_file  # noqa: E402
from ._core import Reader  # noqa: E402
from ._api import safe_open  # noqa: E402
from ._handle import Backend  # noqa: E402

__all__ = ["save", "save_file", "load", "load_file"]


def save(tensors: Dict[str, jax.Array], metadata: Optional[Dict[str, str]] = None, *,
         checksum: Optional[str] = None) -> bytes:
    """The bytes of a safetensors file holding `tensors` (`checksum`: see
    ``fastst.save``)."""
    return save_numpy(_to_numpy(tensors), metadata=metadata, checksum=checksum)


def save_file(tensors: Dict[str, jax.Array], filename: Union[str, "os.PathLike[str]"],
              metadata: Optional[Dict[str, str]] = None, *, fsync: bool = False,
              checksum: Optional[str] = None, max_shard_size: Union[int, str, None] = None
              ) -> None:
    """Write `tensors` to `filename` atomically (see ``fastst.save_file``, and its
    `fsync`, `checksum` and `max_shard_size` options: with `max_shard_size`,
    `filename` is the directory of a sharded checkpoint)."""
    save_numpy_file(_to_numpy(tensors), filename, metadata=metadata, fsync=fsync,
                    checksum=checksum, max_shard_size=max_shard_size)


def load(data: bytes) -> Dict[str, jax.Array]:
    """Load arrays from the bytes of a safetensors file.

    Arrays of read-only data (``bytes``) may share its memory; a writable buffer
    (``bytearray``) is copied from, so that later writes to it cannot change them.
    """
    reader = Reader()
    reader.open_buffer(data)
    convert = converter("cpu")
    return {name: jnp.array(array) if array.flags.writeable
            else convert(array, name, reader.info(name))
            for name, array in reader.get_tensors().items()}


def load_file(filename: Union[str, "os.PathLike[str]"], *, device: Any = "cpu",
              backend: Backend = "mmap") -> Dict[str, jax.Array]:
    """Load every tensor of a file, or of a sharded checkpoint (its directory or
    ``*.index.json``), as ``jax.Array``s on `device` (``"cpu"``, ``"gpu"``,
    ``"cuda:1"``, a ``jax.Device``; see ``fastst.jax``)."""
    with safe_open(filename, framework="flax", device=device, backend=backend) as f:
        return f.get_tensors()


def _to_numpy(tensors: Any) -> Dict[str, Any]:
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of str to jax.Array, got "
                        f"{type(tensors).__name__}")
    return {name: np.asarray(array) for name, array in tensors.items()}
