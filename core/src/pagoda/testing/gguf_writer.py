"""Write a transformers model as a GGUF file the way llama.cpp's converter does, for tests of GGUF loading.

A plugin author whose architecture has a GGUF form can check pagoda's GGUF
path without downloading a checkpoint: build a tiny random model
(``pagoda.testing.model_parity.build_tiny_model``), write it here with a tiny
tokenizer (``bpe_tokenizer`` / ``spm_tokenizer``) and serve the file::

    tokenizer = bpe_tokenizer()
    hf_model = build_tiny_model(Qwen2Config(vocab_size=tokenizer.vocab_size, ...))
    write_gguf(hf_model, tmp_path / "tiny.gguf", "qwen2", tokenizer)
    LLM(model=str(tmp_path / "tiny.gguf"), dtype="float32")

Names come from the ``gguf`` package's own table (``gguf.get_tensor_name_map``,
which llama.cpp's ``convert_hf_to_gguf.py`` uses); the tensor changes and the
metadata keys follow that converter: llama's Q/K row permutation, Gemma's norm
weights stored as ``1 + w``, GPT-2's Conv1D matrices transposed and its output
matrix written beside the embedding, GPT-NeoX's fused QKV regrouped, MoE
experts stacked per projection.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# A few sentences: enough text for a tokenizer of a few hundred tokens to learn merges from.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. "
    "Hello world, hello there! How are you today? "
    "Paged attention keeps the cache in blocks; the scheduler hands out tokens. "
    "A tiny model speaks in tiny sentences, and then it stops. "
    "Numbers like 12345 and 2026 appear here too."
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{{ message['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


@dataclass(frozen=True)
class GGUFTokenizer:
    """The ``tokenizer.ggml.*`` metadata of a GGUF file."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (sentencepiece-style BPE)
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int
    merges: list[str] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos_token: bool | None = None
    chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)


def bpe_tokenizer(
    vocab_size: int = 320, special_tokens: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    pre: str = "qwen2", chat_template: str | None = CHATML_TEMPLATE,
) -> GGUFTokenizer:
    """A byte-level BPE vocabulary (GPT-2 / Qwen style) trained on ``CORPUS``; the first special token is BOS and EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([CORPUS], trainer)
    model = json.loads(backend.model.__getstate__())
    vocab: dict[str, int] = model["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]
    types = [NORMAL] * len(tokens) + [CONTROL] * len(special_tokens)
    tokens += list(special_tokens)
    bos = tokens.index(special_tokens[0])
    eos = tokens.index("<|im_end|>") if "<|im_end|>" in special_tokens else bos
    return GGUFTokenizer(
        model="gpt2", pre=pre, tokens=tokens, token_types=types, merges=merges,
        bos_token_id=bos, eos_token_id=eos, chat_template=chat_template,
        add_bos_token=False,
    )


def spm_tokenizer(
    vocab_size: int = 360, gemma: bool = False, chat_template: str | None = None
) -> GGUFTokenizer:
    """A sentencepiece-style vocabulary (llama.cpp's ``llama`` tokenizer model): ``▁`` word starts, byte
    fallback tokens ``<0x00>``..``<0xFF>``, pieces scored by merge rank. ``gemma`` puts Gemma's special
    tokens first (``<pad>``, ``<eos>``, ``<bos>``, ``<unk>``) and adds its turn markers.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"] if gemma else [
        "<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials) - 256, show_progress=False)
    backend.train_from_iterator([CORPUS], trainer)
    pieces = [token for token, _ in sorted(backend.get_vocab().items(), key=lambda item: item[1])]
    tokens = specials + byte_tokens + pieces
    types = [CONTROL] * len(specials) + [BYTE] * 256 + [NORMAL] * len(pieces)
    unk = tokens.index("<unk>")
    types[unk] = UNKNOWN
    # sentencepiece scores: higher is merged first; single characters (the trainer's alphabet) score lowest
    scores = [0.0] * (len(specials) + 256) + [-float(i) if len(p) > 1 else -1e4 for i, p in enumerate(pieces)]
    if gemma:
        return GGUFTokenizer(
            model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
            bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0, add_bos_token=True,
            chat_template=GEMMA_TEMPLATE if chat_template is None else chat_template,
        )
    return GGUFTokenizer(
        model="llama", pre="default", tokens=tokens, token_types=types, scores=scores,
        bos_token_id=1, eos_token_id=2, unk_token_id=0, pad_token_id=0, add_bos_token=True,
        chat_template=chat_template,
    )


# --- tensors -------------------------------------------------------------------------------------


def _arch_enum(architecture: str) -> Any:
    from gguf.constants import MODEL_ARCH_NAMES

    for arch, name in MODEL_ARCH_NAMES.items():
        if name == architecture:
            return arch
    raise ValueError(f"the gguf package knows no architecture {architecture!r}")


def _llama_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, interleave the two rotary halves of the rows."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _neox_qkv(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``GPTNeoXModel``: HF's per-head [q, k, v] rows regrouped as all q, all k, all v."""
    head_dim = weight.shape[0] // 3 // num_heads
    grouped = weight.reshape(num_heads, 3, head_dim, *weight.shape[1:])
    return np.concatenate([grouped[:, i].reshape(num_heads * head_dim, *weight.shape[1:]) for i in range(3)])


def _falcon_kv_heads(config: Any) -> int:
    if config.new_decoder_architecture:
        return int(config.num_kv_heads)
    return 1 if config.multi_query else int(config.num_attention_heads)


def _falcon_qkv(weight: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """llama.cpp's ``FalconModel``: per-KV-group [q..., k, v] rows regrouped as all q, all k, all v."""
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    rest = weight.shape[1:]
    grouped = weight.reshape(num_kv_heads, num_heads // num_kv_heads + 2, head_dim, *rest)
    q = grouped[:, :-2].reshape(num_heads * head_dim, *rest)
    k = grouped[:, -2].reshape(num_kv_heads * head_dim, *rest)
    v = grouped[:, -1].reshape(num_kv_heads * head_dim, *rest)
    return np.concatenate([q, k, v])


def gguf_tensors(hf_model: Any, architecture: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(gguf_name, float32 array)`` for every tensor llama.cpp's converter would write for ``hf_model``."""
    import gguf

    config = hf_model.config
    num_layers = int(config.num_hidden_layers if hasattr(config, "num_hidden_layers") else config.n_layer)
    name_map = gguf.get_tensor_name_map(_arch_enum(architecture), num_layers)
    num_heads = int(getattr(config, "num_attention_heads", 0) or config.n_head)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    # tied weights appear once in the file (llama.cpp writes no output matrix for a tied head)
    state = hf_model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in state.items():
        weight = tensor.detach().float().numpy()
        if hf_name == "lm_head.weight" and tied and architecture != "gpt2":
            continue
        if hf_name.endswith(".mlp.experts.gate_up_proj"):  # transformers 5 fuses [E, 2I, H]
            gate, up = np.split(weight, 2, axis=1)
            base = hf_name.removesuffix("gate_up_proj")
            for part, value in (("gate_proj", gate), ("up_proj", up)):
                yield str(name_map.get_name(base + part)) + ".weight", np.ascontiguousarray(value)
            continue
        if hf_name.endswith(".mlp.experts.down_proj"):
            yield str(name_map.get_name(hf_name)) + ".weight", weight
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            if hf_name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
                continue  # buffers, not weights
            raise ValueError(f"gguf has no {architecture} name for {hf_name}")
        if architecture == "llama" and gguf_name.endswith("attn_q.weight"):
            weight = _llama_permute(weight, num_heads)
        elif architecture == "llama" and gguf_name.endswith("attn_k.weight"):
            weight = _llama_permute(weight, num_kv_heads)
        elif architecture in ("gemma", "gemma2", "gemma3") and gguf_name.endswith("norm.weight"):
            weight = weight + 1  # llama.cpp stores Gemma's (1 + w) norm weight
        elif architecture == "gpt2" and hf_name.endswith(
            (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
        ):
            weight = np.ascontiguousarray(weight.T)  # Conv1D [in, out] -> [out, in]
        elif architecture == "gptneox" and ".attn_qkv." in gguf_name:
            weight = _neox_qkv(weight, num_heads)
        elif architecture == "falcon" and ".attn_qkv." in gguf_name:
            weight = _falcon_qkv(weight, num_heads, _falcon_kv_heads(config))
        yield gguf_name, weight
        if architecture == "gpt2" and gguf_name == "token_embd.weight" and "lm_head.weight" not in state:
            yield "output.weight", weight


# --- metadata --------------------------------------------------------------------------------------


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _rope_theta(config: Any) -> float | None:
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta) if theta is not None else _get(config, "rope_theta")


def _partial_rotary(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    return float(factor or _get(config, "partial_rotary_factor", "rotary_pct") or 1.0)


def write_hparams(writer: Any, config: Any, architecture: str) -> None:
    """The ``<arch>.*`` keys llama.cpp's converter writes for this config."""
    hidden = int(_get(config, "hidden_size", "n_embd"))
    heads = int(_get(config, "num_attention_heads", "n_head"))
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    writer.add_block_count(int(_get(config, "num_hidden_layers", "n_layer")))
    writer.add_context_length(int(_get(config, "max_position_embeddings", "n_positions", "n_ctx")))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(_get(config, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * hidden))
    writer.add_head_count(heads)
    if architecture == "falcon":
        writer.add_head_count_kv(_falcon_kv_heads(config))
    elif architecture != "gpt2":
        writer.add_head_count_kv(int(_get(config, "num_key_value_heads") or heads))
    rms_eps = _get(config, "rms_norm_eps")
    if rms_eps is not None:
        writer.add_layer_norm_rms_eps(float(rms_eps))
    else:
        writer.add_layer_norm_eps(float(_get(config, "layer_norm_eps", "layer_norm_epsilon")))
    theta = _rope_theta(config)
    if theta is not None and architecture not in ("gpt2",):
        writer.add_rope_freq_base(theta)
    if architecture in ("llama", "phi3", "stablelm", "gptneox", "phi2"):
        writer.add_rope_dimension_count(int(_partial_rotary(config) * head_dim))
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
        writer.add_sliding_window(int(config.sliding_window))
    if architecture in ("stablelm", "gptneox"):
        writer.add_parallel_residual(bool(config.use_parallel_residual))
    if architecture in ("qwen2moe", "qwen3moe"):
        writer.add_expert_count(int(config.num_experts))
        writer.add_expert_used_count(int(config.num_experts_per_tok))
        writer.add_expert_feed_forward_length(int(config.moe_intermediate_size))
        if architecture == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))


def write_tokenizer(writer: Any, tokenizer: GGUFTokenizer) -> None:
    writer.add_tokenizer_model(tokenizer.model)
    if tokenizer.pre is not None:
        writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    if tokenizer.scores:
        writer.add_token_scores(tokenizer.scores)
    if tokenizer.merges:
        writer.add_token_merges(tokenizer.merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.unk_token_id is not None:
        writer.add_unk_token_id(tokenizer.unk_token_id)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.add_bos_token is not None:
        writer.add_add_bos_token(tokenizer.add_bos_token)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    hf_model: Any, path: str | Path, architecture: str, tokenizer: GGUFTokenizer,
    name: str = "tiny", quantization: Any = None,
) -> Path:
    """``hf_model`` as a GGUF file of llama.cpp architecture ``architecture``; returns its path.

    Matrices are written as float32, or in ``quantization`` (a ``gguf.GGMLQuantizationType``) when
    given; vectors (norms, biases) stay float32 as llama.cpp keeps them.
    """
    import gguf
    from gguf.quants import quantize

    if int(hf_model.config.vocab_size) != tokenizer.vocab_size:
        raise ValueError(f"model vocab_size {hf_model.config.vocab_size} != tokenizer's {tokenizer.vocab_size}")
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(name)
    write_hparams(writer, hf_model.config, architecture)
    write_tokenizer(writer, tokenizer)
    with torch.no_grad():
        for gguf_name, weight in gguf_tensors(hf_model, architecture):
            if quantization is None or weight.ndim < 2 or quantization == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gguf_name, weight.astype(np.float32))
            elif quantization == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(gguf_name, weight.astype(np.float16))
            else:
                writer.add_tensor(gguf_name, quantize(weight, quantization), raw_dtype=quantization)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
