"""The example plugin from its source tree: entry point, registration, weights mapping, a paged forward, the engine.

test_example_model_installed.py installs it with pip and serves it; these run
with its ``src`` on sys.path, so they need no install.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagoda.plugins import reset_plugin_manager

BLOCK_SIZE = 4


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch: pytest.MonkeyPatch, example: Any) -> None:
    monkeypatch.syspath_prepend(str(example.PLUGIN_ROOT / "src"))


def test_pyproject_entry_point_names_the_plugin_module(example: Any) -> None:
    import tomllib

    from pagoda.plugins import ENTRY_POINT_GROUPS

    project = tomllib.loads((example.PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
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


def _loaded_model(example: Any) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from pagoda_example_model.model import ExampleTinyForCausalLM

    state = example.checkpoint_state(seed=0)
    model = ExampleTinyForCausalLM(SimpleNamespace(**example.CONFIG), torch.float32)
    consumed = model.load_weights(state.items())
    assert consumed == set(state)
    return model.eval(), state


def _metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]]) -> tuple[torch.Tensor, Any]:
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


def test_paged_prefill_then_decode_matches_the_dense_reference(example: Any) -> None:
    backend_module = pytest.importorskip("pagoda_attn_torch.backend", reason="needs the torch attention backend")
    from pagoda.attention import AttentionSpec

    model, state = _loaded_model(example)
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
        hidden = model(torch.tensor(seq_a[:5] + seq_b[:3]), positions, backend.prepare(metadata))
        prefill_logits = model.compute_logits(hidden[[4, 7]])
        # Step 2: one new token each, attending to what step 1 cached.
        positions, metadata = _metadata([1, 1], [6, 4], tables)
        hidden = model(torch.tensor([seq_a[5], seq_b[3]]), positions, backend.prepare(metadata))
        decode_logits = model.compute_logits(hidden)
        ref_a, ref_b = example.reference_logits(state, seq_a), example.reference_logits(state, seq_b)
    torch.testing.assert_close(prefill_logits, torch.stack([ref_a[4], ref_b[2]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_logits, torch.stack([ref_a[5], ref_b[3]]), rtol=1e-4, atol=1e-4)


def test_q_k_v_land_in_their_rows_of_the_fused_projection(example: Any) -> None:
    model, state = _loaded_model(example)
    stacked = torch.cat([state[f"model.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.qkv_proj.weight, stacked)


def test_load_weights_rejects_strangers_misfits_and_gaps(example: Any) -> None:
    model, state = _loaded_model(example)
    with pytest.raises(ValueError, match="'model.layers.0.q_proj.weight' matches no parameter"):
        model.load_weights([("model.layers.0.q_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"weight 'model.k_proj.weight' has shape \(1,\), which qkv_proj.weight cannot"):
        model.load_weights([("model.k_proj.weight", torch.zeros(1))])
    partial = {k: v for k, v in state.items() if k != "model.v_proj.weight"}
    with pytest.raises(ValueError, match=r"missing weight\(s\) model.v_proj.weight"):
        model.load_weights(partial.items())


@pytest.mark.parametrize("by", ["string", "class"])
def test_served_by_the_engine_through_a_script_registration(
    by: str, example: Any, example_checkpoint: Path, request: pytest.FixtureRequest
) -> None:
    """``ModelRegistry.register_model`` with "module:Class" or the class: the engine generates what the reference does."""
    from pagoda import LLM, ModelRegistry, SamplingParams
    from pagoda_example_model.model import ExampleTinyForCausalLM

    ModelRegistry.register_model(
        example.ARCHITECTURE, "pagoda_example_model.model:ExampleTinyForCausalLM" if by == "string" else ExampleTinyForCausalLM
    )
    request.addfinalizer(reset_plugin_manager)  # the registration lives in the process-wide plugin manager
    llm = LLM(model=str(example_checkpoint), dtype="float32", max_model_len=64, num_kv_blocks=32, block_size=4,
              max_num_batched_tokens=8)  # prompts longer than 8 tokens are chunked
    state = example.checkpoint_state(seed=0)
    prompts = [[5, 9, 11, 40, 41, 42, 43, 3, 17, 21, 8], [5, 9, 11, 40, 7], [60], [33, 34, 35, 36, 37, 38, 39, 50, 51]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=6,
                                                                                   ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == example.reference_greedy(state, prompt, 6), prompt


_WORKER = """
import pickle, sys
from pagoda.engine.core import EngineCore
from pagoda.platforms import resolve_platform, set_current_platform

with open(sys.argv[1], "rb") as f:
    config = pickle.load(f)
platform = resolve_platform(config.device_config.device)
set_current_platform(platform)
core = EngineCore(config, platform)
print("model", type(core.runner.model).__name__)
"""


def test_script_registration_reaches_a_worker_process(
    example: Any, example_checkpoint: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A fresh process built from the pickled engine config (as a worker is) serves the script's model.

    The example is not installed, so no entry point names it there: only the
    registration carried in ``EngineConfig.registered_models`` can.
    """
    import importlib.metadata
    import pickle

    from pagoda import EngineArgs, ModelRegistry

    try:
        importlib.metadata.distribution("pagoda-example-model")
        pytest.skip("the example is installed here, so its entry point would serve the worker without the config")
    except importlib.metadata.PackageNotFoundError:
        pass
    from pagoda.engine.core import prepare_engine_config

    ModelRegistry.register_model(example.ARCHITECTURE, "pagoda_example_model.model:ExampleTinyForCausalLM")
    request.addfinalizer(reset_plugin_manager)
    config = EngineArgs(model=str(example_checkpoint), dtype="float32", max_model_len=64,
                        num_kv_blocks=16).create_engine_config()
    prepare_engine_config(config)
    assert config.registered_models == {example.ARCHITECTURE: "pagoda_example_model.model:ExampleTinyForCausalLM"}

    env = {**os.environ, "PYTHONPATH": str(example.PLUGIN_ROOT / "src")}
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    for name, registered in (("with", config.registered_models), ("without", {})):
        config.registered_models = registered
        (tmp_path / f"{name}.pkl").write_bytes(pickle.dumps(config))
        done = subprocess.run([sys.executable, str(worker), str(tmp_path / f"{name}.pkl")], env=env,
                              capture_output=True, text=True, timeout=300)
        if registered:
            assert done.returncode == 0, done.stderr[-3000:]
            assert done.stdout.split() == ["model", example.ARCHITECTURE]
        else:  # the control: the worker knows the architecture only through the config
            assert done.returncode != 0
            assert "UnsupportedArchitectureError" in done.stderr and "ExampleTinyForCausalLM" in done.stderr


def test_plugin_module_imports_no_model_code(example: Any) -> None:
    code = (
        "import sys; import pagoda_example_model.plugin;"
        "assert 'pagoda_example_model.model' not in sys.modules, 'model imported at discovery'"
    )
    env = {**os.environ, "PYTHONPATH": str(example.PLUGIN_ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)
