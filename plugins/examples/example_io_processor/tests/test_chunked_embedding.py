"""The example IO processor from its source tree: entry point, registration, its flow, and LLM.encode with it.

test_chunked_embedding_installed.py installs it with pip and serves it on /pooling;
these run with its ``src`` on sys.path, so they need no install.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagoda.plugins import reset_plugin_manager


@pytest.fixture(autouse=True)
def example_on_path(monkeypatch: pytest.MonkeyPatch, example: Any) -> None:
    monkeypatch.syspath_prepend(str(example.PLUGIN_ROOT / "src"))


def test_pyproject_entry_point_names_the_plugin_module(example: Any) -> None:
    import tomllib

    from pagoda.plugins import ENTRY_POINT_GROUPS

    project = tomllib.loads((example.PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][ENTRY_POINT_GROUPS["io_processor"]] == {
        "chunked_embedding": "pagoda_example_io_processor.plugin"
    }


def test_plugin_registers_its_processor() -> None:
    import pagoda_example_io_processor.plugin as plugin
    from pagoda.plugins import PluginManager, check_api_version
    from pagoda.plugins.io_processors import IOProcessor

    assert check_api_version(plugin.PAGODA_PLUGIN_API_VERSION) is None
    pm = PluginManager()
    info = pm.register(plugin, name="chunked_embedding", kind="io_processor")
    assert info.status == "loaded", info.error
    spec = pm.io_processors()["chunked_embedding"]
    assert issubclass(spec.load(), IOProcessor)
    assert info.provides == ["io_processors:chunked_embedding"]


def test_request_to_prompts() -> None:
    from pagoda import EngineArgs
    from pagoda_example_io_processor.processor import ChunkedEmbeddingProcessor

    processor = ChunkedEmbeddingProcessor(EngineArgs().create_engine_config())
    words = [f"w{i}" for i in range(5, 15)]
    prompt = processor.parse_request({"data": {"text": "  ".join(words), "chunk_words": 4}})
    assert processor.pre_process(prompt) == [" ".join(words[:4]), " ".join(words[4:8]), " ".join(words[8:])]
    for bad in ({"text": ""}, {"text": "w5", "chunk_words": 0}, {"text": "w5", "extra": 1}, {"words": ["w5"]}, "w5"):
        with pytest.raises(ValueError):
            processor.parse_request({"data": bad})
    with pytest.raises(ValueError, match="no words"):
        processor.pre_process(processor.parse_request({"data": {"text": "   "}}))
    assert processor.validate_or_generate_params().task == "embed"


def test_llm_encode_gives_the_weighted_mean_of_the_chunk_embeddings(
    bert_checkpoint: Path, request: pytest.FixtureRequest
) -> None:
    import pagoda_example_io_processor.plugin as plugin
    from pagoda import LLM
    from pagoda.plugins import get_plugin_manager

    info = get_plugin_manager().register(plugin, name="chunked_embedding", kind="io_processor")
    request.addfinalizer(reset_plugin_manager)  # the registration lives in the process-wide plugin manager
    assert info.status == "loaded", info.error
    llm = LLM(model=str(bert_checkpoint), dtype="float32", io_processor_plugin="chunked_embedding")
    words = [f"w{5 + (7 * i) % 50}" for i in range(45)]
    text = " ".join(words)
    [out] = llm.encode({"data": {"text": text, "chunk_words": 20}})
    result = out.outputs
    chunks = [" ".join(words[i:i + 20]) for i in range(0, len(words), 20)]
    embedded = llm.embed(chunks, use_tqdm=False)
    weights = np.array([len(o.prompt_token_ids) for o in embedded], dtype=np.float64)
    mean = (weights[:, None] * np.array([o.outputs.embedding for o in embedded])).sum(0) / weights.sum()
    assert result["num_chunks"] == 3 and result["num_tokens"] == int(weights.sum())
    np.testing.assert_allclose(result["embedding"], mean / np.linalg.norm(mean), atol=1e-5)
    # a model-length text that one request could not hold still embeds: 45 words + [CLS] [SEP] > 32 positions
    assert len(words) + 2 > llm.llm_engine.config.resolved.max_model_len
