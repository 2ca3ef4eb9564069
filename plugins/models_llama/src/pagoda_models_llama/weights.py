"""Hugging Face checkpoint names -> the Llama-family model, through core's ``AutoWeightsLoader``.

What the family adds to the shared loader:

* ``packed_modules_mapping`` (a model class attribute, ``FUSED_PROJECTIONS`` by
  default): projections the checkpoint stores apart and the model stacks into
  one weight (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``), in row order.
  A checkpoint that already stores the fused weight (Phi-3) loads it directly.
* ``checkpoint_renames`` (class attribute): regex renames applied first, e.g.
  Mixtral's ``block_sparse_moe.experts.N.w1`` -> ``mlp.experts.N.gate_proj``.
* ``_STACKED_EXPERTS``: transformers 5 keeps a MoE layer's experts as 3-D
  tensors in ``state_dict()`` (``mlp.experts.gate_up_proj`` [E, 2I, H],
  ``mlp.experts.down_proj`` [E, H, I]); each slice ``[e]`` fills expert ``e``.
  (``save_pretrained`` writes the per-expert names that hub checkpoints use;
  both layouts load.)

Each parameter's own ``weight_loader`` (core's tensor-parallel layers, a
quantization method's parameters) takes this rank's part of the tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from pagoda.model_loader.auto_weights_loader import AutoWeightsLoader

if TYPE_CHECKING:
    from pagoda_models_llama.llama import LlamaForCausalLM

FUSED_PROJECTIONS: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}

# Mixtral hub checkpoints: the MoE block is ``block_sparse_moe`` and an expert's gate/down/up are w1/w2/w3.
MIXTRAL_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.block_sparse_moe\.", ".mlp."),
    (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
)

# transformers 5 state_dict: all experts of a layer in one 3-D tensor per projection.
_STACKED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")

# Buffers some checkpoints carry that the engine recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _split_stacked_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    match = _STACKED_EXPERTS.match(name)
    if match is None or tensor.ndim != 3:
        yield name, tensor
        return
    for expert in range(tensor.shape[0]):
        yield f"{match['prefix']}.{expert}.{match['proj']}.weight", tensor[expert]


def load_llama_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Load every (HF name, tensor) into the model; return the HF names consumed.

    Unknown names, tensors a layer cannot take and parameters left unfilled raise ``ValueError``
    naming the weight. With tied embeddings ``lm_head.weight`` is skipped (it is the embedding).
    """
    renames = [(re.compile(pattern), repl) for pattern, repl in model.checkpoint_renames]

    def rename(name: str) -> str:
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        return name

    loader = AutoWeightsLoader(
        model,
        packed_modules_mapping=model.packed_modules_mapping,
        skip_suffixes=_SKIPPED_SUFFIXES,
        skip_names={"lm_head.weight"} if model.tie_word_embeddings else (),
        name_mapper=rename,
        tensor_mapper=_split_stacked_experts,
    )
    return loader.load_weights(weights)
