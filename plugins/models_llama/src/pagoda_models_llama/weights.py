"""Hugging Face checkpoint names -> the fused parameters of the Llama-family model.

Three tables decide where a checkpoint tensor goes:

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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from pagoda.distributed.pipeline import is_pp_missing_parameter

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


def _shard_sizes(model: LlamaForCausalLM, fused: str, rows: int, num_shards: int) -> list[int]:
    """Row counts of the checkpoint projections stacked into a fused weight of ``rows`` rows."""
    if fused == "qkv_proj":
        cfg = model.config
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        kv_size = (getattr(cfg, "num_key_value_heads", None) or num_heads) * head_dim
        return [num_heads * head_dim, kv_size, kv_size]
    # gate_up_proj: equal halves (dense MLP, each expert and the shared expert have their own width)
    return [rows // num_shards] * num_shards


def _split_stacked_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    match = _STACKED_EXPERTS.match(name)
    if match is None or tensor.ndim != 3:
        yield name, tensor
        return
    for expert in range(tensor.shape[0]):
        yield f"{match['prefix']}.{expert}.{match['proj']}.weight", tensor[expert]


class _Loader:
    """Resolves names to parameter slices and records which shards of each parameter were filled."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.packed = model.packed_modules_mapping
        self.shard_of = {part: (fused, i) for fused, parts in self.packed.items() for i, part in enumerate(parts)}
        self.renames = [(re.compile(pattern), repl) for pattern, repl in model.checkpoint_renames]
        self.filled: dict[str, set[int]] = {}

    def rename(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = pattern.sub(repl, name)
        return name

    def target(self, name: str) -> tuple[str, int | None, torch.Tensor] | None:
        """(parameter name, shard or None for the whole parameter, the tensor to fill) for a checkpoint name."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.shard_of:
            fused, shard = self.shard_of[parts[-2]]
            fused_name = ".".join([*parts[:-2], fused, parts[-1]])
            param = self.params.get(fused_name)
            if param is None:
                return None
            if hasattr(param, "weight_loader"):  # a quantization method's parameter takes each shard itself
                return fused_name, shard, param
            sizes = _shard_sizes(self.model, fused, param.shape[0], len(self.packed[fused]))
            return fused_name, shard, param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
        param = self.params.get(name)
        return None if param is None else (name, None, param.data)

    def num_shards(self, param_name: str) -> int:
        parts = param_name.split(".")
        return len(self.packed[parts[-2]]) if len(parts) >= 2 and parts[-2] in self.packed else 1

    def mark(self, param_name: str, shard: int | None) -> None:
        shards = range(self.num_shards(param_name)) if shard is None else (shard,)
        self.filled.setdefault(param_name, set()).update(shards)

    def missing(self) -> list[str]:
        """Checkpoint names (split projection names where the model stacks them) never filled."""
        names: list[str] = []
        for pname in self.params:
            if self.model.tie_word_embeddings and pname == "lm_head.weight":
                continue
            count = self.num_shards(pname)
            unfilled = sorted(set(range(count)) - self.filled.get(pname, set()))
            if not unfilled:
                continue
            parts = pname.split(".")
            if count > 1:
                hf_parts = self.packed[parts[-2]]
                names.extend(".".join([*parts[:-2], hf_parts[i], parts[-1]]) for i in unfilled)
            else:
                names.append(pname)
        return names


def load_llama_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy each (HF name, tensor) into the model, casting to its dtype; return the HF names consumed.

    Unknown names and shape mismatches raise ``ValueError`` naming the weight:
    a silently skipped weight would leave uninitialised memory in the model.
    With tied embeddings ``lm_head.weight`` is skipped (it is the embedding).
    """
    loader = _Loader(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if model.tie_word_embeddings and name == "lm_head.weight":
                continue
            for piece_name, piece in _split_stacked_experts(loader.rename(name), tensor):
                found = loader.target(piece_name)
                if found is None:
                    if is_pp_missing_parameter(piece_name, model):
                        continue  # another pipeline stage holds it
                    raise ValueError(f"checkpoint weight {name!r} matches no parameter of {type(model).__name__}")
                param_name, shard, target = found
                weight_loader = getattr(loader.params[param_name], "weight_loader", None)
                if weight_loader is not None:
                    # pagoda.quantization: the method's parameter stores the checkpoint tensor in its own form
                    try:
                        weight_loader(loader.params[param_name], piece, shard)
                    except ValueError as exc:
                        raise ValueError(f"checkpoint weight {name!r}: {exc}") from exc
                    loader.mark(param_name, shard)
                    continue
                if tuple(target.shape) != tuple(piece.shape):
                    raise ValueError(
                        f"checkpoint weight {name!r} has shape {tuple(piece.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                target.copy_(piece)
                loader.mark(param_name, shard)
            loaded.add(name)
    missing = loader.missing()
    if missing:
        # parameters start uninitialised (torch.empty): a gap would be garbage, not an error later
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
    return loaded
