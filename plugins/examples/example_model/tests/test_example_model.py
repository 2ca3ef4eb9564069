"""The example plugin: its entry point, registration through the plugin manager, and a paged forward.

The example is not installed by default, so the test puts its ``src`` on sys.path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

PLUGIN_ROOT = Path(__file__).resolve().parents[1]

# Tiny on purpose: two query heads share one KV head (GQA), blocks of 4 tokens.
CONFIG = SimpleNamespace(
    vocab_size=50,
    hidden_size=16,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=32,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PLUGIN_ROOT / "src"))


def test_pyproject_entry_point_names_the_plugin_module() -> None:
    from pagoda.plugins import ENTRY_POINT_GROUPS

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    entry_points = project["entry-points"][ENTRY_POINT_GROUPS["model_family"]]
    assert entry_points == {"example_model": "pagoda_example_model.plugin"}


def test_plugin_registers_its_architecture() -> None:
    from pagoda.plugins import PluginManager
    from pagoda_example_model import ARCHITECTURE, plugin
    from pagoda_example_model.model import ExampleTinyForCausalLM

    pm = PluginManager()
    info = pm.register(plugin, name="example_model", kind="model_family", distribution="pagoda-example-model")
    assert info.status == "loaded", info.error
    spec = pm.model_families()[ARCHITECTURE]
    assert spec.load() is ExampleTinyForCausalLM
    assert spec.runner == "generate"


def _model() -> torch.nn.Module:
    from pagoda_example_model.model import ExampleTinyForCausalLM

    torch.manual_seed(0)
    model = ExampleTinyForCausalLM(CONFIG, torch.float32)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return model.eval()


def _reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits of every position of one sequence, with dense causal attention (no cache)."""
    tokens = torch.tensor(ids)
    hidden = model.embed_tokens(tokens) + model.embed_positions(torch.arange(len(ids)))
    x = model.attn_norm(hidden)
    t, heads, kv_heads, dim = len(ids), model.num_heads, model.num_kv_heads, model.head_dim
    q = model.q_proj(x).view(t, heads, dim).transpose(0, 1)
    k = model.k_proj(x).view(t, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    v = model.v_proj(x).view(t, kv_heads, dim).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    hidden = hidden + model.o_proj(attn.transpose(0, 1).reshape(t, heads * dim))
    x = model.mlp_norm(hidden)
    hidden = hidden + model.down_proj(torch.nn.functional.gelu(model.up_proj(x)))
    return model.compute_logits(model.norm(hidden))


def _metadata(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]
) -> tuple[torch.Tensor, object]:
    from pagoda.attention import AttentionMetadata

    positions: list[int] = []
    slots: list[int] = []
    for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
        for pos in range(s_len - q_len, s_len):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_seqs=len(query_lens),
        num_tokens=sum(query_lens),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        is_all_decode=all(q == 1 for q in query_lens),
    )
    return torch.tensor(positions), metadata


def test_paged_prefill_then_decode_matches_dense_attention() -> None:
    backend_module = pytest.importorskip("pagoda_attn_torch.backend", reason="needs the torch attention backend")
    from pagoda.attention import AttentionSpec

    model = _model()
    spec = AttentionSpec(
        num_heads=model.num_heads, num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
        dtype=torch.float32, device_type="cpu", block_size=BLOCK_SIZE,
    )
    backend = backend_module.TorchPagedAttentionBackend(spec)
    kv_cache = torch.zeros(backend.kv_cache_shape(4, BLOCK_SIZE, model.num_kv_heads, model.head_dim))
    model.attn.bind(backend, kv_cache)

    seq_a, seq_b = [3, 14, 15, 9, 26, 7], [2, 7, 18, 28]
    tables = [[0, 1], [2, 3]]
    with torch.no_grad():
        # Step 1: both prompts but their last token, as one flat batch.
        positions, metadata = _metadata([5, 3], [5, 3], tables)
        ids = torch.tensor(seq_a[:5] + seq_b[:3])
        hidden = model(ids, positions, backend.prepare(metadata))
        prefill_logits = model.compute_logits(hidden[[4, 7]])
        # Step 2: one new token each, attending to what step 1 cached.
        positions, metadata = _metadata([1, 1], [6, 4], tables)
        hidden = model(torch.tensor([seq_a[5], seq_b[3]]), positions, backend.prepare(metadata))
        decode_logits = model.compute_logits(hidden)

        ref_a, ref_b = _reference_logits(model, seq_a), _reference_logits(model, seq_b)
    torch.testing.assert_close(prefill_logits, torch.stack([ref_a[4], ref_b[2]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_logits, torch.stack([ref_a[5], ref_b[3]]), rtol=1e-4, atol=1e-4)


def test_load_weights_reports_what_it_loaded_and_rejects_strangers() -> None:
    model = _model()
    state = {f"model.{name}": torch.zeros_like(p) for name, p in model.named_parameters()}
    loaded = model.load_weights(state.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    assert all(bool((p == 0).all()) for p in model.parameters())

    with pytest.raises(ValueError, match="unexpected weight 'layers.0.q_proj.weight'"):
        model.load_weights([("model.layers.0.q_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"weight 'lm_head.weight' has shape \(1,\)"):
        model.load_weights([("lm_head.weight", torch.zeros(1))])


def test_plugin_module_imports_no_model_code() -> None:
    import subprocess

    code = (
        "import sys; import pagoda_example_model.plugin;"
        "assert 'pagoda_example_model.model' not in sys.modules, 'model imported at discovery'"
    )
    env = {**os.environ, "PYTHONPATH": str(PLUGIN_ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
