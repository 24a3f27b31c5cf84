"""The adapter behind ``safe_open(..., framework="jax")`` (or ``"flax"``): fastst's
NumPy views become ``jax.Array``s.

``jax.device_put`` takes each view: on the CPU, JAX uses the view's memory
itself when the tensor is C-contiguous and 64-byte aligned (any dtype, bfloat16
and float8 included), and otherwise makes one copy. JAX arrays are immutable and
no one else holds the view, so sharing it is safe. Tensors of 64-bit dtypes
become 32-bit unless JAX's ``jax_enable_x64`` is on, as with any NumPy input.
Sub-byte tensors (F4, F6_*) come as their packed bytes (uint8), as in NumPy.

On a CUDA GPU, when PyTorch with CUDA is installed too, a whole file
(``get_tensors``, ``fastst.flax.load_file(..., device="gpu")``) streams through
fastst's ring of pinned buffers into one allocation on the GPU and reaches JAX through
DLPack, each array a part of that allocation.

Shardings: ``get_tensor(name, sharding=...)`` and ``get_tensors(shardings=...)`` of a
handle opened for JAX (and ``fastst.flax.load_file(..., shardings=...)``) lay each
array out over devices as ``jax.device_put(array, sharding)`` would, reading for
each addressable device only the bytes of its shard, and a shard that several
devices hold (replicated) once: ``jax.make_array_from_single_device_arrays``
assembles the array. A sub-byte tensor (F4, F6_*) comes as its packed bytes: a
sharding may split its leading axes, not the packed last one (a `SafetensorError`
says so). ``fastst.distributed.plan_shardings`` shows the bytes each device reads.

``fastst.flax`` has the save/load functions.

Examples
--------
>>> import numpy as np, fastst, tempfile, os
>>> import jax
>>> path = os.path.join(tempfile.mkdtemp(), "x.safetensors")
>>> fastst.save_file({"x": np.arange(4, dtype=np.float32)}, path)
>>> with fastst.safe_open(path, framework="jax") as f:
...     x = f.get_tensor("x")
>>> type(x).__name__, x.dtype, x.sum().item()
('ArrayImpl', dtype('float32'), 6.0)

Laid out over the devices there are (the first axis split among them):

>>> from jax.sharding import Mesh, NamedSharding, PartitionSpec
>>> mesh = Mesh(np.array(jax.devices()), ("x",))
>>> fastst.save_file({"w": np.arange(8 * 3, dtype=np.float32).reshape(8, 3)}, path)
>>> with fastst.safe_open(path, framework="jax") as f:
...     w = f.get_tensor("w", sharding=NamedSharding(mesh, PartitionSpec("x")))
>>> w.sharding.spec == PartitionSpec("x"), len(w.addressable_shards) == len(jax.devices())
(True, True)
>>> float(w.sum())
276.0
"""
from ._frameworks.jax import converter, from_torch

__all__ = ["converter", "from_torch"]
