import torch

import fastst
import fastst.data
import fastst.flax
import fastst.torch

with fastst.safe_open("model.safetensors", framework="pt", device="cpu") as t:
    reveal_type(t)
    reveal_type(t.get_tensor("w"))
    reveal_type(t.get_slice("w")[1:, 0])
    reveal_type(t.get_tensors())
    reveal_type(t.keys())

with fastst.safe_open("model.safetensors", framework="flax", backend="pread") as j:
    reveal_type(j.get_tensor("w"))
    reveal_type(j["w"])

reveal_type(fastst.safe_open("model.safetensors", "torch", 0).get_tensor("w"))
reveal_type(fastst.torch.load_file("model.safetensors"))
reveal_type(fastst.flax.load_file("model.safetensors"))
reveal_type(fastst.torch.TORCH_DTYPES)
reveal_type(fastst.load_state("state.safetensors", "pt"))
reveal_type(fastst.torch.load_model(torch.nn.Linear(2, 2), "model.safetensors"))
rows = fastst.data.RowDataset("rows.safetensors", ["x", "y"])
reveal_type(rows)
reveal_type(fastst.data.data_loader(rows, 256, shuffle=True))
reveal_type(fastst.data.batch_sampler(rows, 256))
