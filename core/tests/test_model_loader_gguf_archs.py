"""GGUF files of every architecture pagoda maps, written from tiny random transformers models
(``pagoda.testing.gguf_writer``): config, tokenizer and weights against transformers' own GGUF loader
for the same file, and against the model the file was written from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType as Q

from pagoda.model_loader import iter_weights, load_hf_config, load_tokenizer, resolve_model_path
from pagoda.model_loader.gguf.config import gguf_config_dict
from pagoda.testing.gguf_writer import GGUFTokenizer, bpe_tokenizer, spm_tokenizer, write_gguf
from pagoda.testing.model_parity import build_tiny_model

_SIZES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
_GQA = dict(_SIZES, num_key_value_heads=2)
_FALCON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)


def _gpt2_tokenizer() -> GGUFTokenizer:
    return bpe_tokenizer(special_tokens=("<|endoftext|>",), pre="gpt-2", chat_template=None)


# architecture -> (tokenizer, config from vocab size, transformers reads this file right).
# Where transformers 5.23 drops a key the file states, the tiny config keeps the class default so that
# transformers stays a valid reference (Qwen3's head_dim 128, StableLM's rotary 0.25, GPT-2's 1024
# positions, the MoE widths); EXTRA_CASES below set other values, checked against the original model.
CASES: dict[str, tuple[Callable[[], GGUFTokenizer], Callable[[int], Any], bool]] = {
    "llama": (spm_tokenizer, lambda v: tf.LlamaConfig(vocab_size=v, **_GQA), True),
    "qwen2": (bpe_tokenizer, lambda v: tf.Qwen2Config(vocab_size=v, tie_word_embeddings=False, **_GQA), True),
    "qwen3": (bpe_tokenizer, lambda v: tf.Qwen3Config(vocab_size=v, head_dim=128, tie_word_embeddings=True, **_GQA), True),
    "gemma": (lambda: spm_tokenizer(gemma=True), lambda v: tf.GemmaConfig(vocab_size=v, head_dim=16, **_GQA), False),
    "gemma2": (
        lambda: spm_tokenizer(gemma=True),
        lambda v: tf.Gemma2Config(vocab_size=v, head_dim=16, sliding_window=16, **_GQA),
        True,
    ),
    "phi3": (spm_tokenizer, lambda v: tf.Phi3Config(vocab_size=v, tie_word_embeddings=False, pad_token_id=0, **_GQA), True),
    "gpt2": (_gpt2_tokenizer, lambda v: tf.GPT2Config(vocab_size=v, n_embd=64, n_layer=2, n_head=4), True),
    "stablelm": (_gpt2_tokenizer, lambda v: tf.StableLmConfig(vocab_size=v, use_qkv_bias=True, **_GQA), True),
    "qwen2moe": (
        bpe_tokenizer,
        lambda v: tf.Qwen2MoeConfig(vocab_size=v, num_experts=4, num_experts_per_tok=2, **_GQA),
        False,  # transformers 5.23 reshapes the squeezed shared-expert gate to [1, 1, hidden] and fails
    ),
    "qwen3moe": (
        bpe_tokenizer,
        lambda v: tf.Qwen3MoeConfig(vocab_size=v, head_dim=32, num_experts=4, num_experts_per_tok=2, **_GQA),
        True,
    ),
    "gptneox": (_gpt2_tokenizer, lambda v: tf.GPTNeoXConfig(vocab_size=v, rotary_pct=0.5, **_SIZES), False),
    "phi2": (_gpt2_tokenizer, lambda v: tf.PhiConfig(vocab_size=v, partial_rotary_factor=0.5, **_SIZES), False),
    # Falcon 7B's layout (multi-query, one norm): the only one transformers reads right
    "falcon": (_gpt2_tokenizer, lambda v: tf.FalconConfig(vocab_size=v, **_FALCON), True),
}
# Values transformers would lose from the file: pagoda must still match the original model.
EXTRA_CASES: dict[str, Callable[[int], Any]] = {
    "qwen3": lambda v: tf.Qwen3Config(vocab_size=v, head_dim=32, **_GQA),
    "stablelm": lambda v: tf.StableLmConfig(vocab_size=v, partial_rotary_factor=0.5, use_parallel_residual=True, **_GQA),
    "gpt2": lambda v: tf.GPT2Config(vocab_size=v, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "qwen2moe": lambda v: tf.Qwen2MoeConfig(
        vocab_size=v, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, **_GQA),
    "gemma2": lambda v: tf.Gemma2Config(
        vocab_size=v, head_dim=16, sliding_window=16, attn_logit_softcapping=20.0, final_logit_softcapping=10.0, **_GQA),
    # Falcon 40B's layout: grouped KV heads, two norms (transformers reads it as multi-query and fails)
    "falcon": lambda v: tf.FalconConfig(vocab_size=v, new_decoder_architecture=True, num_kv_heads=2, **_FALCON),
}
# Falcon's layout, which transformers drops: multi-head (one group per head) and Falcon 40B's.
FALCON_LAYOUTS = {
    "multi_head": dict(multi_query=False),
    "grouped_two_norms": dict(new_decoder_architecture=True, num_kv_heads=2),
}
# Keys pagoda reads from the file where transformers keeps the class default (equal up to float32).
READ_BEYOND_TRANSFORMERS = {"falcon": ("layer_norm_epsilon",)}
# Config keys that describe the run, not the model.
_VOLATILE = {"_name_or_path", "_model_name_or_path", "dtype", "transformers_version", "architectures"}


def build_case(tmp_path: Path, arch: str, make_config: Callable[[int], Any] | None = None,
               quantization: Any = None) -> tuple[Any, Path, GGUFTokenizer]:
    make_tokenizer, default_config, _ = CASES[arch]
    tokenizer = make_tokenizer()
    hf_model = build_tiny_model((make_config or default_config)(tokenizer.vocab_size), seed=0)
    (tmp_path / "model").mkdir(exist_ok=True)
    path = write_gguf(hf_model, tmp_path / "model" / f"tiny-{arch}.gguf", arch, tokenizer, quantization=quantization)
    return hf_model, path, tokenizer


def transformers_model(path: Path) -> Any:
    return tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def config_values(config: Any) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}


@pytest.fixture(autouse=True)
def _cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path / "cache"))


@pytest.mark.parametrize("arch", list(CASES))
def test_config_and_weights_match_transformers(tmp_path: Path, arch: str) -> None:
    hf_model, path, _ = build_case(tmp_path, arch)
    source = resolve_model_path(path)
    assert gguf_config_dict(path) is not None, "built by pagoda's lean parser, not transformers' GGUFReader"
    config = load_hf_config(source)
    assert config.architectures == [type(hf_model).__name__]
    ours = dict(iter_weights(source))
    original = hf_model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    expected_names = {n for n in original if not (tied and n == "lm_head.weight")}
    if arch == "gpt2":
        expected_names.add("lm_head.weight")  # llama.cpp writes GPT-2's head beside the embedding
    assert set(ours) == expected_names
    for name, tensor in ours.items():
        # Gemma's norms went through llama.cpp's 1 + w and back: equal up to float32 rounding
        atol = 1e-6 if arch.startswith("gemma") and "norm" in name else 0.0
        torch.testing.assert_close(tensor, original[name].float(), atol=atol, rtol=0, msg=name)

    if not CASES[arch][2]:
        return
    reference_config = tf.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ours_values, reference_values = config_values(config), config_values(reference_config)
    for key in READ_BEYOND_TRANSFORMERS.get(arch, ()):
        # the file's value (float32) where transformers keeps the class default
        assert ours_values.pop(key) == pytest.approx(reference_values.pop(key), rel=1e-6), key
    assert ours_values == reference_values
    reference_state = transformers_model(path).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference_state[name]), name


@pytest.mark.parametrize("arch", list(EXTRA_CASES))
def test_config_keeps_what_transformers_drops(tmp_path: Path, arch: str) -> None:
    hf_model, path, _ = build_case(tmp_path, arch, EXTRA_CASES[arch])
    config = load_hf_config(resolve_model_path(path))
    original = hf_model.config
    for key in ("head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "n_positions",
                "attn_logit_softcapping", "final_logit_softcapping", "use_parallel_residual",
                "new_decoder_architecture", "num_kv_heads", "multi_query"):
        if hasattr(original, key):
            assert getattr(config, key) == getattr(original, key), key
    rope = getattr(original, "rope_parameters", None) or {}
    if "partial_rotary_factor" in rope:
        assert config.rope_parameters["partial_rotary_factor"] == rope["partial_rotary_factor"]
    for name, tensor in iter_weights(resolve_model_path(path)):
        torch.testing.assert_close(tensor, hf_model.state_dict()[name].float(), atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "phi3", "gpt2"])
def test_tokenizer_and_chat_template_match_transformers(tmp_path: Path, arch: str) -> None:
    _, path, spec = build_case(tmp_path, arch)
    source = resolve_model_path(path)
    ours = load_tokenizer(source)
    again = load_tokenizer(source)  # the second load reads pagoda's convert cache
    reference = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.", "  two spaces, 12345 and ünïcode!", ""]
    for text in texts:
        ids = reference.encode(text)
        assert ours.encode(text) == ids == again.encode(text), text
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.eos_token_id == spec.eos_token_id
    assert ours.chat_template == spec.chat_template
    if spec.chat_template is not None:
        messages = [{"role": "user", "content": "Hello there"}]
        assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_quantized_file_matches_transformers(tmp_path: Path, arch: str) -> None:
    _, path, _ = build_case(tmp_path, arch, quantization=Q.Q8_0)
    reference = transformers_model(path).state_dict()
    for name, tensor in iter_weights(resolve_model_path(path)):
        assert torch.equal(tensor.float(), reference[name]), name


def test_convert_cache_keeps_config_and_weights(tmp_path: Path) -> None:
    """The second load reads the cache: same tensors, and a light config with the architecture."""
    from pagoda.model_loader import load_model_config

    _, path, _ = build_case(tmp_path, "gemma2")
    source = resolve_model_path(path)
    first = dict(iter_weights(source, cache_dtype=torch.float32))
    second = dict(iter_weights(source, cache_dtype=torch.float32))
    assert list(first) == list(second)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    load_hf_config(source)
    light = load_model_config(source)
    assert type(light).__name__ == "CachedHFConfig"
    assert light.architectures == ["Gemma2ForCausalLM"]
    assert light.final_logit_softcapping == 30.0


def test_unmapped_tensor_is_named(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from pagoda.model_loader import ModelLoadError

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_head_count(4)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((2, 8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight has no known Hugging Face name"):
        iter_weights(resolve_model_path(path))


# --- end to end: pagoda.LLM on the GGUF file against transformers' greedy generate ----------------

def _served(architecture: str) -> bool:
    """Whether an installed pagoda plugin (not the transformers fallback) implements ``architecture``."""
    from pagoda import ModelRegistry

    return architecture in ModelRegistry.get_supported_archs()


# The class each file is served as; where transformers cannot load the file (see CASES) the model the
# file was written from is the reference, its weights equal to the loaded ones (float32 rounding of
# Gemma's 1 + w aside).
E2E = ["llama", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "stablelm", "qwen2moe", "qwen3moe",
       "gptneox", "phi2", "falcon"]


@pytest.mark.parametrize("arch", E2E)
def test_llm_on_gguf_matches_transformers(tmp_path: Path, arch: str) -> None:
    from pagoda.testing.model_parity import check_parity

    hf_model, path, _ = build_case(tmp_path, arch)
    # An architecture no installed plugin implements (GPT-2 until its family lands) still runs the
    # GGUF loader end to end, through the transformers fallback.
    llm_kwargs = {} if _served(type(hf_model).__name__) else {"model_impl": "transformers"}
    reference = transformers_model(path) if CASES[arch][2] else hf_model
    report = check_parity(reference, tmp_path, model_path=path, llm_kwargs=llm_kwargs)
    assert report.num_cached_tokens > 0


def test_longrope_factors_are_refused_by_name(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from pagoda.model_loader import ModelLoadError

    path = tmp_path / "phi3-128k.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_head_count(4)
    writer.add_tensor("rope_factors_long.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="LongRoPE factors"):
        iter_weights(resolve_model_path(path))


@pytest.mark.parametrize("arch", list(CASES))
def test_name_table_spells_what_gguf_tensor_mapping_knows(arch: str) -> None:
    """Every HF name pagoda gives a GGUF tensor is one the gguf package maps back to that tensor."""
    import gguf
    from gguf.constants import TENSOR_NAMES

    from pagoda.model_loader.gguf.names import ARCHITECTURES

    table = ARCHITECTURES[arch]
    name_map = gguf.get_tensor_name_map(table.arch, 2)
    for kind, module in table.names.items():
        spelled = TENSOR_NAMES[kind]
        hf = f"{table.layer_prefix}.1.{module}" if "{bid}" in spelled else module
        assert name_map.get_name(hf) == spelled.format(bid=1), (kind, hf)


def test_llm_chat_uses_the_files_template_and_eos(tmp_path: Path) -> None:
    """LLM.chat on a GGUF file: the prompt is the file's chat template through the file's tokenizer."""
    from pagoda import LLM, SamplingParams

    _, path, spec = build_case(tmp_path, "qwen2")
    reference = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": "Hello there"}]
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, num_kv_blocks=32, block_size=16)
    (output,) = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))
    expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert list(output.prompt_token_ids) == list(expected)
    assert llm.get_tokenizer().eos_token_id == spec.eos_token_id


@pytest.mark.parametrize("layout", list(FALCON_LAYOUTS))
def test_falcon_layouts_end_to_end(tmp_path: Path, layout: str) -> None:
    """The Falcon layouts transformers cannot read from GGUF: pagoda against the model the file came from."""
    from pagoda.testing.model_parity import check_parity

    hf_model, path, _ = build_case(
        tmp_path, "falcon", lambda v: tf.FalconConfig(vocab_size=v, **_FALCON, **FALCON_LAYOUTS[layout]))
    config = load_hf_config(resolve_model_path(path))
    for key in ("new_decoder_architecture", "multi_query", "num_kv_heads"):
        assert getattr(config, key) == getattr(hf_model.config, key), key
    check_parity(hf_model, tmp_path, model_path=path)


def _prompt_logits(path: Path, quantization: str, vocab_size: int) -> torch.Tensor:
    from pagoda import LLM, SamplingParams

    llm = LLM(model=str(path), quantization=quantization, dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              num_kv_blocks=16, logprobs_mode="raw_logits", max_logprobs=vocab_size)
    prompt = [(7 * j) % 50 + 1 for j in range(40)]
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=vocab_size),
                         use_tqdm=False)
    return torch.tensor([[row[t].logprob for t in range(vocab_size)] for row in out.prompt_logprobs[1:]])


@pytest.mark.parametrize("arch", ["llama", "gemma2", "stablelm", "gptneox", "phi2", "falcon"])
def test_q8_0_blocks_kept_match_the_file_dequantized(tmp_path: Path, arch: str) -> None:
    """Families whose checkpoint names differ from their parameter names (GPT-NeoX, Phi-2, Falcon) keep
    their layers' blocks too: the loader's filter renames through the model's map_checkpoint_name.
    Kept blocks quantize activations to 8 bits: measured max |logit diff| 0.05-0.12 at logit std 1 (0.21 at
    std 2, gemma2); a wrong row order or a float layer reading blocks is off by the logits' own spread."""
    pytest.importorskip("pagoda_quant_gguf", reason="keeping GGUF blocks is the quant_gguf plugin's method")
    hf_model, path, _ = build_case(tmp_path, arch, quantization=Q.Q8_0)
    vocab_size = hf_model.config.vocab_size
    kept, dequantized = _prompt_logits(path, "gguf", vocab_size), _prompt_logits(path, "none", vocab_size)
    error = float((kept - dequantized).abs().max())
    assert 0 < error < 0.2 * float(dequantized.std())  # 0: the blocks were not kept (the kernel rounds activations)
