"""Hugging Face checkpoint names -> the Gemma model, through core's ``AutoWeightsLoader``.

q/k/v are stacked into ``qkv_proj`` and gate/up into ``gate_up_proj``
(``FUSED_PROJECTIONS``, in row order); every ``GemmaRMSNorm`` adds the 1 to its
checkpoint weight in its own ``weight_loader`` (see ``norm.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader

if TYPE_CHECKING:
    from pagoda_models_gemma.gemma import GemmaForCausalLM

# fused parameter -> the checkpoint projections stacked into it, in row order (vLLM's packed_modules_mapping)
FUSED_PROJECTIONS: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

# Buffers some checkpoints carry that the engine recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "embed_tokens.embed_scale")


def load_gemma_weights(model: GemmaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load every (HF name, tensor) into the model; return the HF names consumed.

    Unknown names, tensors a layer cannot take and parameters left unfilled raise ``ValueError``
    naming the weight. With tied embeddings ``lm_head.weight`` is skipped (it is the embedding).
    """
    return AutoWeightsLoader(
        model,
        packed_modules_mapping=model.packed_modules_mapping,
        skip_suffixes=_SKIPPED_SUFFIXES,
        skip_names={"lm_head.weight"} if model.tie_word_embeddings else (),
    ).load_weights(weights)
