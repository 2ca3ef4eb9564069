"""Hugging Face checkpoint names -> the fused parameters of the Llama-family model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagoda_models_llama.llama import LlamaForCausalLM

# Buffers some checkpoints carry that the engine recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _stacked_rows(model: LlamaForCausalLM) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (fused parameter name, first row, row count) inside the fused weight."""
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    q_size = num_heads * head_dim
    kv_size = (getattr(cfg, "num_key_value_heads", None) or num_heads) * head_dim
    inter = cfg.intermediate_size
    return {
        "q_proj": ("qkv_proj", 0, q_size),
        "k_proj": ("qkv_proj", q_size, kv_size),
        "v_proj": ("qkv_proj", q_size + kv_size, kv_size),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


def _target(
    name: str, params: dict[str, torch.nn.Parameter], stacked: dict[str, tuple[str, int, int]]
) -> torch.Tensor | None:
    """The parameter (or the row slice of a fused parameter) that HF weight ``name`` fills."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in stacked:
        fused, first_row, rows = stacked[parts[-2]]
        fused_name = ".".join([*parts[:-2], fused, parts[-1]])
        param = params.get(fused_name)
        return None if param is None else param.data.narrow(0, first_row, rows)
    param = params.get(name)
    return None if param is None else param.data


def load_llama_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names and shape mismatches raise ``ValueError`` naming the weight:
    a silently skipped weight would leave uninitialised memory in the model.
    With tied embeddings ``lm_head.weight`` is skipped (it is the embedding).
    """
    params = dict(model.named_parameters())
    stacked = _stacked_rows(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if model.tie_word_embeddings and name == "lm_head.weight":
                continue
            target = _target(name, params, stacked)
            if target is None:
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
    missing = sorted(expected_checkpoint_names(model, stacked) - loaded)
    if missing:
        # parameters start uninitialised (torch.empty): a gap would be garbage, not an error later
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded


def expected_checkpoint_names(model: LlamaForCausalLM, stacked: dict[str, tuple[str, int, int]]) -> set[str]:
    """Every HF name the checkpoint must provide for this model's parameters."""
    by_fused: dict[str, list[str]] = {}
    for hf_part, (fused, _, _) in stacked.items():
        by_fused.setdefault(fused, []).append(hf_part)
    names: set[str] = set()
    for pname, _ in model.named_parameters():
        parts = pname.split(".")
        if len(parts) >= 2 and parts[-2] in by_fused:
            names.update(".".join([*parts[:-2], hf, parts[-1]]) for hf in by_fused[parts[-2]])
        else:
            names.add(pname)
    if model.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names
