"""Drop-in replacement for ``safetensors.flax``: the same functions and signatures,
``jax.Array``s in and out.

Saving turns each array into NumPy (``np.asarray``, no copy for CPU arrays) and
writes it with fastst; bfloat16 and float8 keep their dtypes. Loading goes
through ``fastst.jax``.

Examples
--------
>>> import jax.numpy as jnp, tempfile, os
>>> from fastst.flax import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "params.safetensors")
>>> save_file({"w": jnp.ones(2, jnp.bfloat16)}, path)
>>> load_file(path)
{'w': Array([1, 1], dtype=bfloat16)}
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Union, cast

import numpy as np

# first: without JAX, its ImportError says how to install it
from ._frameworks.jax import converter

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ._api import safe_open  # noqa: E402
from ._api import save as save_numpy, save_file as save_numpy_file  # noqa: E402
from ._core import Reader  # noqa: E402
from ._io.limits import DEFAULT_BACKEND  # noqa: E402

if TYPE_CHECKING:
    from ._handles.protocols import Backend

__all__ = ["save", "save_file", "load", "load_file"]


def save(tensors: Dict[str, jax.Array], metadata: Optional[Dict[str, str]] = None, *,
         checksum: Optional[str] = None, align: Optional[int] = None) -> bytes:
    """Serialize JAX arrays into the bytes of a safetensors file.

    The drop-in for ``safetensors.flax.save``, with the same bytes.

    Parameters
    ----------
    tensors : dict of str to jax.Array
        The arrays, by name (anything ``np.asarray`` takes).
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata (see ``fastst.save``).
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).

    Returns
    -------
    bytes
        The whole file.

    Raises
    ------
    TypeError
        When `tensors` is not a dict, or a metadata key or value not a str.
    SafetensorTypeError
        For a dtype the format has no code for.

    Examples
    --------
    >>> import jax.numpy as jnp, fastst.flax
    >>> fastst.flax.load(fastst.flax.save({"x": jnp.arange(3)}))
    {'x': Array([0, 1, 2], dtype=int32)}
    """
    return save_numpy(_to_numpy(tensors), metadata=metadata, checksum=checksum, align=align)


def save_file(tensors: Dict[str, jax.Array], filename: Union[str, "os.PathLike[str]"],
              metadata: Optional[Dict[str, str]] = None, *, fsync: bool = False,
              checksum: Optional[str] = None, max_shard_size: Union[int, str, None] = None,
              align: Optional[int] = None) -> None:
    """Write JAX arrays to a safetensors file, atomically.

    The drop-in for ``safetensors.flax.save_file``, written as
    ``fastst.save_file`` writes.

    Parameters
    ----------
    tensors : dict of str to jax.Array
        The arrays, by name.
    filename : str or os.PathLike
        The file to write (a directory with `max_shard_size`).
    metadata : dict of str to str, optional
        The header's ``__metadata__``.
    fsync : bool, default False
        Flush the file and its directory to disk before returning.
    checksum : "xxh3_64" or "xxh3_128", optional
        Store each tensor's checksum in the metadata.
    max_shard_size : int or str, optional
        Save a sharded checkpoint: `filename` is its directory (see
        ``fastst.save_file``).
    align : int, optional
        Start the data, and as many tensors as can, at multiples of this many
        bytes (see ``fastst.save``).

    Raises
    ------
    TypeError
        When `tensors` is not a dict.
    OSError
        When the file cannot be written; the old file stays.

    Examples
    --------
    >>> import jax.numpy as jnp, fastst.flax, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "params.safetensors")
    >>> fastst.flax.save_file({"w": jnp.zeros((2, 2))}, path, metadata={"step": "1"})
    >>> fastst.flax.load_file(path)["w"].shape
    (2, 2)
    """
    save_numpy_file(_to_numpy(tensors), filename, metadata=metadata, fsync=fsync,
                    checksum=checksum, max_shard_size=max_shard_size, align=align)


def load(data: bytes) -> Dict[str, jax.Array]:
    """Load the arrays of a safetensors file held in memory.

    The drop-in for ``safetensors.flax.load``. Arrays of read-only data
    (``bytes``) may share its memory; a writable buffer (``bytearray``) is
    copied from, so that later writes to it cannot change them.

    Parameters
    ----------
    data : bytes-like object
        The whole file.

    Returns
    -------
    dict of str to jax.Array
        Every tensor, in the order of its bytes in `data`.

    Raises
    ------
    SafetensorError
        When the bytes break a rule of the format.

    Examples
    --------
    >>> import jax.numpy as jnp, fastst.flax
    >>> data = bytearray(fastst.flax.save({"x": jnp.ones(2)}))
    >>> fastst.flax.load(data)
    {'x': Array([1., 1.], dtype=float32)}
    """
    reader = Reader()
    reader.open_buffer(data)
    convert = converter("cpu")
    return {name: jnp.array(array) if array.flags.writeable
            else convert(array, name, reader.info(name))
            for name, array in reader.get_tensors().items()}


def load_file(filename: Union[str, "os.PathLike[str]"], *, device: Any = "cpu",
              backend: Backend = DEFAULT_BACKEND, shardings: Any = None,
              storage_options: Optional[Mapping[str, Any]] = None) -> Dict[str, jax.Array]:
    """Load every tensor of a file, or of a sharded checkpoint, as ``jax.Array``s.

    The drop-in for ``safetensors.flax.load_file``. On the CPU, JAX uses the
    memory of the file's map where it can (see ``fastst.jax``). With
    `shardings`, each array is laid out over devices as
    ``jax.device_put(array, sharding)`` would, each device reading only the
    bytes of its shard (a shard several devices hold, once): no whole array
    is loaded first (``fastst.distributed.plan_shardings`` shows the bytes).

    Parameters
    ----------
    filename : str or os.PathLike
        A ``.safetensors`` file, or a sharded checkpoint (its directory or
        ``*.index.json``).
    device : str or jax.Device, default "cpu"
        Where the arrays go: ``"cpu"``, ``"gpu"``, ``"cuda:1"``, a
        ``jax.Device``.
    backend : "mmap" or "pread", default "mmap"
        How the file is read. ``"pread"`` reads each shard's bytes alone;
        ``"mmap"`` copies them out of the file's map.
    shardings : jax.sharding.Sharding, mapping or callable, optional
        How to lay out the arrays: one sharding for every tensor, a mapping
        of name to sharding, or ``shardings(name, shape, dtype)`` (the
        array's shape and NumPy dtype) returning one; a tensor given None
        goes to `device`. A sub-byte tensor (F4, F6_*, packed bytes) may be
        split along its leading axes only.
    storage_options : dict, optional
        For a URL: the options of its fsspec file system.

    Returns
    -------
    dict of str to jax.Array
        Every tensor, in the order of its bytes in the file.

    Raises
    ------
    FileNotFoundError
        When the file does not exist.
    SafetensorError
        When the file breaks a rule of the format, or `device` is not a
        device.
    RuntimeError
        When `device` is not available to JAX.

    Examples
    --------
    >>> import jax.numpy as jnp, fastst.flax, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "params.safetensors")
    >>> fastst.flax.save_file({"b": jnp.arange(2), "w": jnp.ones(2)}, path)
    >>> fastst.flax.load_file(path, device="cpu")
    {'w': Array([1., 1.], dtype=float32), 'b': Array([0, 1], dtype=int32)}

    Split over the devices there are (on a CPU, JAX has one unless
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` was set before it
    was imported):

    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
    >>> mesh = Mesh(np.array(jax.devices()), ("x",))
    >>> fastst.flax.save_file({"w": jnp.ones((8, 4))}, path)
    >>> w = fastst.flax.load_file(path, shardings=NamedSharding(mesh, PartitionSpec("x")))["w"]
    >>> w.sharding.spec == PartitionSpec("x"), w.shape
    (True, (8, 4))
    """
    with safe_open(filename, framework="flax", device=device, backend=backend,
                   storage_options=storage_options) as f:
        if shardings is None:
            return f.get_tensors()
        laid_out: Dict[str, jax.Array] = cast(Any, f).get_tensors(shardings=shardings)
        return laid_out


def _to_numpy(tensors: Any) -> Dict[str, Any]:
    if not isinstance(tensors, dict):
        raise TypeError(f"tensors must be a dict of str to jax.Array, got "
                        f"{type(tensors).__name__}")
    return {name: np.asarray(array) for name, array in tensors.items()}
