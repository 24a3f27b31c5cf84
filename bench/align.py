#!/usr/bin/env python
"""Aligned files: how many tensors of a real model's checkpoint start at a multiple of
N bytes in the file, saved in the format's order (the reference's, fastst's default)
and with ``align=N``; and what the alignment costs (the header's padding).

    python bench/align.py                    # the table, as markdown

Nothing is downloaded and no weights are made: each model is built from its
transformers config on the meta device, and only its state dict's names, dtypes and
shapes are planned (``plan_write`` of declared tensors), as ``save_model`` would
save them (tied weights once, ``{"format": "pt"}`` metadata).
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

ALIGNMENTS = (64, 256, 4096)
Layout = List[Tuple[str, str, Tuple[int, ...]]]


def model_layouts() -> Dict[str, Layout]:
    """name -> [(tensor, dtype code, shape)] of each model's state dict."""
    import torch
    import transformers

    from fastst._format.torch_dtypes import codes_of_torch

    configs = {
        "GPT-2 small (F32)": (transformers.GPT2Config(), torch.float32),
        "Qwen2-0.5B shapes (BF16)": (transformers.Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
            tie_word_embeddings=True), torch.bfloat16),
        "Llama-2-7B shapes (BF16)": (transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
            num_attention_heads=32, vocab_size=32000), torch.bfloat16),
    }
    layouts = {}
    for label, (config, dtype) in configs.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        seen = set()
        layout = []
        for name, tensor in model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:      # a tied weight: saved once
                continue
            seen.add(id(tensor))
            layout.append((name, codes_of_torch()[tensor.dtype], tuple(tensor.shape)))
        layouts[label] = layout
    return layouts


def aligned_count(plan, names, align: int) -> int:
    return sum((plan.data_start + plan.info(name).data_offsets[0]) % align == 0
               for name in names)


def rows(layouts: Dict[str, Layout]) -> List[List[str]]:
    from fastst.writer import plan_write

    table = []
    for label, layout in layouts.items():
        names = [name for name, _, _ in layout]
        default = plan_write(layout, {"format": "pt"})
        data_bytes = default.total_size - default.data_start
        for align in ALIGNMENTS:
            aligned = plan_write(layout, {"format": "pt"}, align=align)
            padded = plan_write([layout[names.index(name)] for name in default.names()],
                                {"format": "pt"}, align=align, keep_order=True)
            table.append([
                label if align == ALIGNMENTS[0] else "", str(len(layout)), str(align),
                f"{aligned_count(default, names, align)}",
                f"{aligned_count(padded, names, align)}",
                f"{aligned_count(aligned, names, align)}",
                f"{aligned.data_start - default.data_start}",
                f"{_aligned_share(padded, layout, align, data_bytes):.2%}",
                f"{_aligned_share(aligned, layout, align, data_bytes):.2%}"])
    return table


def _aligned_share(plan, layout: Layout, align: int, data_bytes: int) -> float:
    """The share of the data bytes that lie in tensors starting aligned."""
    total = 0
    for name, _, _ in layout:
        begin, end = plan.info(name).data_offsets
        if (plan.data_start + begin) % align == 0:
            total += end - begin
    return total / data_bytes


HEADERS = ["model", "tensors", "N", "aligned: format's order", "header padded",
           "align=N",
           "header bytes added",
           "bytes aligned: header padded", "bytes aligned: align=N"]


def markdown(table: List[List[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(markdown(rows(model_layouts())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
