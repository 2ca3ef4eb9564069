"""The engine's Llama-family models against transformers' own, on tiny random checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagoda.testing.paged_kv import PagedKVHarness
from pagoda_models_llama import llama

ATOL = 1e-4
SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)


def _configs() -> dict[str, tuple[Any, type]]:
    return {
        "llama": (LlamaConfig(**SMALL, num_hidden_layers=2), llama.LlamaForCausalLM),
        "llama-tied-bias-yarn": (
            LlamaConfig(
                **{**SMALL, "max_position_embeddings": 64},
                num_hidden_layers=2,
                tie_word_embeddings=True,
                attention_bias=True,
                mlp_bias=True,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "rope_theta": 10000.0,
                    "original_max_position_embeddings": 16,
                },
            ),
            llama.LlamaForCausalLM,
        ),
        "mistral-window8": (MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=8), llama.MistralForCausalLM),
        "qwen2-window8-from-layer1": (
            Qwen2Config(**SMALL, num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1),
            llama.Qwen2ForCausalLM,
        ),
        "qwen3-tied": (
            Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True),
            llama.Qwen3ForCausalLM,
        ),
    }


CASES = list(_configs())


def _randomize(model: torch.nn.Module) -> None:
    """Unit-scale weights and non-trivial norm weights, so a mixed-up q/k norm or bias shows in the logits."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            elif param.ndim == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            else:
                param.copy_(0.3 * noise)


class Pair:
    """A transformers reference model and the engine model loaded from its state dict."""

    def __init__(self, case: str, dtype: torch.dtype = torch.float32) -> None:
        hf_config, cls = _configs()[case]
        torch.manual_seed(0)
        self.hf = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
        _randomize(self.hf)
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
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, metadata: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, metadata))


def test_load_weights_consumes_every_checkpoint_tensor(pair: Pair) -> None:
    expected = set(pair.state_names)
    if pair.model.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert pair.loaded == expected


def test_single_prefill_matches_transformers(pair: Pair) -> None:
    ids = _tokens(20, seed=1)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(20), 20)])
    logits = _run(pair.model, ids, positions, metadata)
    assert logits.dtype == torch.float32 and logits.shape == (20, SMALL["vocab_size"])
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
    assert b_done == 22 and a.num_cached == 18


def test_built_on_meta_device_then_materialized() -> None:
    """The runner may build on the meta device; the RoPE table must not be lost on materialisation."""
    reference = Pair("qwen3-tied")
    hf_config, cls = _configs()["qwen3-tied"]
    with torch.device("meta"):
        model = cls(hf_config, torch.float32)
    model.to_empty(device="cpu")
    model.load_weights(reference.hf.state_dict().items())
    ids = _tokens(10, seed=6)
    harness = PagedKVHarness(model)
    positions, metadata = harness.step([(harness.new_sequence(10), 10)])
    torch.testing.assert_close(
        _run(model, ids, positions, metadata), reference.reference_logits(ids), atol=ATOL, rtol=0
    )


def test_bfloat16_parameters_and_logits() -> None:
    fp32 = Pair("llama")
    hf_config, cls = _configs()["llama"]
    model = cls(hf_config, torch.bfloat16)
    model.load_weights(fp32.hf.state_dict().items())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = _tokens(12, seed=7)
    harness = PagedKVHarness(model)
    positions, metadata = harness.step([(harness.new_sequence(12), 12)])
    logits = _run(model, ids, positions, metadata)
    reference = fp32.reference_logits(ids)
    # In the model dtype: the sampler widens them only when it needs to.
    assert logits.dtype == torch.bfloat16
    # bf16 keeps ~3 significant digits: close to the fp32 reference, not equal to it.
    assert (logits.float() - reference).abs().max() < 0.05 * reference.abs().max()


def test_sliding_windows_per_layer() -> None:
    configs = _configs()
    assert llama.Qwen2ForCausalLM(configs["qwen2-window8-from-layer1"][0], torch.float32).options.sliding_windows == (
        None,
        8,
        8,
    )
    assert llama.MistralForCausalLM(configs["mistral-window8"][0], torch.float32).options.sliding_windows == (8, 8)
    assert llama.LlamaForCausalLM(configs["llama"][0], torch.float32).options.sliding_windows == (None, None)
    no_window = Qwen2Config(**SMALL, num_hidden_layers=2, use_sliding_window=False, sliding_window=8)
    assert llama.Qwen2ForCausalLM(no_window, torch.float32).options.sliding_windows == (None, None)
    layers = [
        m.self_attn.attn.sliding_window
        for m in llama.Qwen2ForCausalLM(configs["qwen2-window8-from-layer1"][0], torch.float32).model.layers
    ]
    assert layers == [None, 8, 8]


def test_load_weights_rejects_unknown_names_and_wrong_shapes() -> None:
    hf_config, cls = _configs()["llama"]
    model = cls(hf_config, torch.float32)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.bogus.weight"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(4))])
    with pytest.raises(ValueError, match="k_proj.*shape"):
        model.load_weights([("model.layers.1.self_attn.k_proj.weight", torch.zeros(3, 64))])
    full = {n: t for n, t in _hf_state_dict(hf_config) if not n.endswith("inv_freq")}
    with pytest.raises(ValueError, match="missing weight.*model.layers.0.self_attn.v_proj.weight"):
        model.load_weights([(n, t) for n, t in full.items() if n != "model.layers.0.self_attn.v_proj.weight"])
    loaded = model.load_weights([*full.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))])
    assert loaded == set(full)


def _hf_state_dict(hf_config):
    from transformers import LlamaForCausalLM as HFLlama

    return list(HFLlama(hf_config).state_dict().items())


def test_unsupported_activation_is_named() -> None:
    config = LlamaConfig(**SMALL, num_hidden_layers=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="gelu"):
        llama.LlamaForCausalLM(config, torch.float32)


def test_plugin_registers_each_architecture_with_its_class() -> None:
    from pagoda.models.interface import CausalLMModel
    from pagoda.models.registry import ModelRegistry
    from pagoda.plugins import import_object

    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        cls = import_object(ModelRegistry.spec_for([arch]).cls)
        assert cls is getattr(llama, arch)
    assert isinstance(llama.LlamaForCausalLM(_configs()["llama"][0], torch.float32), CausalLMModel)
