"""The LoRA pieces on their own: the request record, the PEFT reader's refusals, the torch shrink/expand
kernel against a per-token loop, slot writes of packed layers, and the server's --lora-modules parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda.lora.layers import LoRASlots, LoRAStepState
from pagoda.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError, read_peft_config
from pagoda.lora.punica import TORCH_LORA_KERNEL, build_step_mapping
from pagoda.lora.request import LoRARequest


def test_lora_request_checks_and_equality() -> None:
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
    assert LoRARequest("a", 1, "/x") == LoRARequest("a", 2, "/y")  # vLLM: same name, same adapter
    assert len({LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/x")}) == 2


def _config(tmp_path: Path, **fields) -> Path:
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **fields}
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(("fields", "text"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"r": 64}, "max_lora_rank=16"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": []}, "target_modules"),
])
def test_peft_config_refusals(tmp_path: Path, fields: dict, text: str) -> None:
    with pytest.raises(LoRAAdapterError, match=text) as info:
        read_peft_config("mine", _config(tmp_path, **fields), 16)
    assert "'mine'" in str(info.value)


def test_peft_config_scaling_and_missing(tmp_path: Path) -> None:
    assert read_peft_config("a", _config(tmp_path), 16).scaling == 2.0
    assert read_peft_config("a", _config(tmp_path, use_rslora=True, r=4), 16).scaling == 8.0
    assert read_peft_config("a", _config(tmp_path, target_modules=r".*\.q_proj"), 16).targets("model.layers.0.q_proj")
    with pytest.raises(LoRAAdapterNotFoundError):
        read_peft_config("a", tmp_path / "nowhere", 16)


def _block_diagonal_factors(gen: torch.Generator, slots: int, rank: int, d_in: int,
                            widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random slot factors in ``LoRASlots``' layout: each stacked slice's rank block only in its columns of B."""
    block = rank * len(widths)
    a = torch.randn(slots * block, d_in, generator=gen)
    b = torch.zeros(slots * block, sum(widths))
    for s in range(slots):
        lo = 0
        for i, w in enumerate(widths):
            rows = slice(s * block + i * rank, s * block + (i + 1) * rank)
            b[rows, lo:lo + w] = torch.randn(rank, w, generator=gen)
            lo += w
    return a, b


# (token slots, expected plan): sorted/unsorted, base rows, an unused slot, one slot, unbalanced segments
KERNEL_CASES = {
    "all-rows-sorted": ([0, 0, 0, 1, 1, 1, 2, 2, 2], "batched"),
    "all-rows-unsorted": ([0, 1, 2, 1, 0, 2, 2, 1, 0, 1], "batched"),
    "mixed-with-base": ([0, -1, 2, -1, 0, 2, -1, 1, -1, 1], "batched"),
    "slot-unused": ([2, -1, 0, 2, 0, -1, 2, 0], "batched"),
    "one-slot": ([1, -1, 1, 1, -1, 1], "batched"),
    "one-slot-every-row": ([1, 1, 1, 1], "batched"),
    "long-segment": ([0] * 12 + [-1, 2, 1], "segments"),
    "long-segment-unsorted": ([0, 0, 1, 0, 0, 0, -1, 0, 0, 0, 0, 0, 2, 0], "segments"),
}


@pytest.mark.parametrize("widths", [(12,), (8, 4, 4)], ids=["plain", "stacked"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_torch_kernel_equals_a_per_token_loop(case: str, widths: tuple[int, ...]) -> None:
    """The grouped kernel against the dense per-token sum ``(x · A[slot]ᵀ) · B[slot]`` (the first kernel's)."""
    gen = torch.Generator().manual_seed(0)
    slots, rank, d_in = 3, 4, 16
    token_slots, plan = KERNEL_CASES[case]
    block = rank * len(widths)
    a, b = _block_diagonal_factors(gen, slots, rank, d_in, widths)
    x = torch.randn(len(token_slots), d_in, generator=gen)
    y = torch.randn(len(token_slots), sum(widths), generator=gen)
    mapping = build_step_mapping(torch.tensor(token_slots), slots, torch.device("cpu"))
    assert mapping is not None and (mapping.segments is None) == (plan == "batched")
    expected = y.clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            expected[t] += (x[t] @ a[s * block:(s + 1) * block].T) @ b[s * block:(s + 1) * block]
    got = TORCH_LORA_KERNEL.add_lora_linear(y.clone(), x, a, b, mapping, widths if len(widths) > 1 else None)
    torch.testing.assert_close(got, expected)


def test_step_mapping_all_base_rows_and_padding_add_nothing() -> None:
    assert build_step_mapping(torch.full((4,), -1), 3, torch.device("cpu")) is None
    # slot 1's segment is padded with a repeat of its row, which must be added once; the base row's inf
    # must reach no sum
    mapping = build_step_mapping(torch.tensor([0, 0, 1, -1]), 2, torch.device("cpu"))
    assert mapping is not None and mapping.pad is not None and mapping.segments is None
    a = torch.ones(2 * 2, 3)
    b = torch.ones(2 * 2, 2)
    x = torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [float("inf")] * 3])
    got = TORCH_LORA_KERNEL.add_lora_linear(torch.zeros(4, 2), x, a, b, mapping)
    torch.testing.assert_close(got, torch.tensor([[2.0, 2], [2, 2], [2, 2], [0, 0]]))


def test_fused_checkpoint_adapter_on_a_stacked_layer() -> None:
    """One adapter over all of a packed layer's rows (GPT-2's c_attn) gives x · Aᵀ · Bᵀ on every column."""
    layer = LoRASlots("qkv", 6, [8, 4, 4], max_loras=2, max_rank=3, dtype=torch.float32, device=torch.device("cpu"),
                      state=LoRAStepState())
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 6, generator=gen), torch.randn(16, 3, generator=gen)
    assert layer.check(None, a, b) is None
    parts = layer.split_fused(None, a, b)
    assert [(i, tuple(pb.shape)) for i, _, pb in parts] == [(0, (8, 3)), (1, (4, 3)), (2, (4, 3))]
    for index, pa, pb in parts:
        layer.write(0, index, pa, pb, scaling=2.0)
    x = torch.randn(4, 6, generator=gen)
    layer.state.mapping = build_step_mapping(torch.tensor([0, -1, 0, 1]), 2, torch.device("cpu"))
    y = layer(x, torch.zeros(4, 16))
    torch.testing.assert_close(y[[0, 2]], (x[[0, 2]] @ a.T) @ b.T * 2.0)
    assert y[[1, 3]].abs().max() == 0


def test_packed_layer_slot_holds_each_projection_in_its_rows() -> None:
    """q/k/v factors each get their own rank block and their rows of B (the scaling folded in)."""
    widths = [8, 4, 4]
    layer = LoRASlots("qkv", 6, widths, max_loras=2, max_rank=3, dtype=torch.float32, device=torch.device("cpu"),
                      state=LoRAStepState())
    gen = torch.Generator().manual_seed(1)
    factors = [(torch.randn(2, 6, generator=gen), torch.randn(w, 2, generator=gen)) for w in widths]
    for i, (a, b) in enumerate(factors):
        assert layer.check(i, a, b) is None
        layer.write(1, i, a, b, scaling=0.5)
    assert layer.check(0, factors[1][0], factors[1][1]) is not None  # k's B has 4 rows, q's slice 8
    x = torch.randn(5, 6, generator=gen)
    layer.state.mapping = build_step_mapping(torch.tensor([1, 1, -1, 1, 0]), 2, torch.device("cpu"))
    y = layer(x, torch.zeros(5, 16))
    expected = torch.cat([(x @ a.T) @ b.T * 0.5 for a, b in factors], dim=1)
    torch.testing.assert_close(y[[0, 1, 3]], expected[[0, 1, 3]])
    assert y[[2, 4]].abs().max() == 0  # the base row and slot 0 (empty) add nothing


def test_lora_modules_parser() -> None:
    from pagoda.entrypoints.openai.lora_modules import LoRAModulePath

    assert LoRAModulePath.parse("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert LoRAModulePath.parse('{"name": "c", "path": "/p", "base_model_name": "m"}') == LoRAModulePath("c", "/p", "m")
    for bad in ("sql", "=/x", '{"name": "c"}', '{"name": "c", "path": "/p", "extra": 1}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            LoRAModulePath.parse(bad)
