"""Hugging Face checkpoint names -> the parameters of the NeoX-family model.

The model has one set of parameter names for all three architectures
(``model.layers.N.self_attn.qkv_proj``, ``o_proj``, ``mlp.fc1`` ...). What a
checkpoint tensor becomes is decided, in this order, by:

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
  ``qkv_proj``, gate/up -> ``gate_up_proj``); the owning module's
  ``shard_sizes`` gives each part's row count. GPT-NeoX's checkpoint stores
  qkv fused already, so its mapping is empty;
* ``norms.<h>`` under a ``PerHeadLayerNorm`` (StableLM's per-head q/k norms):
  row ``h`` of that module's [heads, head_dim] parameter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

from pagoda.layers import PerHeadLayerNorm

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
PHI_RENAMES: tuple[tuple[str, str], ...] = (
    (".self_attn.dense.", ".self_attn.o_proj."),
    ("model.final_layernorm.", "model.norm."),
)

# Buffers some checkpoints carry that the engine recomputes (GPT-NeoX's causal mask and its fill value).
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", ".attention.bias", ".attention.masked_bias")
_PER_HEAD = re.compile(r"^(?P<owner>.*)\.norms\.(?P<head>\d+)\.(?P<kind>weight|bias)$")


def substitute(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    """``name`` with each (old, new) pair applied in order: "."-led parts anywhere, others as a prefix."""
    for old, new in pairs:
        if old.startswith("."):
            name = name.replace(old, new)
        elif name.startswith(old):
            name = new + name[len(old) :]
    return name


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
    def __init__(self, model: NeoXFamilyForCausalLM) -> None:
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
        for prefix, module in model.named_modules():
            if isinstance(module, PerHeadLayerNorm):
                for kind, param in module.named_parameters():
                    self.expected[f"{prefix}.{kind}"] = param.shape[0]
        self.filled: dict[str, set[int]] = {}

    def rename(self, name: str) -> str:
        return substitute(name, self.renames)

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
        per_head = _PER_HEAD.match(name)
        if per_head is not None:
            param_name = f"{per_head['owner']}.{per_head['kind']}"
            param = self.params.get(param_name)
            head = int(per_head["head"])
            if param is None or self.expected[param_name] == 1 or head >= param.shape[0]:
                return None
            return _Target(param_name, head, param.data[head])
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
            elif count > 1:
                names.extend(".".join([*parts[:-1], "norms", str(i), parts[-1]]) for i in unfilled)
            else:
                names.append(pname)
        return [substitute(name, self.inverse) for name in names]


def load_neox_weights(model: NeoXFamilyForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names, shape mismatches and parameters left unfilled raise ``ValueError`` naming the
    weight: parameters start uninitialised (``torch.empty``). With tied embeddings the LM head's
    weight is skipped (it is the embedding).
    """
    loader = _Loader(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            renamed = loader.rename(name)
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
