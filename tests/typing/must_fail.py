# Each line marked `# error` is a wrong call that mypy must report.
import numpy as np
import torch

import fastst

n = fastst.safe_open("model.safetensors")
t = fastst.safe_open("model.safetensors", framework="pt")

as_array: np.ndarray = t.get_tensor("w")  # error
as_tensor: torch.Tensor = n.get_tensor("w")  # error
sliced: torch.Tensor = n.get_slice("w")[0]  # error
fastst.safe_open("model.safetensors", framework=1)  # error
fastst.safe_open("model.safetensors", backend="io_uring")  # error
fastst.save_state("state.safetensors", {"ids": {1, 2}})  # error
t.get_tensor("w", out=np.empty(2))  # error
t.copy_tensors()  # error
fastst.safe_open("model.safetensors", framework="jax").get_tensor(0)  # error
fine: torch.Tensor = t.get_tensor("w")
