"""GPT-2, OPT and Falcon end to end through ``pagoda.LLM`` against transformers (shared parity check).

Greedy tokens and top-5 logprobs of a mixed batch of 13 prompts (1 to 120 tokens), float32, chunked prefill
under a 32-token step budget, prefix caching on; each architecture in its position, norm-placement, KV-head
and bias variants. Falcon with ALiBi is compared with transformers' SDPA path (its eager path adds the bias
twice: test_gpt_models.test_transformers_eager_falcon_adds_alibi_twice) and served by torch_paged, the
backend the selector picks when cpu_paged refuses ALiBi.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig, GPT2Config, OPTConfig

from pagoda import LLM
from pagoda.testing.model_parity import build_tiny_model, check_parity, randomize_weights, save_tiny_model

VOCAB = 256
GPT2 = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512)
OPT = dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_attention_heads=4, num_hidden_layers=2,
           max_position_embeddings=512)
FALCON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=512)


def _configs() -> dict[str, Any]:
    return {
        "gpt2": GPT2Config(**GPT2),
        "gpt2-untied-inverse-layer-scale": GPT2Config(
            **GPT2, tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True
        ),
        "opt-pre-norm": OPTConfig(**OPT),
        "opt-post-norm-project-in-out": OPTConfig(**OPT, do_layer_norm_before=False, word_embed_proj_dim=32),
        "falcon-rotary-multi-query": FalconConfig(**FALCON),
        "falcon-rotary-new-arch-gqa": FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True),
        "falcon-alibi-multi-query": FalconConfig(**FALCON, alibi=True),
        "falcon-alibi-mha-sequential-bias": FalconConfig(
            **FALCON, alibi=True, multi_query=False, parallel_attn=False, bias=True
        ),
        "falcon-alibi-new-arch-gqa": FalconConfig(**FALCON, alibi=True, new_decoder_architecture=True, num_kv_heads=2),
    }


def tiny_model(hf_config: Any, seed: int) -> Any:
    """``build_tiny_model`` (eager attention), but SDPA for Falcon with ALiBi (see the module docstring)."""
    if not getattr(hf_config, "alibi", False):
        return build_tiny_model(hf_config, seed=seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), attn_implementation="sdpa").float().eval()
    randomize_weights(model, seed=seed)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model


@pytest.mark.parametrize("case", list(_configs()))
def test_every_gpt_family_architecture(tmp_path: Path, case: str) -> None:
    # model_impl="pagoda": this plugin's classes, never the transformers fallback
    report = check_parity(tiny_model(_configs()[case], seed=1), tmp_path, llm_kwargs={"model_impl": "pagoda"})
    assert report.num_cached_tokens > 0
    assert report.max_logprob_error < 1e-3


def test_alibi_model_gets_a_backend_that_serves_alibi(tmp_path: Path) -> None:
    """cpu_paged (the CPU default) refuses ALiBi; the selector moves on to torch_paged."""
    path = save_tiny_model(tiny_model(_configs()["falcon-alibi-multi-query"], seed=2), tmp_path / "m")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=64,
              model_impl="pagoda")
    runner = llm.llm_engine.engine_core.core.runner
    assert runner.attn_backend.name == "torch_paged"
    assert runner.attn_backend.spec.alibi_slopes is not None and len(runner.attn_backend.spec.alibi_slopes) == 4


def test_opt_on_torch_paged(tmp_path: Path) -> None:
    check_parity(
        build_tiny_model(OPTConfig(**OPT, do_layer_norm_before=False), seed=3),
        tmp_path,
        llm_kwargs={"attention_backend": "torch_paged", "model_impl": "pagoda"},
    )
