"""A LoRA adapter on a GGUF base kept in its blocks: the adapter runs in float beside the block matmuls, and
the logits match the same adapter on the file dequantized at load (within the kernel's own error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from pagoda import LLM, LoRARequest, SamplingParams
from plugins.quant_gguf.tests.test_gguf_models import (
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    LAYERS,
    PROMPT,
    VOCAB,
    write_tiny_llama,
)
from tests.lora_utils import make_adapter


def _logits(path: Path, quantization: str | None, lora: LoRARequest | None) -> np.ndarray:
    llm = LLM(model=str(path), quantization=quantization, dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              logprobs_mode="raw_logits", max_logprobs=VOCAB, num_kv_blocks=8, block_size=16, max_num_seqs=1,
              enable_lora=True, max_lora_rank=8)
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=VOCAB),
                         lora_request=lora, use_tqdm=False)
    return np.array([[row[t].logprob for t in range(VOCAB)] for row in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_adapter_on_blocks_matches_adapter_on_dequantized(tmp_path: Path, qtype: Q) -> None:
    import transformers as tf

    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype)
    torch.manual_seed(0)
    shapes = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                                                num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                                num_key_value_heads=KV_HEADS))
    make_adapter(shapes, tmp_path / "adapter", r=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                 seed=4)
    lora = LoRARequest("gguf-adapter", 1, str(tmp_path / "adapter"))
    kept, kept_base = _logits(path, None, lora), _logits(path, None, None)
    dequantized, dequantized_base = _logits(path, "none", lora), _logits(path, "none", None)
    adapter_effect = np.abs(dequantized - dequantized_base).max()
    assert adapter_effect > 0.2, "the adapter must change the logits for the comparison to mean anything"
    # what the adapter adds is the same on both bases, up to the block kernel's own (int8 activations) error
    delta_error = np.abs((kept - kept_base) - (dequantized - dequantized_base)).max()
    kernel_error = np.abs(kept_base - dequantized_base).max()
    assert delta_error < max(adapter_effect / 10, 2 * kernel_error), (delta_error, adapter_effect, kernel_error)
    assert np.abs(kept - dequantized).max() < 3 * kernel_error + adapter_effect / 10
