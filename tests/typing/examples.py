import numpy as np

import fastst
import fastst.numpy
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

framework: str = "np"   # a framework chosen at run time
reveal_type(fastst.safe_open("model.safetensors", framework))
reveal_type(fastst.safe_open("model.safetensors", "mlx").get_tensor("w"))
with open("model.safetensors") as raw:
    reveal_type(fastst._safe_open_handle(raw, "np"))
reveal_type(fastst.numpy.load(b""))
opened = fastst.safe_open("model.safetensors")
if isinstance(opened, fastst.safe_open):
    reveal_type(opened.keys())
fastst.save_state("state.safetensors", {"step": 3, "moments": [np.zeros(2), (1.5, None)]})
reveal_type(fastst.load_state("state.safetensors"))
reveal_type(fastst.load_state("state.safetensors", framework))
