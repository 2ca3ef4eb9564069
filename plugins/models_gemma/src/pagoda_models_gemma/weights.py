"""Hugging Face checkpoint names -> the Gemma model's parameters.

Two things differ from a name-for-name copy:

* ``FUSED_PROJECTIONS``: q/k/v are stacked into ``qkv_proj`` and gate/up into
  ``gate_up_proj``, in row order; the owning module's ``shard_sizes`` gives the
  row count of each part.
* Every ``GemmaRMSNorm`` weight is stored as ``scale - 1``; the 1 is added here,
  in float32, before the cast to the model dtype. In float32 the result is the
  very ``1.0 + weight.float()`` transformers multiplies by, so the norm is
  unchanged. In bfloat16 transformers keeps ``1 + weight`` and the normalised
  activations in float32 and rounds once, after the product; here ``1 + weight``
  is rounded to bfloat16 at load time and core's RMSNorm rounds the normalised
  activations before the product (as Llama's does), so a Gemma norm's bfloat16
  output may differ from transformers' by one or two bfloat16 ulps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from pagoda_models_gemma.norm import GemmaRMSNorm

if TYPE_CHECKING:
    from pagoda_models_gemma.gemma import GemmaForCausalLM

# fused parameter -> the checkpoint projections stacked into it, in row order (vLLM's packed_modules_mapping)
FUSED_PROJECTIONS: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
_SHARD_OF = {part: (fused, i) for fused, parts in FUSED_PROJECTIONS.items() for i, part in enumerate(parts)}


class _Packed(Protocol):
    """A module owning fused projections: the row count of each stacked checkpoint projection, per fused name."""

    shard_sizes: dict[str, list[int]]


# Buffers some checkpoints carry that the engine recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "embed_tokens.embed_scale")


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, or one shard of a fused one."""

    param_name: str
    shard: int | None  # None: the whole parameter
    tensor: torch.Tensor
    norm_offset: bool  # a GemmaRMSNorm weight: add 1


def _target(model: GemmaForCausalLM, params: Mapping[str, torch.Tensor], norms: set[str], name: str) -> _Target | None:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _SHARD_OF:
        fused, shard = _SHARD_OF[parts[-2]]
        owner = ".".join(parts[:-2])
        fused_name = f"{owner}.{fused}.{parts[-1]}"
        param = params.get(fused_name)
        if param is None:
            return None
        sizes = cast(_Packed, model.get_submodule(owner)).shard_sizes[fused]
        return _Target(fused_name, shard, param.data.narrow(0, sum(sizes[:shard]), sizes[shard]), False)
    param = params.get(name)
    return None if param is None else _Target(name, None, param.data, name in norms)


def load_gemma_weights(model: GemmaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names, shape mismatches and parameters left unfilled raise ``ValueError`` naming the
    weight: parameters start uninitialised (``torch.empty``). With tied embeddings
    ``lm_head.weight`` is skipped (it is the embedding).
    """
    params = dict(model.named_parameters())
    norms = {f"{prefix}.weight" for prefix, module in model.named_modules() if isinstance(module, GemmaRMSNorm)}
    filled: dict[str, set[int]] = {}
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if model.tie_word_embeddings and name == "lm_head.weight":
                continue
            target = _target(model, params, norms, name)
            if target is None:
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}")
            if tuple(target.tensor.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.tensor.shape)}"
                )
            target.tensor.copy_(tensor.float() + 1.0 if target.norm_offset else tensor)
            filled.setdefault(target.param_name, set()).add(0 if target.shard is None else target.shard)
            loaded.add(name)
    missing = _missing(model, params, filled)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded


def _missing(model: GemmaForCausalLM, params: Mapping[str, torch.Tensor], filled: dict[str, set[int]]) -> list[str]:
    """Checkpoint names (split projection names where the model stacks them) never filled."""
    names: list[str] = []
    for pname in params:
        if model.tie_word_embeddings and pname == "lm_head.weight":
            continue
        parts = pname.split(".")
        stacked = FUSED_PROJECTIONS.get(parts[-2], []) if len(parts) >= 2 else []
        expected = range(len(stacked)) if stacked else range(1)
        unfilled = sorted(set(expected) - filled.get(pname, set()))
        if stacked:
            names.extend(".".join([*parts[:-2], stacked[i], parts[-1]]) for i in unfilled)
        elif unfilled:
            names.append(pname)
    return names
