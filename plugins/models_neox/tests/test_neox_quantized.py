"""W8A8 int8 NeoX-family checkpoints (made by the compressed-tensors library) served through ``pagoda.LLM``.

The reference is transformers running the same tiny model with each quantized Linear's weight
dequantized from the checkpoint and its input rounded to int8 per token
(``pagoda.testing.quantized_checkpoint``, which also says how the tolerances were measured).
GPT-NeoX's fused query_key_value rows are interleaved per head: its int8 weight and its
per-channel scales must be regrouped alike. StableLM's q/k/v and gate/up are stacked from
separate quantized projections, each with its own scales.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import GPTNeoXConfig, StableLmConfig

pytest.importorskip("compressed_tensors", reason="the test makes its checkpoints with compressed-tensors")
pytest.importorskip("pagoda_quant_compressed_tensors", reason="pagoda serves compressed-tensors through that plugin")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, tie_word_embeddings=False)


def _config(case: str) -> Any:
    if case == "gpt-neox":
        return GPTNeoXConfig(**CONFIG)
    return StableLmConfig(**CONFIG, num_key_value_heads=2, use_qkv_bias=True)


@pytest.mark.parametrize("case", ["gpt-neox", "stablelm"])
def test_w8a8_matches_its_dequantized_reference(tmp_path: Path, case: str) -> None:
    from pagoda.testing.quantized_checkpoint import check_w8a8_parity

    check_w8a8_parity(_config(case), tmp_path)
