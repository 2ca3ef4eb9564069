"""A W8A8 int8 Gemma 2 checkpoint (made by the compressed-tensors library) served through ``pagoda.LLM``.

The reference is transformers running the same tiny model with each quantized Linear's weight
dequantized from the checkpoint and its input rounded to int8 per token
(``pagoda.testing.quantized_checkpoint``, which also says how the tolerances were measured).
Gemma 2 covers the sandwich norms, soft-caps, a sliding window and the tied LM head (kept float).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Gemma2Config

pytest.importorskip("compressed_tensors", reason="the test makes its checkpoint with compressed-tensors")
pytest.importorskip("pagoda_quant_compressed_tensors", reason="pagoda serves compressed-tensors through that plugin")

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, sliding_window=16,
              query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=5.0)


def test_w8a8_gemma2_matches_its_dequantized_reference(tmp_path: Path) -> None:
    from pagoda.testing.quantized_checkpoint import check_w8a8_parity

    # measured: 96 tokens equal, one near-tie (gap 9e-4), top-5 logprobs within 0.025
    check_w8a8_parity(Gemma2Config(**CONFIG), tmp_path)
