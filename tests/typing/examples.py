import numpy as np

import fastst
from fastst.numpy import load_file

with fastst.safe_open("model.safetensors", framework="np") as f:
    reveal_type(f.get_tensor("w"))
    reveal_type(f.keys())
    reveal_type(f.metadata())
    reveal_type(f.get_slice("w").get_shape())
    reveal_type(f.get_slice("w")[0:2])
    reveal_type(f.info("w").shape)

reveal_type(fastst.safe_open("model.safetensors", backend="pread"))
reveal_type(load_file("model.safetensors"))
reveal_type(fastst.save({"w": np.zeros(3)}, metadata={"k": "v"}))
reveal_type(fastst.load(b""))
try:
    fastst.load(b"")
except fastst.SafetensorError as error:
    reveal_type(error)

with fastst.safe_open("checkpoint/model.safetensors.index.json") as c:
    reveal_type(c)
    reveal_type(c.read_rows("w", 0, 2))
