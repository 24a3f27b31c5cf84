"""Writing from explicit specs: each tensor given as (name, dtype code, shape,
source), so that any framework's tensors, and dtypes NumPy lacks, go through the
same plan and the same output loop.

>>> import numpy as np, fastst
>>> packed = np.array([0x21, 0x43], dtype=np.uint8)      # four 4-bit floats
>>> data = fastst.writer.serialize([fastst.TensorSpec("f4", "F4", (4,), packed)])
>>> fastst.load(data)["f4"].tolist()
[33, 67]
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from ._core import TensorSpec, WritePlan, plan_write, spec_of_array
from ._files import PathLike, write_atomically

__all__ = ["TensorSpec", "WritePlan", "plan_write", "serialize", "serialize_file",
           "spec_of_array", "write_atomically"]


def serialize(specs: Iterable[TensorSpec], metadata: Optional[Mapping[str, str]] = None) -> bytes:
    """The bytes of a safetensors file holding the tensors `specs` describe."""
    return plan_write(list(specs), metadata).to_bytes()


def serialize_file(specs: Iterable[TensorSpec], filename: PathLike,
                   metadata: Optional[Mapping[str, str]] = None, *, fsync: bool = False) -> None:
    """Write the tensors `specs` describe to `filename` atomically (see
    ``fastst.save_file``)."""
    write_atomically(plan_write(list(specs), metadata), filename, fsync=fsync)
