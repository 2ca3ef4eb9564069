"""Mixture-of-experts MLP over a flat token batch: router top-k, tokens grouped by expert.

``FusedMoE`` is one MoE MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE): a router
``gate`` (a ``Linear`` to ``num_experts`` logits), ``experts`` (a list of gated
MLPs, each a fused ``gate_up_proj`` and a ``down_proj``) and, for Qwen2-MoE, a
``shared_expert`` that every token goes through, scaled by
``sigmoid(shared_expert_gate(x))``.

A step's tokens are sorted by the expert they were routed to (one argsort and
one bincount for the whole batch), so each expert runs as one matmul pair over
all of its tokens; one gather puts the outputs back in (token, k) order and a
weighted sum over k combines them. Python loops only over the experts that
received tokens, never over tokens. Every projection is a ``pagoda.layers.Linear``, so after loading the
platform's linear kernel (``prepare_linear_layers``: on CPU the packed GEMM)
serves the experts like any other layer, with no MoE-specific kernel.

With tensor parallelism each expert is split as vLLM splits it: every rank
holds every expert, with the expert's intermediate dim divided across the ranks
(``gate_up_proj`` column-parallel, ``down_proj`` row-parallel); each rank's
experts and shared expert produce partial sums, reduced with one all-reduce per
block. The router (``gate``) and ``shared_expert_gate`` are replicated.

Unlike vLLM's ``FusedMoE``, which takes router logits from the model, this
layer holds its router and shared expert: a family's MoE block is this one
layer, with the Hugging Face parameter names (``gate``, ``experts.N``,
``shared_expert``, ``shared_expert_gate``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagoda.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from pagoda.layers.activation import gated_activation
from pagoda.layers.parallel_linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down_proj(act(gate) * up)`` with gate and up as one fused ``gate_up_proj`` (gate rows first).

    Tensor-parallel: the intermediate dim split across ranks; ``reduce_results=False`` leaves the
    partial sum for the caller to reduce (once for all of a MoE block's experts).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype,
                 *, reduce_results: bool = True) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, reduce_results=reduce_results)
        self.act_fn = gated_activation(hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden)))


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, then the ``top_k`` best: (weights [T, k] float32, expert ids [T, k]).

    ``renormalize`` rescales each token's k weights to sum to 1 (Mixtral always,
    Qwen-MoE when ``norm_topk_prob``), as transformers' routers do.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, experts: Iterable[nn.Module]
) -> torch.Tensor:
    """sum_k weight[t, k] * experts[id[t, k]](hidden[t]) for every token t: [T, H] -> [T, H].

    Token-expert pairs are sorted by expert, so each expert sees its tokens as
    one contiguous [n_e, H] block (one gate_up and one down matmul). The outputs
    go back to (token, k) order with one gather and are summed over k; CPU
    ``index_add_`` (a serial scatter-add) took 8 ms a call here, most of a step.
    """
    experts = list(experts)
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    sorted_hidden = hidden.index_select(0, order // top_k)
    sorted_out = torch.empty_like(sorted_hidden)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            sorted_out[start : start + count] = expert(sorted_hidden[start : start + count])
            start += count
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = sorted_out.index_select(0, inverse).view(num_tokens, top_k, hidden.shape[-1])
    # k-th term added in k order: for top-2 bit-identical to transformers' accumulation
    return (per_slot * topk_weights.to(hidden.dtype).unsqueeze(-1)).sum(dim=1)


class FusedMoE(nn.Module):
    """A sparse MoE MLP block: router, ``num_experts`` gated experts, optional gated shared expert."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        hidden_act: str = "silu",
        shared_expert_intermediate_size: int = 0,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_size = get_tensor_model_parallel_world_size()
        self.gate = ReplicatedLinear(hidden_size, num_experts, False, dtype)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, hidden_act, dtype, reduce_results=False)
            for _ in range(num_experts)
        )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: ReplicatedLinear | None = None
        if shared_expert_intermediate_size > 0:
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, hidden_act, dtype,
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, False, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, H]."""
        topk_weights, topk_ids = fused_topk(self.gate(hidden), self.top_k, self.renormalize)
        out = fused_experts(hidden, topk_weights, topk_ids, self.experts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(hidden) * torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + shared
        if self.tp_size > 1:
            # the gate scales each token's partial shared-expert sum: reducing after it is the same sum
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}"
