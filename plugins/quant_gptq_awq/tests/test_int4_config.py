"""Reading quantization_config: what is served, what is refused (and why), which layers stay float."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagoda.layers import Linear
from pagoda.quantization import get_quantization_config
from pagoda_quant_gptq_awq.config import AWQConfig, GPTQConfig

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq"}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_registered_under_vllm_names() -> None:
    assert get_quantization_config("gptq") is GPTQConfig
    assert get_quantization_config("awq") is AWQConfig


@pytest.mark.parametrize("change,message", [
    ({"bits": 3}, "3-bit weights"),
    ({"bits": 2}, "2-bit weights"),
    ({"group_size": 0}, "group_size 0"),
    ({"dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"is_marlin_format": True}, "is_marlin_format"),
])
def test_gptq_refuses(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTQConfig.from_config({**GPTQ, **change})


@pytest.mark.parametrize("change,message", [
    ({"bits": 8}, "8-bit weights"),
    ({"version": "gemv"}, "version 'gemv'"),
    ({"version": "GEMV_FAST"}, "version 'gemv_fast'"),
    ({"version": "marlin"}, "version 'marlin'"),
    ({"version": "exllama"}, "version 'exllama'"),
    ({"zero_point": False}, "zero_point false"),
    ({"backend": "llm-awq"}, "backend 'llm-awq'"),
])
def test_awq_refuses(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AWQConfig.from_config({**AWQ, **change})


def test_awq_reads_autoawq_keys() -> None:
    config = AWQConfig.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
                                    "version": "GEMM"})
    assert (config.weight_bits, config.group_size) == (4, 64)


def test_gptq_v2_zeros_are_not_offset() -> None:
    assert GPTQConfig.from_config(GPTQ).zero_offset == 1
    assert GPTQConfig.from_config({**GPTQ, "checkpoint_format": "gptq_v2"}).zero_offset == 0
    assert GPTQConfig.from_config({k: v for k, v in GPTQ.items() if k != "checkpoint_format"}).zero_offset == 1


def _layer() -> Linear:
    return Linear(64, 64, bias=False, dtype=torch.float32)


def test_awq_modules_to_not_convert_keep_float() -> None:
    config = AWQConfig.from_config({**AWQ, "modules_to_not_convert": ["visual", "mlp.down_proj"]})
    config.packed_modules_mapping = PACKED
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.down_proj") is None
    assert config.get_quant_method(_layer(), "model.layers.0.self_attn.qkv_proj") is not None
    half = AWQConfig.from_config({**AWQ, "modules_to_not_convert": ["k_proj"]})
    half.packed_modules_mapping = PACKED
    with pytest.raises(ValueError, match="cannot be half quantized"):
        half.get_quant_method(_layer(), "model.layers.0.self_attn.qkv_proj")


def test_gptq_modules_in_block_to_quantize() -> None:
    config = GPTQConfig.from_config({**GPTQ, "modules_in_block_to_quantize": [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]]})
    config.packed_modules_mapping = PACKED
    assert config.get_quant_method(_layer(), "model.layers.0.self_attn.qkv_proj") is not None
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.gate_up_proj") is not None
    assert config.get_quant_method(_layer(), "model.layers.0.self_attn.o_proj") is None
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.down_proj") is None


def test_lm_head_only_when_the_checkpoint_says_so() -> None:
    from pagoda.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(384, 64, False, torch.float32)
    assert GPTQConfig.from_config(GPTQ).get_quant_method(head, "lm_head") is None
    assert GPTQConfig.from_config({**GPTQ, "lm_head": True}).get_quant_method(head, "lm_head") is not None
    assert AWQConfig.from_config(AWQ).get_quant_method(head, "lm_head") is None


def test_activation_dtypes() -> None:
    assert set(GPTQConfig.get_supported_act_dtypes()) == {torch.float32, torch.bfloat16, torch.float16}


def test_moe_router_gates_stay_float() -> None:
    config = AWQConfig.from_config(AWQ)
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.gate") is None
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.shared_expert_gate") is None
    assert config.get_quant_method(_layer(), "model.layers.0.mlp.experts.0.gate_proj") is not None
