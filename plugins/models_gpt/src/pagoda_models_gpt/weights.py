"""Hugging Face checkpoint names and layouts -> the parameters of the GPT-family model (core's ``AutoWeightsLoader``).

The model has one set of parameter names for GPT-2, OPT and Falcon
(``model.embed_tokens``, ``model.embed_positions``, ``model.layers.N.self_attn.qkv_proj``,
``o_proj``, ``mlp.fc1`` / ``fc2``, ``input_layernorm``, ``post_attention_layernorm``,
``model.norm``). What a checkpoint tensor becomes is decided, in this order, by:

* ``normalize_checkpoint_name`` (a model method): the hub's base-model names
  (GPT-2's ``h.0.attn.c_attn``, OPT's ``decoder.layers.0``) get the prefix
  transformers' causal-LM class puts in front;
* ``checkpoint_renames`` (class attribute): (checkpoint part, model part)
  string pairs applied in order; a part starting with "." is replaced wherever
  it occurs, any other only as the name's prefix. Plain strings, so the table
  also runs backwards and a missing weight is reported under the checkpoint's
  own name;
* ``convert_checkpoint_tensor`` (a model method, after renaming): a layout
  change: GPT-2's Conv1D weights are [in, out] and are transposed; Falcon's
  fused query_key_value rows are regrouped to [all q; all k; all v];
* ``packed_modules_mapping`` (class attribute, vLLM's name): projections the
  checkpoint stores apart and the model stacks into one weight (OPT's q/k/v ->
  ``qkv_proj``).

These feed core's ``AutoWeightsLoader``; each parameter's own ``weight_loader``
(core's tensor-parallel layers) takes this rank's part of the tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from pagoda.model_loader.auto_weights_loader import load_renamed_checkpoint

if TYPE_CHECKING:
    from pagoda_models_gpt.gpt import GPTFamilyForCausalLM

QKV_PROJ: dict[str, list[str]] = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

GPT2_RENAMES: tuple[tuple[str, str], ...] = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.wpe.", "model.embed_positions."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".attn.c_attn.", ".self_attn.qkv_proj."),
    (".attn.c_proj.", ".self_attn.o_proj."),
    (".mlp.c_fc.", ".mlp.fc1."),
    (".mlp.c_proj.", ".mlp.fc2."),
)
OPT_RENAMES: tuple[tuple[str, str], ...] = (
    ("model.decoder.", "model."),
    ("model.final_layer_norm.", "model.norm."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn_layer_norm.", ".input_layernorm."),
    (".final_layer_norm.", ".post_attention_layernorm."),
    (".fc1.", ".mlp.fc1."),
    (".fc2.", ".mlp.fc2."),
)
FALCON_RENAMES: tuple[tuple[str, str], ...] = (
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.ln_f.", "model.norm."),
    ("transformer.h.", "model.layers."),
    (".self_attention.query_key_value.", ".self_attn.qkv_proj."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.fc2."),
)
# new_decoder_architecture's two norms (before attention, before the MLP); only for that layout,
# so that a missing post_attention_layernorm is reported under its own name elsewhere
FALCON_TWO_NORM_RENAMES: tuple[tuple[str, str], ...] = (
    (".ln_attn.", ".input_layernorm."),
    (".ln_mlp.", ".post_attention_layernorm."),
)

# Buffers some checkpoints carry that the engine recomputes (GPT-2's causal mask and its fill value,
# a rotary table).
SKIPPED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def regroup_fused_qkv(tensor: torch.Tensor, layout: str, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Falcon's fused query_key_value rows (weight or bias) -> [all q; all k; all v].

    per_head (classic MHA): rows are [heads, 3, head_dim] (q, k, v of head 0, then head 1 ...);
    per_kv_group (new_decoder_architecture): [kv_heads, heads / kv_heads + 2, head_dim], each
    group's query heads, then its key, then its value. Query head ``g * group + j`` stays
    query head ``g * group + j``, so it keeps sharing KV head ``g`` as transformers broadcasts it.
    """
    rest = tuple(tensor.shape[1:])
    if layout == "per_head":
        return tensor.reshape(num_heads, 3, head_dim, *rest).transpose(0, 1).reshape(tensor.shape)
    if layout == "per_kv_group":
        group = num_heads // num_kv_heads
        grouped = tensor.reshape(num_kv_heads, group + 2, head_dim, *rest)
        q = grouped[:, :group].reshape(num_heads * head_dim, *rest)
        k = grouped[:, group].reshape(num_kv_heads * head_dim, *rest)
        v = grouped[:, group + 1].reshape(num_kv_heads * head_dim, *rest)
        return torch.cat([q, k, v])
    return tensor


def load_gpt_weights(model: GPTFamilyForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names, tensors a layer cannot take and parameters left unfilled raise ``ValueError`` naming the
    weight: parameters start uninitialised (``torch.empty``). With tied embeddings the LM head's
    weight is skipped (it is the embedding).
    """
    return load_renamed_checkpoint(model, weights, SKIPPED_SUFFIXES)
