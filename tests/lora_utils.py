"""Tiny PEFT adapters for the LoRA tests: made with the peft library on a transformers model, both factors random."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch


def make_adapter(hf_model: Any, path: Path, *, r: int, target_modules: list[str] | str, seed: int,
                 lora_alpha: float = 16.0, use_rslora: bool = False, **extra: Any) -> Any:
    """Save a PEFT LoRA adapter of ``hf_model`` at ``path``; returns transformers + peft's merged model.

    peft initialises B to zero (the adapter starts as a no-op): both factors are drawn at random here so
    every adapted layer changes the output.
    """
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(hf_model)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=True, **extra)
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(str(path))
    return peft_model.merge_and_unload().eval()
