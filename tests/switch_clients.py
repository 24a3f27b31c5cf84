"""What the Hugging Face libraries give, through whatever ``safetensors`` is: run by
test_switch_clients.py in a fresh Python, with or without the switch to fastst.

    python switch_clients.py FOLDER

Each case builds a model from a small config (nothing is downloaded), saves and loads
it through transformers, huggingface_hub, accelerate or diffusers in a folder of its
own under FOLDER, and writes what came of it to FOLDER/results.json: the digests of
the files saved and of the model's outputs, the warnings logged (FOLDER in place of the
folder, which differs from run to run), or the error raised.
"""
import hashlib
import json
import logging
import os
import sys
import traceback
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402

TOKENS = torch.arange(12).reshape(2, 6) % 100


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensor_digest(tensor):
    """The digest of a tensor's dtype, shape and bytes."""
    tensor = tensor.detach().cpu().contiguous()
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    return f"{tensor.dtype} {list(tensor.shape)} {digest(raw.numpy().tobytes())}"


def file_digest(path):
    """The digest of a file's bytes; of a safetensors file with several metadata keys,
    which the reference writes in an order that changes from run to run, the digest
    of its header's JSON with sorted keys and of its data."""
    with open(path, "rb") as file:
        data = file.read()
    if path.endswith(".safetensors"):
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        if len(header.get("__metadata__", {})) > 1:
            return digest(json.dumps(header, sort_keys=True).encode() + data[8 + length:])
    return digest(data)


def files_saved(folder):
    """Each file saved in `folder` (weights, index, configs), by name, with its digest."""
    return {name: file_digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder))}


def outputs(model, *inputs):
    with torch.no_grad():
        output = model.eval()(*(inputs or (TOKENS,)))
    for name in ("logits", "sample"):     # transformers', diffusers' outputs
        output = getattr(output, name, output)
    return tensor_digest(output)


def llama(tie: bool, dtype=torch.float32):
    import transformers

    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tie, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def saved_llama(folder):
    """An untied Llama saved by transformers in shards under `folder`; the model."""
    model = llama(tie=False)
    model.save_pretrained(folder, max_shard_size="40KB")
    return model


# --- the cases ------------------------------------------------------------------------------

def transformers_sharded_and_tied(folder):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)    # the head is the embedding's weight
    model.save_pretrained(folder, max_shard_size="20KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return {"files": files_saved(folder), "outputs": outputs(loaded),
            "same as saved": outputs(loaded) == outputs(model)}


def transformers_tied_llama(folder):
    import transformers

    model = llama(tie=True)
    model.save_pretrained(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    return {"files": files_saved(folder), "outputs": outputs(loaded),
            "same as saved": outputs(loaded) == outputs(model),
            "tied": loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()}


def transformers_bf16(folder):
    import transformers

    model = llama(tie=False, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20KB")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    return {"files": files_saved(folder), "outputs": outputs(loaded),
            "same as saved": outputs(loaded) == outputs(model),
            "dtype": str(next(loaded.parameters()).dtype)}


def transformers_device_map_auto(folder):
    import transformers

    model = saved_llama(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    return {"files": files_saved(folder), "outputs": outputs(loaded),
            "same as saved": outputs(loaded) == outputs(model)}


def transformers_disable_mmap(folder):
    import transformers

    model = saved_llama(folder)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, disable_mmap=True)
    return {"outputs": outputs(loaded), "same as saved": outputs(loaded) == outputs(model)}


def hub_state_dict(folder):
    import huggingface_hub

    model = llama(tie=True)
    os.makedirs(folder)
    huggingface_hub.save_torch_state_dict(model.state_dict(), folder, max_shard_size="20KB")
    other = llama(tie=True)
    for parameter in other.parameters():
        torch.nn.init.zeros_(parameter)
    result = huggingface_hub.load_torch_model(other, folder, strict=False)
    return {"files": files_saved(folder), "outputs": outputs(other),
            "same as saved": outputs(other) == outputs(model),
            "keys": [sorted(result.missing_keys), sorted(result.unexpected_keys)]}


def hub_mixin(folder):
    import huggingface_hub
    import safetensors.torch

    class Mixed(torch.nn.Module, huggingface_hub.PyTorchModelHubMixin):
        def __init__(self, width: int = 8):
            super().__init__()
            self.embed = torch.nn.Embedding(100, width)
            self.head = torch.nn.Linear(width, 100, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    torch.manual_seed(2)
    model = Mixed(width=8)
    model.save_pretrained(folder)
    calls = []
    load_model = safetensors.torch.load_model

    def counted(*args, **kwargs):
        calls.append(sorted(kwargs))
        return load_model(*args, **kwargs)

    safetensors.torch.load_model = counted
    try:
        loaded = Mixed.from_pretrained(folder)
    finally:
        safetensors.torch.load_model = load_model
    return {"files": files_saved(folder), "outputs": outputs(loaded),
            "same as saved": outputs(loaded) == outputs(model), "load_model keywords": calls}


def accelerate_dispatch(folder):
    import accelerate

    model = saved_llama(folder)
    with accelerate.init_empty_weights():
        empty = llama(tie=False)
    dispatched = accelerate.load_checkpoint_and_dispatch(empty, folder, device_map="auto")
    return {"outputs": outputs(dispatched), "same as saved": outputs(dispatched) == outputs(model)}


def diffusers_unet(folder):
    import diffusers

    torch.manual_seed(3)
    model = diffusers.UNet2DModel(sample_size=8, in_channels=1, out_channels=1,
                                  layers_per_block=1, block_out_channels=(8, 16),
                                  down_block_types=("DownBlock2D", "DownBlock2D"),
                                  up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4)
    model.save_pretrained(folder)
    loaded = diffusers.UNet2DModel.from_pretrained(folder)
    sample = torch.linspace(-1, 1, 64).reshape(1, 1, 8, 8)
    return {"files": files_saved(folder), "outputs": outputs(loaded, sample, 3)}


CASES = [transformers_sharded_and_tied, transformers_tied_llama, transformers_bf16,
         transformers_device_map_auto, transformers_disable_mmap, hub_state_dict, hub_mixin,
         accelerate_dispatch, diffusers_unet]
# the library each case needs, where it is not installed
NEEDS = {accelerate_dispatch: "accelerate", diffusers_unet: "diffusers"}


class Logged(logging.Handler):
    """The warnings that the libraries log, and those they warn with."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def run(case, folder):
    logged = Logged()
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "transformers",
                                                    "accelerate", "diffusers")]
    for logger in loggers:
        logger.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            result = case(os.path.join(folder, case.__name__))
        messages = logged.messages + [str(warning.message) for warning in warned]
        result["warnings"] = [message.replace(folder, "FOLDER") for message in messages]
        return result
    except Exception as error:   # compared between runs, as any other result
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        for logger in loggers:
            logger.removeHandler(logged)


# the functions that libraries take from safetensors as they are imported
BOUND = {"transformers.modeling_utils": ["safe_open", "_safe_load_bytes", "safe_save_file"],
         "accelerate.utils.modeling": ["safe_open", "safe_load_file"]}


def bound():
    """The module that each of BOUND comes from, in the libraries imported."""
    return {"safetensors": sys.modules["safetensors"].__file__,
            **{f"{module}.{name}": getattr(sys.modules[module], name).__module__
               for module, names in BOUND.items() if module in sys.modules for name in names}}


def main(folder):
    import importlib.util

    results = {case.__name__: run(case, folder) if importlib.util.find_spec(NEEDS.get(case, "torch"))
               else {"missing": NEEDS[case]} for case in CASES}
    results["bound"] = bound()
    with open(os.path.join(folder, "results.json"), "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
