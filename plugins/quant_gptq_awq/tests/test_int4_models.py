"""Tiny GPTQ and AWQ models end to end: pagoda serving the packed checkpoint against transformers serving its
weights dequantized (saved as a plain float checkpoint and loaded back), greedy tokens and top-5 logprobs
through ``pagoda.testing.model_parity.check_parity`` (a differing token only at a measured near-tie)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from int4_checkpoints import write_checkpoint

from pagoda.testing.model_parity import build_tiny_model, check_parity


def _tiny_llama(seed: int = 0) -> Any:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    return build_tiny_model(cfg, seed=seed)


def _tiny_qwen3(seed: int = 0) -> Any:
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=True)
    return build_tiny_model(cfg, seed=seed)


def _tiny_qwen2(seed: int = 0) -> Any:
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    return build_tiny_model(cfg, seed=seed)


def _float_reference(model: Any, path: Path) -> Any:
    """The dequantized model saved as a plain float checkpoint and loaded back by transformers."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(path, safe_serialization=True)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


CASES = {
    "gptq-g32": dict(method="gptq", group_size=32),
    "gptq-g32-desc_act": dict(method="gptq", group_size=32, desc_act=True),
    "gptq-g-1-sym-lm_head": dict(method="gptq", group_size=-1, sym=True, lm_head=True),
    "gptq-g32-down_proj-float": dict(method="gptq", group_size=32, skip=("down_proj",)),
    "gptq8-g32-desc_act": dict(method="gptq", group_size=32, desc_act=True, bits=8),  # CPU: the 8-bit kernel
    "gptq8-g-1-sym-lm_head": dict(method="gptq", group_size=-1, sym=True, lm_head=True, bits=8),
    "gptq8-g16-down_proj-float": dict(method="gptq", group_size=16, skip=("down_proj",), bits=8),
    "awq-g32": dict(method="awq", group_size=32),
    "awq-g-1-down_proj-float": dict(method="awq", group_size=-1, skip=("down_proj",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_llama_matches_its_dequantized_reference(tmp_path: Path, case: str) -> None:
    model = _tiny_llama()
    path = write_checkpoint(model, tmp_path / "ckpt", **CASES[case])  # type: ignore[arg-type]
    reference = _float_reference(model, tmp_path / "dequantized")
    report = check_parity(reference, tmp_path, model_path=path)
    print(case, report)  # near-ties accepted, if any, are listed in the report
    assert report.num_tokens_compared >= 40, report


def test_tiny_qwen3_awq_matches_its_dequantized_reference(tmp_path: Path) -> None:
    model = _tiny_qwen3()
    path = write_checkpoint(model, tmp_path / "ckpt", "awq", 64)
    reference = _float_reference(model, tmp_path / "dequantized")
    report = check_parity(reference, tmp_path, model_path=path)
    print("qwen3-awq-g64", report)
    assert report.num_tokens_compared >= 40, report


def test_tiny_qwen2_gptq_act_order_with_qkv_bias(tmp_path: Path) -> None:
    """q/k/v with biases and each its own g_idx: three kernels, each adding its slice of the fused bias."""
    model = _tiny_qwen2()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    path = write_checkpoint(model, tmp_path / "ckpt", "gptq", 16, desc_act=True)
    reference = _float_reference(model, tmp_path / "dequantized")
    report = check_parity(reference, tmp_path, model_path=path)
    print("qwen2-gptq-g16-desc_act", report)
    assert report.num_tokens_compared >= 40, report


def _runner(llm: Any) -> Any:
    return llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner


def test_layers_hold_the_packed_weights_and_the_log_names_the_kernel(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    from pagoda import LLM

    model = _tiny_llama()
    path = write_checkpoint(model, tmp_path / "ckpt", "gptq", 32, desc_act=True, skip=("down_proj",))
    with caplog.at_level(logging.INFO):
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
    assert "quantization: gptq (4-bit, groups of 32, desc_act, gptq; int4 C++ kernel, path" in caplog.text
    layers = _runner(llm).model.model.layers[0]
    qkv = layers.self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight is None  # the kernel's copy replaced the checkpoint's tensors
    # act order with each projection's own g_idx: q, k and v keep a kernel each
    assert len(qkv.quant_method.parts) == 3
    assert {p.dtype for name, p in qkv.named_parameters()} == {torch.uint8, torch.float32}
    assert layers.mlp.down_proj.quant_method is None and layers.mlp.down_proj.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="does not fit the checkpoint"):
        LLM(model=str(path), skip_tokenizer_init=True, quantization="awq", max_model_len=128)


def test_torch_reference_path_serves_the_same_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PAGODA_INT4_KERNEL=0: every layer dequantizes per call in torch; greedy output as the kernel's."""
    from pagoda import LLM, SamplingParams

    model = _tiny_llama()
    path = write_checkpoint(model, tmp_path / "ckpt", "awq", 32)
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 17]}, {"prompt_token_ids": list(range(3, 60))}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for setting in ("auto", "0"):
        monkeypatch.setenv("PAGODA_INT4_KERNEL", setting)
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
        kernel = _runner(llm).model.model.layers[0].self_attn.qkv_proj.quant_method.kernel
        assert kernel == ("cpu" if setting == "auto" else "torch")
        outputs[setting] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outputs["auto"] == outputs["0"]


@pytest.mark.parametrize("method,desc_act", [("gptq", True), ("awq", False)])
def test_triton_kernel_serves_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
                                        desc_act: bool) -> None:
    """The CUDA wiring on CPU: every layer given the Triton kernel (interpreted), greedy tokens as transformers'."""
    pytest.importorskip("triton")
    from pagoda import LLM, SamplingParams
    from pagoda_quant_gptq_awq import config, linear

    monkeypatch.setattr(linear, "kernel_for", lambda device, bits=4: "triton")
    monkeypatch.setattr(config, "kernel_for", lambda device, bits=4: "triton")
    model = _tiny_llama()
    path = write_checkpoint(model, tmp_path / "ckpt", method, 32, desc_act=desc_act)
    reference = _float_reference(model, tmp_path / "dequantized")
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=16)
    qkv = _runner(llm).model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.kernel == "triton"
    prompts = [[1, 5, 9, 200, 17], list(range(3, 40))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert list(output.outputs[0].token_ids) == expected


def test_gptq_8bit_layers_run_the_8bit_kernel_and_its_off_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """8-bit GPTQ on CPU: the C++ kernel's panels replace the checkpoint's tensors, the log names its path, and
    its float-activation path and PAGODA_GPTQ8_KERNEL=0 (the torch reference, dequantizing per call) serve
    the same greedy tokens as auto."""
    from pagoda import LLM, SamplingParams
    from pagoda_quant_gptq_awq import cpu_int8_kernel

    model = _tiny_llama()
    path = write_checkpoint(model, tmp_path / "ckpt", "gptq", 32, desc_act=True, bits=8)
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 17]}, {"prompt_token_ids": list(range(3, 60))}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    float_path = next(p for p in cpu_int8_kernel.paths() if not p.startswith("vnni"))
    for setting in ("auto", float_path, "0"):
        monkeypatch.setenv("PAGODA_GPTQ8_KERNEL", setting)
        with caplog.at_level(logging.INFO):
            llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
        qkv = _runner(llm).model.model.layers[0].self_attn.qkv_proj
        assert qkv.quant_method.kernel == ("torch" if setting == "0" else "cpu")
        if setting == "auto":
            assert f"quantization: gptq (8-bit, groups of 32, desc_act, gptq; GPTQ 8-bit C++ kernel, path " \
                   f"{cpu_int8_kernel.paths()[0]})" in caplog.text
            assert qkv.qweight is None and len(qkv.quant_method.parts) == 3
            part = qkv.quant_method.parts[0][1]
            assert isinstance(part.cpu, cpu_int8_kernel.CpuInt8Weight) and part.cpu.packed.dtype == torch.uint8
        outputs[setting] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outputs["auto"] == outputs[float_path] == outputs["0"]
