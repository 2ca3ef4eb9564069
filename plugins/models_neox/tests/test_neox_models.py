"""The engine's GPT-NeoX, Phi and StableLM models against transformers' own, on tiny random checkpoints.

Each case runs over a real paged KV cache (``PagedKVHarness``): one prefill, two sequences in one flat batch,
and decode steps beside a chunked prefill, all compared with transformers' eager forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPTNeoXConfig, PhiConfig, StableLmConfig

from pagoda.testing.model_parity import randomize_weights
from pagoda.testing.paged_kv import PagedKVHarness
from pagoda_models_neox import neox

ATOL = 1e-4
VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=128)


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "gpt-neox-parallel": (
            GPTNeoXConfig(**SMALL, num_hidden_layers=2, hidden_act="gelu"),
            neox.GPTNeoXForCausalLM,
        ),
        "gpt-neox-sequential-tied-nobias": (
            GPTNeoXConfig(
                **SMALL,
                num_hidden_layers=2,
                use_parallel_residual=False,
                attention_bias=False,
                tie_word_embeddings=True,
                rotary_pct=0.5,
                rotary_emb_base=500,
            ),
            neox.GPTNeoXForCausalLM,
        ),
        "phi": (PhiConfig(**SMALL, num_hidden_layers=2), neox.PhiForCausalLM),
        "phi-qk-layernorm-gqa-tied": (
            PhiConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2, qk_layernorm=True, tie_word_embeddings=True),
            neox.PhiForCausalLM,
        ),
        "stablelm": (StableLmConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=4), neox.StableLmForCausalLM),
        "stablelm-qkv-bias-qk-norm-parallel-gqa": (
            StableLmConfig(
                **SMALL,
                num_hidden_layers=2,
                num_key_value_heads=2,
                use_qkv_bias=True,
                qk_layernorm=True,
                use_parallel_residual=True,
                partial_rotary_factor=0.5,
            ),
            neox.StableLmForCausalLM,
        ),
    }


CASES = list(_configs())


class Pair:
    """A transformers reference model and the engine model loaded from its state dict."""

    def __init__(self, case: str, dtype: torch.dtype = torch.float32) -> None:
        hf_config, cls = _configs()[case]
        self.hf_config = hf_config
        self.cls = cls
        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
        randomize_weights(self.hf, seed=1234)
        if hf_config.tie_word_embeddings:
            self.hf.tie_weights()
        self.model = cls(hf_config, dtype)
        state = self.hf.state_dict()
        self.loaded = self.model.load_weights(state.items())
        self.state_names = set(state)

    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.hf(input_ids=token_ids[None]).logits[0].float()


@pytest.fixture(scope="module", params=CASES)
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(request.param)


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata))


def _prefill_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    harness = PagedKVHarness(model)
    positions, metadata = harness.step([(harness.new_sequence(len(ids)), len(ids))])
    return _run(model, ids, positions, metadata)


def test_load_weights_consumes_every_checkpoint_tensor(pair: Pair) -> None:
    expected = set(pair.state_names)
    if pair.model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert pair.loaded == expected


def test_single_prefill_matches_transformers(pair: Pair) -> None:
    ids = _tokens(20, seed=1)
    logits = _prefill_logits(pair.model, ids)
    assert logits.dtype == torch.float32 and logits.shape == (20, VOCAB)
    torch.testing.assert_close(logits, pair.reference_logits(ids), atol=ATOL, rtol=0)


def test_two_sequences_in_one_flat_batch(pair: Pair) -> None:
    first, second = _tokens(13, seed=2), _tokens(20, seed=3)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(13), 13), (harness.new_sequence(20), 20)])
    logits = _run(pair.model, torch.cat([first, second]), positions, metadata)
    torch.testing.assert_close(logits[:13], pair.reference_logits(first), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[13:], pair.reference_logits(second), atol=ATOL, rtol=0)


def test_decode_steps_beside_a_chunked_prefill(pair: Pair) -> None:
    """Sequence A prefills then decodes one token a step; B prefills in chunks in the same steps."""
    a_ids, b_ids = _tokens(18, seed=4), _tokens(22, seed=5)
    a_ref, b_ref = pair.reference_logits(a_ids), pair.reference_logits(b_ids)
    harness = PagedKVHarness(pair.model)
    a, b = harness.new_sequence(18), harness.new_sequence(22)

    positions, metadata = harness.step([(a, 12)])
    torch.testing.assert_close(_run(pair.model, a_ids[:12], positions, metadata), a_ref[:12], atol=ATOL, rtol=0)

    b_chunks = [5, 5, 5, 4, 3]
    b_done = 0
    for step, chunk in enumerate(b_chunks + [0]):
        a_pos = 12 + step
        scheduled = [(a, 1)] + ([(b, chunk)] if chunk else [])
        positions, metadata = harness.step(scheduled)
        ids = torch.cat([a_ids[a_pos : a_pos + 1], b_ids[b_done : b_done + chunk]])
        logits = _run(pair.model, ids, positions, metadata)
        torch.testing.assert_close(logits[:1], a_ref[a_pos : a_pos + 1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1:], b_ref[b_done : b_done + chunk], atol=ATOL, rtol=0)
        b_done += chunk


def test_saved_checkpoint_names_load(pair: Pair, tmp_path: Path) -> None:
    """``save_pretrained`` writes the hub's names (GPT-NeoX: ``embed_out``, not ``lm_head``); they load too."""
    pair.hf.save_pretrained(tmp_path, safe_serialization=True)
    saved = load_file(str(tmp_path / "model.safetensors"))
    model = pair.cls(pair.hf_config, torch.float32)
    model.load_weights(saved.items())
    ids = _tokens(9, seed=6)
    torch.testing.assert_close(_prefill_logits(model, ids), pair.reference_logits(ids), atol=ATOL, rtol=0)


def test_gpt_neox_qkv_rows_are_interleaved_per_head() -> None:
    """Rows of query_key_value are [heads, 3, head_dim]; loading them as [q; k; v] blocks changes the logits."""
    p = Pair("gpt-neox-parallel")
    ids = _tokens(12, seed=7)
    model = neox.GPTNeoXForCausalLM(p.hf_config, torch.float32)
    # skip the reordering: the checkpoint's interleaved rows taken as if they were q, k, v blocks
    model.convert_checkpoint_tensor = lambda name, tensor: tensor  # type: ignore[method-assign]
    model.load_weights(p.hf.state_dict().items())
    assert (_prefill_logits(model, ids) - p.reference_logits(ids)).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("case", "drop"),
    [
        ("gpt-neox-parallel", "gpt_neox.layers.1.attention.query_key_value.bias"),
        ("phi", "model.layers.0.self_attn.k_proj.weight"),
        ("stablelm-qkv-bias-qk-norm-parallel-gqa", "model.layers.1.self_attn.k_layernorm.norms.1.weight"),
        ("stablelm", "model.layers.0.mlp.up_proj.weight"),
    ],
)
def test_a_missing_checkpoint_tensor_is_named(case: str, drop: str) -> None:
    hf_config, cls = _configs()[case]
    hf = AutoModelForCausalLM.from_config(hf_config)
    state = {k: v for k, v in hf.state_dict().items() if k != drop}
    with pytest.raises(ValueError, match=f"missing weight.*{drop.replace('.', '[.]')}"):
        cls(hf_config, torch.float32).load_weights(state.items())


def test_an_unknown_or_misshapen_checkpoint_tensor_is_named() -> None:
    hf_config, cls = _configs()["stablelm-qkv-bias-qk-norm-parallel-gqa"]
    state = AutoModelForCausalLM.from_config(hf_config).state_dict()
    extra = {**state, "model.layers.0.self_attn.q_layernorm.norms.9.weight": torch.ones(16)}
    with pytest.raises(ValueError, match="norms.9.weight' matches no parameter"):
        cls(hf_config, torch.float32).load_weights(extra.items())
    bad = {**state, "model.layers.0.self_attn.q_proj.bias": torch.ones(8)}
    with pytest.raises(ValueError, match="q_proj.bias' has shape"):
        cls(hf_config, torch.float32).load_weights(bad.items())


def test_an_unsupported_activation_is_refused() -> None:
    with pytest.raises(ValueError, match="activation 'tanh' is not supported"):
        neox.GPTNeoXForCausalLM(GPTNeoXConfig(**SMALL, num_hidden_layers=1, hidden_act="tanh"), torch.float32)
    with pytest.raises(ValueError, match="does not support activation 'relu'"):
        neox.StableLmForCausalLM(
            StableLmConfig(**SMALL, num_hidden_layers=1, num_key_value_heads=4, hidden_act="relu"), torch.float32
        )
