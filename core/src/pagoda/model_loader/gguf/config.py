"""A transformers config from GGUF metadata, read by pagoda's lean GGUF parser.

``AutoConfig.from_pretrained(dir, gguf_file=...)`` parses the whole file with
``gguf.GGUFReader`` (seconds, for the vocabulary it then ignores). For the
architectures listed here the same config is built from transformers' own
GGUF-key table and pagoda's parser; a test checks both give equal configs.
pagoda also reads the keys transformers 5.23 drops though the file states them
(``EXTRA_KEYS``: Qwen3's head size, the MoE expert widths, Gemma 2's soft-caps,
a partial rotary width) and the architectures it cannot read at all (gemma,
gptneox, phi2). Any other architecture goes through transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pagoda.model_loader.gguf.file import SkippedStrings, open_gguf

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# llama.cpp architecture -> transformers model_type, where they differ
MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gptneox": "gpt_neox", "phi2": "phi"}

# Keys transformers' own table (GGUF_CONFIG_MAPPING) leaves out although llama.cpp writes them and the
# config would otherwise take a class default that contradicts the file; and the whole table for the
# architectures transformers cannot read from GGUF at all (gemma, gptneox, phi2).
EXTRA_KEYS: dict[str, dict[str, str]] = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"},
    "gpt2": {"context_length": "n_positions"},
    "falcon": {"attention.layer_norm_epsilon": "layer_norm_epsilon", "feed_forward_length": "ffn_hidden_size"},
    "gemma": {
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "embedding_length": "hidden_size",
        "rope.freq_base": "rope_theta",
        "attention.key_length": "head_dim",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "vocab_size": "vocab_size",
    },
    "gptneox": {
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "embedding_length": "hidden_size",
        "rope.freq_base": "rope_theta",
        "attention.head_count": "num_attention_heads",
        "attention.layer_norm_epsilon": "layer_norm_eps",
        "use_parallel_residual": "use_parallel_residual",
        "vocab_size": "vocab_size",
    },
    "phi2": {
        "context_length": "max_position_embeddings",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "embedding_length": "hidden_size",
        "rope.freq_base": "rope_theta",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.layer_norm_epsilon": "layer_norm_eps",
        "vocab_size": "vocab_size",
    },
}
# llama.cpp states a partial rotary embedding as a width (rope.dimension_count); transformers takes a fraction.
ROTARY_FRACTION_KEYS = {
    "stablelm": "partial_rotary_factor", "phi2": "partial_rotary_factor", "phi3": "partial_rotary_factor",
    "gptneox": "rotary_pct",
}
# The architectures this module builds configs for; any other goes through transformers.
FAST_CONFIG_ARCHITECTURES = frozenset(
    {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gemma", "gemma2", "phi3", "gpt2", "stablelm", "gptneox", "phi2",
     "falcon"}
)


def gguf_config_dict(path: Path) -> dict[str, object] | None:
    """The config dict transformers builds (``load_gguf_checkpoint``) plus ``EXTRA_KEYS``; None when this
    architecture needs transformers' own path."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    gguf_file = open_gguf(path)
    metadata = gguf_file.metadata
    architecture = gguf_file.architecture
    name = metadata.get("general.name")
    # transformers reads a llama-architecture file named "mistral" as Mistral
    if architecture not in FAST_CONFIG_ARCHITECTURES or (isinstance(name, str) and "mistral" in name):
        return None
    model_type = MODEL_TYPES.get(architecture, architecture)
    tensor_names = {t.name for t in gguf_file.tensors}

    config: dict[str, object] = {
        # llama.cpp writes the output matrix only when it is not the embedding's (transformers: Falcon always ties)
        "tie_word_embeddings": "output.weight" not in tensor_names or architecture == "falcon",
    }
    if architecture == "stablelm":
        # as transformers: the file states these only through which tensors it has
        config["use_qkv_bias"] = any(f"attn_{x}.bias" in n for n in tensor_names for x in "qkv")
        config["use_parallel_residual"] = not any("ffn_norm" in n for n in tensor_names)
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}))
    config.update(defaults)
    # GGUF key (after its prefix) -> the config keys it sets: transformers' own, then pagoda's extra
    keys: dict[str, dict[str, list[Any]]] = {
        prefix: {rest: [hf_key] for rest, hf_key in cast("dict[str, Any]", table).items()}
        for prefix, table in (
            (architecture, GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING.get(architecture) or {}),
            ("general", GGUF_CONFIG_MAPPING["general"]),
            ("tokenizer", GGUF_CONFIG_MAPPING["tokenizer"]),
        )
    }
    for rest, hf_key in EXTRA_KEYS.get(architecture, {}).items():
        keys[architecture].setdefault(rest, []).append(hf_key)
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        hf_keys = keys.get(prefix, {}).get(rest, [])
        if isinstance(value, SkippedStrings):
            continue
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, model_type)  # as transformers: "qwen2moe" -> "qwen2_moe"
        for hf_key in hf_keys:
            if hf_key is not None and hf_key != -1:
                config[hf_key] = value
    if architecture == "falcon":
        _falcon_layout(config, metadata, tensor_names)
    rotary_width = metadata.get(f"{architecture}.rope.dimension_count")
    if architecture in ROTARY_FRACTION_KEYS and isinstance(rotary_width, int):
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
        if isinstance(head_dim, int) and head_dim and (architecture != "phi3" or rotary_width != head_dim):
            config[ROTARY_FRACTION_KEYS[architecture]] = rotary_width / head_dim
    if "vocab_size" not in config:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, SkippedStrings):
            config["vocab_size"] = tokens.count
    return config


def _falcon_layout(config: dict[str, object], metadata: dict[str, object], tensor_names: set[str]) -> None:
    """Falcon's attention layout, which the file states through its KV head count and tensors.

    transformers reads neither (its table sends head_count_kv to a key FalconConfig ignores), so a
    Falcon 40B file loads there as a 7B-style multi-query model.
    """
    kv_heads = metadata.get("falcon.attention.head_count_kv")
    heads = metadata.get("falcon.attention.head_count")
    config["bias"] = any(name.endswith("attn_qkv.bias") for name in tensor_names)
    if any(".attn_norm_2." in name for name in tensor_names):
        config["new_decoder_architecture"] = True
        if isinstance(kv_heads, int):
            config["num_kv_heads"] = kv_heads
    elif isinstance(kv_heads, int) and kv_heads != 1:
        if kv_heads == heads:
            config["multi_query"] = False  # multi-head Falcon: one group per head
        else:  # grouped KV heads with one norm (Falcon 2 11B)
            config.update(new_decoder_architecture=True, num_kv_heads=kv_heads, num_ln_in_parallel_attn=1)


def load_gguf_config(path: Path) -> PretrainedConfig | None:
    from transformers import CONFIG_MAPPING

    config_dict = gguf_config_dict(path)
    if config_dict is None:
        return None
    config = CONFIG_MAPPING[str(config_dict["model_type"])].from_dict(config_dict)
    config.name_or_path = str(path.parent)  # as transformers sets it
    return config
