"""A tiny random checkpoint of the example architecture, and the same model written densely as a reference."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

PLUGIN_ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = "ExampleTinyForCausalLM"

# Tiny on purpose: two query heads share one KV head (GQA).
CONFIG: dict[str, Any] = {
    "architectures": [ARCHITECTURE],
    "model_type": "example_tiny",  # unknown to transformers: pagoda reads config.json as a plain config
    "vocab_size": 64,
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 32,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def checkpoint_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's names; wide enough that logits are not ties."""
    c = CONFIG
    hidden, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (c["vocab_size"], hidden),
        "model.embed_positions.weight": (c["max_position_embeddings"], hidden),
        "model.attn_norm.weight": (hidden,),
        "model.q_proj.weight": (hidden, hidden),
        "model.k_proj.weight": (kv, hidden),
        "model.v_proj.weight": (kv, hidden),
        "model.o_proj.weight": (hidden, hidden),
        "model.mlp_norm.weight": (hidden,),
        "model.up_proj.weight": (c["intermediate_size"], hidden),
        "model.down_proj.weight": (hidden, c["intermediate_size"]),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (c["vocab_size"], hidden),
    }
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * (1.0 if len(shape) == 1 else 0.5) for name, shape in shapes.items()}


def write_checkpoint(path: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors and a word-level tokenizer (words w3 .. w63)."""
    from safetensors.torch import save_file

    from pagoda.testing.tiny_tokenizer import save_tiny_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    save_file(checkpoint_state(seed), str(path / "model.safetensors"))
    save_tiny_tokenizer(path, CONFIG["vocab_size"])
    return path


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG["rms_norm_eps"]) * weight


def reference_logits(state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Every position's logits for one sequence, written from the checkpoint with dense causal attention."""
    w = {k.removeprefix("model."): v for k, v in state.items()}
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    t, dim = len(ids), CONFIG["hidden_size"] // heads
    x = w["embed_tokens.weight"][ids] + w["embed_positions.weight"][:t]
    h = _rms_norm(x, w["attn_norm.weight"])
    q = (h @ w["q_proj.weight"].T).view(t, heads, dim).transpose(0, 1)
    k = (h @ w["k_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    v = (h @ w["v_proj.weight"].T).view(t, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + attn.transpose(0, 1).reshape(t, heads * dim) @ w["o_proj.weight"].T
    up = torch.nn.functional.gelu(_rms_norm(x, w["mlp_norm.weight"]) @ w["up_proj.weight"].T)
    x = x + up @ w["down_proj.weight"].T
    return _rms_norm(x, w["norm.weight"]) @ w["lm_head.weight"].T


def reference_greedy(state: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(reference_logits(state, ids)[-1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="session")
def example_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("example-tiny"))


@pytest.fixture(scope="session")
def example() -> Any:
    """The helpers above for the test modules (under --import-mode=importlib they cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        CONFIG=CONFIG, ARCHITECTURE=ARCHITECTURE, PLUGIN_ROOT=PLUGIN_ROOT, checkpoint_state=checkpoint_state,
        write_checkpoint=write_checkpoint, reference_logits=reference_logits, reference_greedy=reference_greedy,
    )
