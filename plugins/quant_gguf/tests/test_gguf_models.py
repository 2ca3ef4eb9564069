"""Tiny Llama GGUF files of every supported block type, run kept in blocks (the gguf method) and
dequantized at load (quantization='none'): the logits agree within the quantization's own error."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from pagoda import LLM, SamplingParams

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 64
PROMPT = [3, 17, 42, 5, 60, 11, 29, 8]
BASIC = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
BLOCK_SHAPES = {
    "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HIDDEN // HEADS, HIDDEN), "attn_v": (KV_HEADS * HIDDEN // HEADS, HIDDEN),
    "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
    "ffn_down": (HIDDEN, INTERMEDIATE),
}


def _k_blocks(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with small finite f16 scales (gguf 0.19 cannot quantize K-quants)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(shape[0], shape[1] // values, nbytes), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        # Q6_K's int8 sub-scales times 6-bit values are ~30x the others' products: its d is smaller,
        # so every type's weights come out of similar size
        d = 0.0001 if qtype == Q.Q6_K else 0.002
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    return blocks.reshape(shape[0], -1)


def write_tiny_llama(path: Path, qtype: Q, vocab_qtype: Q | None = None) -> Path:
    """A tiny Llama GGUF file: matrices in ``qtype`` (F32 for the float reference), norms F32, untied head;
    ``vocab_qtype``: the token table's and the head's type (``qtype`` when None)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    tensors: list[tuple[str, tuple[int, ...]]] = [("token_embd", (VOCAB, HIDDEN)), ("output_norm", (HIDDEN,)), ("output", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        tensors += [(f"blk.{i}.attn_norm", (HIDDEN,)), (f"blk.{i}.ffn_norm", (HIDDEN,))]
        tensors += [(f"blk.{i}.{name}", shape) for name, shape in BLOCK_SHAPES.items()]
    for name, shape in tensors:
        # weights scaled so activations stay O(1) through the layers
        data = (rng.standard_normal(shape) * (1.0 if len(shape) == 1 else 0.5 / np.sqrt(shape[-1]) * 4)).astype(np.float32)
        kind = vocab_qtype if vocab_qtype is not None and name in ("token_embd", "output") else qtype
        if len(shape) == 1:
            writer.add_tensor(f"{name}.weight", np.abs(data) + 0.5)
        elif kind == Q.F32:
            writer.add_tensor(f"{name}.weight", data)
        elif kind in K_QUANT_SCALES:
            writer.add_tensor(f"{name}.weight", _k_blocks(kind, shape, rng), raw_dtype=kind)  # type: ignore[arg-type]
        else:
            writer.add_tensor(f"{name}.weight", quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def prompt_logits(path: Path, quantization: str | None, dtype: str = "auto") -> np.ndarray:
    """Raw logits [prompt positions - 1, vocab] (every prompt position's full distribution)."""
    llm = LLM(model=str(path), quantization=quantization, dtype=dtype, skip_tokenizer_init=True, max_model_len=64,
              logprobs_mode="raw_logits", max_logprobs=VOCAB, num_kv_blocks=8, block_size=16, max_num_seqs=1)
    try:
        [out] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=VOCAB))
        rows = out.prompt_logprobs[1:]
        return np.array([[row[t].logprob for t in range(VOCAB)] for row in rows])
    finally:
        del llm


@pytest.fixture(scope="module")
def float_logits(tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    return prompt_logits(write_tiny_llama(tmp_path_factory.mktemp("f32") / "tiny.gguf", Q.F32), None)


@pytest.mark.parametrize("qtype", BASIC, ids=lambda q: q.name)
def test_kept_in_blocks_matches_dequantized_within_quantization_error(
    tmp_path: Path, qtype: Q, float_logits: np.ndarray
) -> None:
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype)
    kept = prompt_logits(path, None)  # the gguf method, chosen from the file's tensor types
    dequantized = prompt_logits(path, "none")
    # The kernel quantizes activations to int8 per 32 values (as llama.cpp does); its error must stay
    # under what quantizing the weights did to the logits.
    weight_error = np.abs(dequantized - float_logits).max()
    kernel_error = np.abs(kept - dequantized).max()
    assert kernel_error < max(weight_error, 1e-3 * np.abs(float_logits).max()), (kernel_error, weight_error)
    assert (kept.argmax(-1) == dequantized.argmax(-1)).mean() >= 0.85


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda q: q.name)
def test_k_quants_kept_in_blocks_match_dequantized(tmp_path: Path, qtype: Q) -> None:
    # The K-quant kernel quantizes activations to int8 per 256 values (as llama.cpp's Q8_K does): each
    # matmul's output moves by ~1% of its range (measured on this model; the kernel tests hold the
    # arithmetic itself exact), which two random layers compound to 0.4-7% of the logits' range.
    # Random blocks have no float original, so there is no weight error to compare with, as above.
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype)
    kept, dequantized = prompt_logits(path, "gguf", "float32"), prompt_logits(path, "none", "float32")
    scale, error = np.abs(dequantized).max(), np.abs(kept - dequantized).max()
    assert error < 0.1 * scale, (error, scale)
    assert (kept.argmax(-1) == dequantized.argmax(-1)).mean() >= 0.85
    # the kernel ran (dequantizing per call would match to float rounding)
    assert error > 1e-5 * scale, (error, scale)
