"""Hugging Face checkpoint names -> the parameters of the NeoX-family model, through core's ``AutoWeightsLoader``.

The model has one set of parameter names for all three architectures
(``model.layers.N.self_attn.qkv_proj``, ``o_proj``, ``mlp.fc1`` ...). What the
family adds to the shared loader, in the order it applies:

* ``checkpoint_renames`` (a model class attribute): (checkpoint part, model
  part) string pairs, applied in order, e.g. GPT-NeoX's
  ``gpt_neox.layers.N.attention.query_key_value`` -> ``model.layers.N.self_attn.qkv_proj``.
  A part starting with "." is replaced wherever it occurs, any other only as
  the name's prefix; plain strings, so that the table also runs backwards and
  a missing weight is reported under the checkpoint's own name;
* ``convert_checkpoint_tensor`` (a model method, after renaming): a layout
  change, e.g. GPT-NeoX's per-head interleaved fused qkv rows -> [q; k; v];
* ``packed_modules_mapping`` (class attribute, vLLM's name): projections the
  checkpoint stores apart and the model stacks into one weight (q/k/v ->
  ``qkv_proj``, gate/up -> ``gate_up_proj``). GPT-NeoX's checkpoint stores
  qkv fused already, so its mapping is empty;

and core's ``PerHeadLayerNorm`` (StableLM's per-head q/k norms) declares its
``norms.<h>`` tensors itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pagoda.model_loader.auto_weights_loader import load_renamed_checkpoint

if TYPE_CHECKING:
    from pagoda_models_neox.neox import NeoXFamilyForCausalLM

QKV_PROJ: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
GATE_UP_PROJ: dict[str, list[str]] = {"gate_up_proj": ["gate_proj", "up_proj"]}

# GPT-NeoX checkpoint names (the hub's; transformers 5's state_dict says lm_head for embed_out).
GPT_NEOX_RENAMES: tuple[tuple[str, str], ...] = (
    ("gpt_neox.embed_in.", "model.embed_tokens."),
    ("gpt_neox.final_layer_norm.", "model.norm."),
    ("gpt_neox.layers.", "model.layers."),
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.fc2."),
    ("embed_out.", "lm_head."),
)
# Phi's and StableLM's q/k norms are core's RotaryAttention's q_norm / k_norm
QK_NORM_RENAMES: tuple[tuple[str, str], ...] = (
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)
PHI_RENAMES: tuple[tuple[str, str], ...] = (
    (".self_attn.dense.", ".self_attn.o_proj."),
    ("model.final_layernorm.", "model.norm."),
    *QK_NORM_RENAMES,
)
STABLELM_RENAMES: tuple[tuple[str, str], ...] = QK_NORM_RENAMES

# Buffers some checkpoints carry that the engine recomputes (GPT-NeoX's causal mask and its fill value).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")


def load_neox_weights(model: NeoXFamilyForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names, tensors a layer cannot take and parameters left unfilled raise ``ValueError`` naming the
    weight: parameters start uninitialised (``torch.empty``). With tied embeddings the LM head's
    weight is skipped (it is the embedding).
    """
    return load_renamed_checkpoint(model, weights, _SKIPPED_SUFFIXES)
