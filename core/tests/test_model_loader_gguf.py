"""GGUF files written here with gguf.GGUFWriter: names, dequantization, the Q/K row order, dtype and errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pagoda.model_loader import ModelLoadError, ModelSource, checkpoint_dtype, iter_weights, resolve_model_path

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96

GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_state_dict() -> dict[str, np.ndarray]:
    """HF-named float32 weights of a tiny Llama (inner dims are multiples of 32, the quant block size)."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        shapes |= {
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
            prefix + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            prefix + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def to_gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        return f"blk.{layer}.{GGUF_BLOCK_NAMES[rest]}.{kind}"
    return f"{GGUF_TOP_NAMES[module]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter writes Q and K in: per head, interleave the two rotary halves."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def start_writer(path: Path, architecture: str = "llama") -> gguf.GGUFWriter:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_float_or_quantized(writer: gguf.GGUFWriter, name: str, weight: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, weight)
    elif qtype == Q.F16:
        writer.add_tensor(name, weight.astype(np.float16))
    else:
        writer.add_tensor(name, quantize(weight, qtype), raw_dtype=qtype)  # shape read from the bytes


def write_llama_gguf(path: Path, weights: dict[str, np.ndarray], qtype: Q) -> None:
    """Write ``weights`` as llama.cpp would: GGUF names, permuted Q/K, matrices in ``qtype``, norms in F32."""
    writer = start_writer(path)
    for hf_name, weight in weights.items():
        if ".q_proj." in hf_name:
            weight = llama_cpp_permute(weight, HEADS)
        elif ".k_proj." in hf_name:
            weight = llama_cpp_permute(weight, KV_HEADS)
        add_float_or_quantized(writer, to_gguf_name(hf_name), weight, qtype if weight.ndim == 2 else Q.F32)
    finish(writer)


def quantization_round_trip(weight: np.ndarray, qtype: Q) -> np.ndarray:
    """What the gguf package's own quantize -> dequantize gives for ``weight``."""
    if qtype == Q.F32:
        return weight
    if qtype == Q.F16:
        return weight.astype(np.float16).astype(np.float32)
    return dequantize(quantize(weight, qtype), qtype)


# Loose bounds on |loaded - original| for standard-normal weights; the exact check is against gguf's round trip.
MAX_ERROR = {Q.F32: 0.0, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q5_0: 0.25, Q.Q5_1: 0.25, Q.Q4_0: 0.5, Q.Q4_1: 0.5}
EXPECTED_DTYPE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


@pytest.mark.parametrize("qtype", list(MAX_ERROR), ids=lambda q: q.name)
def test_llama_gguf_round_trip(tmp_path: Path, qtype: Q) -> None:
    weights = llama_state_dict()
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, weights, qtype)

    loaded = dict(iter_weights(resolve_model_path(path)))
    assert set(loaded) == set(weights)
    for name, original in weights.items():
        tensor = loaded[name]
        matrix_type = qtype if original.ndim == 2 else Q.F32
        assert tensor.dtype == EXPECTED_DTYPE.get(matrix_type, torch.float32), name
        assert tuple(tensor.shape) == original.shape, name
        # Quantization works on row blocks and the permutation only moves whole rows, so un-permuted
        # rows must equal gguf's round trip of the HF-ordered weight exactly.
        expected = quantization_round_trip(original, matrix_type)
        np.testing.assert_array_equal(tensor.float().numpy(), expected, err_msg=name)
        assert np.abs(tensor.float().numpy() - original).max() <= MAX_ERROR[matrix_type], name


def test_checkpoint_dtype_of_gguf(tmp_path: Path) -> None:
    weights = llama_state_dict()
    for qtype, expected in [(Q.F16, torch.float16), (Q.BF16, torch.bfloat16), (Q.F32, torch.float32), (Q.Q8_0, None)]:
        path = tmp_path / f"{qtype.name}.gguf"
        write_llama_gguf(path, weights, qtype)
        assert checkpoint_dtype(resolve_model_path(path)) == expected, qtype.name


def random_k_quant_blocks(qtype: Q, rows: int, scale_offsets: tuple[int, ...]) -> np.ndarray:
    """Random K-quant blocks whose f16 scales are small and finite (gguf cannot quantize K-quants)."""
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(rows, 2, block_bytes), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[..., offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    return blocks.reshape(rows, 2 * block_bytes)


# Where each K-quant block keeps its f16 super-block scale(s) (ggml's block layouts).
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


@pytest.mark.parametrize("qtype", list(K_QUANT_SCALES), ids=lambda q: q.name)
def test_k_quants_match_gguf_reference(tmp_path: Path, qtype: Q) -> None:
    rows = 4
    blocks = random_k_quant_blocks(qtype, rows, K_QUANT_SCALES[qtype])
    path = tmp_path / "kquant.gguf"
    writer = start_writer(path)
    writer.add_tensor("blk.0.ffn_down.weight", blocks, raw_dtype=qtype)
    finish(writer)

    [(name, tensor)] = list(iter_weights(resolve_model_path(path)))
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert tensor.shape == (rows, 512) and tensor.dtype == torch.float32
    reference = dequantize(blocks, qtype)
    assert np.isfinite(reference).all()
    np.testing.assert_array_equal(tensor.numpy(), reference)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    writer = start_writer(path)
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    finish(writer)
    with pytest.raises(ModelLoadError, match="blk.0.ffn_down.weight has type IQ4_NL"):
        iter_weights(resolve_model_path(path))


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = start_writer(path, architecture="mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(ModelLoadError, match="architecture 'mamba'"):
        iter_weights(resolve_model_path(path))


def test_unknown_tensor_name_is_named(tmp_path: Path) -> None:
    path = tmp_path / "moe.gguf"
    writer = start_writer(path)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(ModelLoadError, match="blk.0.ffn_gate_exps.weight"):
        iter_weights(resolve_model_path(path))


def test_directory_with_one_gguf_file(tmp_path: Path) -> None:
    write_llama_gguf(tmp_path / "only.gguf", llama_state_dict(), Q.F32)
    assert resolve_model_path(tmp_path) == ModelSource(kind="gguf", path=tmp_path.resolve(), gguf_file="only.gguf")
    write_llama_gguf(tmp_path / "second.gguf", llama_state_dict(), Q.F32)
    with pytest.raises(ModelLoadError, match="several .gguf files"):
        resolve_model_path(tmp_path)


@pytest.mark.parametrize("load_format", ["safetensors", "pt"])
def test_hf_load_format_on_gguf(tmp_path: Path, load_format: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, llama_state_dict(), Q.F32)
    with pytest.raises(ModelLoadError, match="is a GGUF file"):
        iter_weights(resolve_model_path(path), load_format)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_benchmark_export_rewrites_a_quantized_gguf_at_full_precision(tmp_path: Path, dtype: torch.dtype) -> None:
    """llama.cpp, the benchmark peer, must run the very weights pagoda loads from the quantized file."""
    from gguf import GGUFReader

    from benchmarks.export import export_gguf
    from pagoda.model_loader import load_hf_config

    source = tmp_path / "tiny.gguf"
    write_llama_gguf(source, llama_state_dict(), Q.Q4_1)
    out = export_gguf(str(source), tmp_path / "tiny-full.gguf", dtype)
    quantized = dict(iter_weights(resolve_model_path(source)))
    rewritten = dict(iter_weights(resolve_model_path(out)))
    assert set(rewritten) == set(quantized)
    for name, tensor in quantized.items():
        want = tensor.float().to(dtype) if tensor.dim() == 2 else tensor.float()
        assert rewritten[name].dtype == want.dtype, name
        assert torch.equal(rewritten[name], want), name
    assert load_hf_config(resolve_model_path(out)).to_dict() == load_hf_config(resolve_model_path(source)).to_dict()
    assert GGUFReader(out).fields["general.file_type"].contents() == {torch.float32: 0, torch.bfloat16: 32}[dtype]
