"""The transformers fallback's model against transformers itself, over a real paged KV cache, and what it refuses."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from pagoda.attention import Attention
from pagoda.layers import Linear
from pagoda.testing.model_parity import randomize_weights
from pagoda.testing.paged_kv import PagedKVHarness
from pagoda_models_transformers.attention import PagodaAttentionContext, pagoda_attention_forward
from pagoda_models_transformers.model import TransformersForCausalLM
from pagoda_models_transformers.support import FallbackUnsupportedError, reasons_unsupported

ATOL = 2e-5


def _config(case: str) -> Any:
    if case == "gpt_bigcode-mqa":
        cfg = transformers.GPTBigCodeConfig(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, multi_query=True, n_positions=128,
            bos_token_id=0, eos_token_id=0,
        )
    elif case == "gpt_bigcode-mha-unscaled":
        cfg = transformers.GPTBigCodeConfig(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, multi_query=False, n_positions=128,
            scale_attn_weights=False, bos_token_id=0, eos_token_id=0,
        )
    elif case == "llama-gqa-tied":
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
        )
    elif case == "gemma2-window-softcap":
        cfg = transformers.Gemma2Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=4,
        )
    else:
        raise KeyError(case)
    return cfg


CASES = ["gpt_bigcode-mqa", "gpt_bigcode-mha-unscaled", "llama-gqa-tied", "gemma2-window-softcap"]


class Pair:
    """transformers' eager model and the fallback built from its config and loaded from its state dict."""

    def __init__(self, case: str) -> None:
        cfg = _config(case)
        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        randomize_weights(self.hf, seed=1)
        if getattr(cfg, "tie_word_embeddings", False):
            self.hf.tie_weights()
        config = self.hf.config
        config.architectures = [type(self.hf).__name__]
        with torch.device("cpu"):
            self.model = TransformersForCausalLM(config, torch.float32)
        self.model.load_weights(self.hf.state_dict().items())
        self.harness = PagedKVHarness(self.model, num_blocks=64, block_size=4)

    def reference(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits: torch.Tensor = self.hf(input_ids=torch.tensor([tokens])).logits[0]
        return logits


@pytest.mark.parametrize("case", CASES)
def test_prefill_chunked_prefill_and_decode_match_transformers(case: str) -> None:
    pair = Pair(case)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 3, 14)]
    seqs = [pair.harness.new_sequence(32) for _ in prompts]
    with torch.no_grad():
        # step 1: all of prompt 0 and 1, the first half of prompt 2 (a chunk)
        chunks = [prompts[0], prompts[1], prompts[2][:7]]
        positions, md = pair.harness.step([(s, len(c)) for s, c in zip(seqs, chunks)])
        pair.model.compute_logits(pair.model(torch.tensor(sum(chunks, [])), positions, md))
        # step 2: decodes for 0 and 1 beside the rest of prompt 2
        new = [[5], [6], prompts[2][7:]]
        positions, md = pair.harness.step([(s, len(c)) for s, c in zip(seqs, new)])
        logits = pair.model.compute_logits(pair.model(torch.tensor(sum(new, [])), positions, md))
    offset = 0
    for chunk, fed in zip(chunks, new):
        expected = pair.reference(chunk + fed)[-len(fed) :]
        got = logits[offset : offset + len(fed)]
        offset += len(fed)
        assert torch.allclose(got, expected, atol=ATOL), f"{case}: max diff {(got - expected).abs().max():.2e}"


def test_linear_layers_become_pagoda_linears_and_tied_embeddings_stay_one_tensor() -> None:
    pair = Pair("llama-gqa-tied")
    model = pair.model
    plain = [m for m in model.modules() if type(m) is torch.nn.Linear]
    ours = [m for m in model.modules() if isinstance(m, Linear)]
    # 2 layers x (q, k, v, o, gate, up, down) + the LM head
    assert not plain and len(ours) == 15 and model.num_linear_replaced == 15
    assert model.lm_head.weight is model.model.get_input_embeddings().weight
    assert len([m for m in model.modules() if isinstance(m, Attention)]) == 2


def test_building_allocates_no_random_init_and_leaves_no_meta_tensor() -> None:
    cfg = _config("gpt_bigcode-mqa")
    cfg.architectures = ["GPTBigCodeForCausalLM"]
    with torch.device("cpu"):
        model = TransformersForCausalLM(cfg, torch.bfloat16)
    assert all(not p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(not b.is_meta for b in model.buffers())
    # the causal-mask buffer transformers computes at construction is real, not left empty
    assert bool(model.model.transformer.bias[3, 2]) and not bool(model.model.transformer.bias[2, 3])


def test_bloom_is_refused_because_its_alibi_attention_bypasses_the_attention_interface() -> None:
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    cfg.architectures = ["BloomForCausalLM"]
    reasons = reasons_unsupported(cfg)
    assert len(reasons) == 1 and "_supports_attention_backend is False" in reasons[0]
    with pytest.raises(FallbackUnsupportedError, match="BloomForCausalLM does not support the attention interface"):
        TransformersForCausalLM(cfg, torch.float32)


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (transformers.T5Config(architectures=["T5ForConditionalGeneration"]), "encoder-decoder"),
        (transformers.BertConfig(architectures=["BertModel"]), "not a causal language model"),
        (types.SimpleNamespace(architectures=["NopeForCausalLM"]), "implements no architecture named NopeForCausalLM"),
        (types.SimpleNamespace(architectures=[]), "names no architectures"),
        (
            types.SimpleNamespace(
                architectures=["LlamaForCausalLM"], layer_types=["full_attention", "linear_attention"]
            ),
            "layers include linear_attention",
        ),
        (
            types.SimpleNamespace(
                architectures=["RemoteForCausalLM"], auto_map={"AutoModelForCausalLM": "modeling_x.RemoteForCausalLM"}
            ),
            "trust_remote_code=True",
        ),
    ],
)
def test_what_the_fallback_refuses_says_why(config: Any, why: str) -> None:
    reasons = reasons_unsupported(config)
    assert any(why in r for r in reasons), reasons


def test_names_only_configs_of_served_architectures_pass() -> None:
    assert reasons_unsupported(types.SimpleNamespace(architectures=["GPTBigCodeForCausalLM"])) == []
    assert reasons_unsupported(types.SimpleNamespace(architectures=["LlamaForCausalLM"])) == []


def test_load_weights_names_unknown_missing_and_misshapen_weights() -> None:
    pair = Pair("gpt_bigcode-mqa")
    state = dict(pair.hf.state_dict())
    with pytest.raises(ValueError, match="'transformer.h.9.attn.c_attn.weight' matches no parameter"):
        pair.model.load_weights([*state.items(), ("transformer.h.9.attn.c_attn.weight", torch.zeros(1))])
    missing = {k: v for k, v in state.items() if k != "transformer.ln_f.bias"}
    with pytest.raises(ValueError, match="missing weight\\(s\\) model.transformer.ln_f.bias|missing weight\\(s\\) transformer.ln_f.bias"):
        pair.model.load_weights(missing.items())
    bad = {**state, "transformer.ln_f.bias": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"'transformer.ln_f.bias' has shape \(3,\), the model expects \(64,\)"):
        pair.model.load_weights(bad.items())


def test_a_checkpoint_of_the_base_model_alone_loads_under_the_prefix() -> None:
    pair = Pair("gpt_bigcode-mqa")
    state = {k.removeprefix("transformer."): v for k, v in pair.hf.state_dict().items()}
    loaded = pair.model.load_weights(state.items())
    assert "wte.weight" in loaded and "lm_head.weight" in loaded
    assert torch.equal(pair.model.model.transformer.ln_f.bias, pair.hf.transformer.ln_f.bias)


class _FakeAttention(torch.nn.Module):
    is_causal = True

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx


def _call(**kwargs: Any) -> Any:
    layer = Attention(num_heads=4, head_dim=8, scale=0.5, num_kv_heads=2)
    ctx = PagodaAttentionContext([layer], metadata=None, architecture="FakeForCausalLM")  # type: ignore[arg-type]
    q = torch.zeros(1, 4, 3, 8)
    kv = torch.zeros(1, 2, 3, 8)
    args: dict[str, Any] = {"attention_mask": None, "pagoda_attention": ctx, **kwargs}
    module = args.pop("module", _FakeAttention())
    return pagoda_attention_forward(module, args.pop("query", q), kv, kv, **args)


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"attention_mask": torch.zeros(1, 1, 3, 3)}, "passes its own attention mask"),
        ({"dropout": 0.1}, "attention dropout 0.1"),
        ({"sliding_window": 8}, "asks for sliding window 8, its paged layer was built with None"),
        ({"softcap": 30.0}, "asks for soft-cap 30.0"),
        ({"s_aux": torch.zeros(4)}, "arguments the paged backends do not take: s_aux"),
        ({"query": torch.zeros(1, 2, 3, 8)}, "gives q/k/v of 2/2 heads of 8"),
        ({"module": _FakeAttention(layer_idx=5)}, "has layer_idx 5"),
        ({"pagoda_attention": None}, "without the step's context"),
    ],
)
def test_attention_calls_the_paged_layers_cannot_honour_are_refused(kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(RuntimeError, match=why):
        _call(**kwargs)
