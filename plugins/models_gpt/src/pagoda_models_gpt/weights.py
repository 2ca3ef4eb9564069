"""Hugging Face checkpoint names and layouts -> the parameters of the GPT-family model.

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
  ``qkv_proj``); the owning module's ``shard_sizes`` gives each part's row count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

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


def substitute(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    """``name`` with each (old, new) pair applied in order: "."-led parts anywhere, others as a prefix."""
    for old, new in pairs:
        if old.startswith("."):
            name = name.replace(old, new)
        elif name.startswith(old):
            name = new + name[len(old) :]
    return name


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


class _Packed(Protocol):
    """A module owning fused projections: the row count of each stacked checkpoint projection, per fused name."""

    shard_sizes: dict[str, list[int]]


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, or one shard (rows) of it."""

    param_name: str
    shard: int  # 0 for a whole parameter
    tensor: torch.Tensor


class _Loader:
    def __init__(self, model: GPTFamilyForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.renames = model.checkpoint_renames
        self.inverse = [(new, old) for old, new in reversed(self.renames)]
        self.packed = model.packed_modules_mapping
        self.shard_of = {part: (fused, i) for fused, parts in self.packed.items() for i, part in enumerate(parts)}
        # parameter -> how many shards fill it (1 unless stacked from several checkpoint tensors)
        self.expected = {name: 1 for name in self.params}
        for name in self.params:
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.packed:
                self.expected[name] = len(self.packed[parts[-2]])
        self.filled: dict[str, set[int]] = {}

    def target(self, name: str) -> _Target | None:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.shard_of:
            fused, shard = self.shard_of[parts[-2]]
            owner = ".".join(parts[:-2])
            fused_name = f"{owner}.{fused}.{parts[-1]}"
            param = self.params.get(fused_name)
            if param is None:
                return None
            sizes = cast(_Packed, self.model.get_submodule(owner)).shard_sizes[fused]
            return _Target(fused_name, shard, param.data.narrow(0, sum(sizes[:shard]), sizes[shard]))
        param = self.params.get(name)
        return None if param is None else _Target(name, 0, param.data)

    def missing(self) -> list[str]:
        """Checkpoint names (under the checkpoint's own naming) never filled."""
        names: list[str] = []
        for pname, count in self.expected.items():
            if self.model.tie_word_embeddings and pname == "lm_head.weight":
                continue
            unfilled = sorted(set(range(count)) - self.filled.get(pname, set()))
            if not unfilled:
                continue
            parts = pname.split(".")
            stacked = self.packed.get(parts[-2], []) if len(parts) >= 2 and count > 1 else []
            if stacked:
                names.extend(".".join([*parts[:-2], stacked[i], parts[-1]]) for i in unfilled)
            else:
                names.append(pname)
        return [substitute(name, self.inverse) for name in names]


def load_gpt_weights(model: GPTFamilyForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names, shape mismatches and parameters left unfilled raise ``ValueError`` naming the
    weight: parameters start uninitialised (``torch.empty``). With tied embeddings the LM head's
    weight is skipped (it is the embedding).
    """
    loader = _Loader(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            renamed = substitute(model.normalize_checkpoint_name(name), loader.renames)
            if model.tie_word_embeddings and renamed == "lm_head.weight":
                continue
            target = loader.target(renamed)
            if target is None:
                raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}")
            tensor = model.convert_checkpoint_tensor(renamed, tensor)
            if tuple(target.tensor.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.tensor.shape)}"
                )
            target.tensor.copy_(tensor)
            loader.filled.setdefault(target.param_name, set()).add(target.shard)
            loaded.add(name)
    missing = loader.missing()
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded
