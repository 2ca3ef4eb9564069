"""int8 compressed-tensors checkpoints: the kernels' paths, the config, and tiny models end to end.

The checkpoints are made by the compressed-tensors library (0.20.0) from seeded tiny Llama models:
its schemes, its qparams (``calculate_qparams``), its compressor and its config.json. The reference
is transformers running the same model with every quantized Linear's weight dequantized from the
saved checkpoint and, for W8A8, its input quantized per token (scale max|x| / 127) and back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda_quant_compressed_tensors import kernels
from pagoda_quant_compressed_tensors.config import CompressedTensorsConfig

ct = pytest.importorskip("compressed_tensors", reason="the tests make their checkpoints with compressed-tensors")


@pytest.fixture
def kernel_path(request: pytest.FixtureRequest) -> Any:
    path = request.param
    if path not in kernels.paths():
        pytest.skip(f"this CPU does not run the {path} path")
    previous = os.environ.get(kernels.KERNEL_ENV)
    os.environ[kernels.KERNEL_ENV] = path
    yield path
    if previous is None:
        del os.environ[kernels.KERNEL_ENV]
    else:
        os.environ[kernels.KERNEL_ENV] = previous


SHAPES = [(1, 64, 64), (3, 100, 70), (5, 17, 9), (33, 48, 1024)]


@pytest.mark.parametrize("kernel_path", ["vnni512", "avx512bw", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a8_paths_equal_the_reference(kernel_path: str, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # -128 included: no saturation allowed
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=gen) * 3
    x[0, 0] = 0.0
    bias = torch.randn(n, generator=gen)
    expected = kernels.W8A8Weight.prepare(w, scale, on_cpu=False).matmul(x, bias)
    got = kernels.W8A8Weight.prepare(w, scale, on_cpu=True).matmul(x, bias)
    # the int32 dot products are exact on both sides: only the float rescale may round differently
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kernel_path", ["avx512bw", "avx2", "scalar"], indirect=True)
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group", [None, 32])
def test_w8a16_paths_equal_the_reference(kernel_path: str, m: int, n: int, k: int, group: int | None) -> None:
    gen = torch.Generator().manual_seed(m + n * k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    group_size = group or k
    scale = torch.rand(n, -(-k // group_size), generator=gen) * 0.01
    x = torch.randn(m, k, generator=gen)
    expected = kernels.W8A16Weight.prepare(w, scale, group_size, on_cpu=False).matmul(x, None)
    got = kernels.W8A16Weight.prepare(w, scale, group_size, on_cpu=True).matmul(x, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_zero_row_and_all_zero_activations() -> None:
    w = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    out = kernels.W8A8Weight.prepare(w, torch.ones(16), on_cpu=True).matmul(torch.zeros(2, 32), None)
    assert torch.equal(out, torch.zeros(2, 16))


W8A8_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}}


@pytest.mark.parametrize("change,message", [
    ({"weights": {**W8A8_GROUP["weights"], "symmetric": False}}, "asymmetric"),
    ({"weights": {**W8A8_GROUP["weights"], "num_bits": 4}}, "4-bit"),
    ({"input_activations": {**W8A8_GROUP["input_activations"], "dynamic": False}}, "static activation"),
    ({"format": "float-quantized"}, "format"),
])
def test_unsupported_schemes_are_refused(change: dict[str, Any], message: str) -> None:
    config = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {**W8A8_GROUP, **change}}}
    with pytest.raises(ValueError, match=message):
        CompressedTensorsConfig.from_config(config)


FP8_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def test_sparsity_is_refused() -> None:
    base = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": W8A8_GROUP}}
    with pytest.raises(ValueError, match="sparsity_config"):
        CompressedTensorsConfig.from_config({**base, "sparsity_config": {"x": 1}})


def test_fp8_kv_cache_scheme_is_accepted_alone_or_with_groups() -> None:
    base = {"quant_method": "compressed-tensors", "format": "int-quantized", "kv_cache_scheme": FP8_KV_CACHE_SCHEME}
    assert len(CompressedTensorsConfig.from_config({**base, "config_groups": {"g": W8A8_GROUP}}).schemes) == 1
    # a KV-cache-only recipe: every Linear stays in float, the scales are core's loader's
    assert CompressedTensorsConfig.from_config(base).schemes == []


@pytest.mark.parametrize("change,message", [
    ({"type": "int"}, "8-bit int values"),
    ({"strategy": "channel"}, "strategy 'channel'"),
    ({"dynamic": True}, "dynamic scales"),
    ({"symmetric": False}, "asymmetric"),
])
def test_other_kv_cache_schemes_are_refused(change: dict[str, Any], message: str) -> None:
    config = {"quant_method": "compressed-tensors", "kv_cache_scheme": {**FP8_KV_CACHE_SCHEME, **change}}
    with pytest.raises(ValueError, match=f"kv_cache_scheme with {message}"):
        CompressedTensorsConfig.from_config(config)


# -- tiny models end to end ------------------------------------------------------------------------

def _tiny_llama(seed: int = 0) -> Any:
    import transformers

    from pagoda.testing.model_parity import build_tiny_model

    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    return build_tiny_model(cfg, seed=seed)


def make_checkpoint(model: Any, scheme_name: str, fmt: str, path: Path, group_size: int | None = None) -> Path:
    """Quantize ``model``'s Linears with the compressed-tensors library (lm_head ignored) and save the checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(scheme_name, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]),
                              show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight.float()
            if args.strategy == "group":
                w = w.view(w.shape[0], -1, args.group_size)
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def dequantized_reference(path: Path, dynamic_activations: bool, seed: int = 0) -> Any:
    """The same tiny model in transformers, every quantized Linear holding the checkpoint's weight dequantized."""
    from compressed_tensors.compressors import unpack_from_int32
    from safetensors.torch import load_file

    model = _tiny_llama(seed)
    state = load_file(str(path / "model.safetensors"))
    group_size = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["group_size"]
    for name, module in model.named_modules():
        if f"{name}.weight_scale" not in state:
            continue
        if f"{name}.weight_packed" in state:
            q = unpack_from_int32(state[f"{name}.weight_packed"], 8, torch.Size(state[f"{name}.weight_shape"].tolist()))
        else:
            q = state[f"{name}.weight"]
        scale = state[f"{name}.weight_scale"].float()
        if group_size:
            scale = scale.repeat_interleave(group_size, dim=1)
        module.weight.data = q.float() * scale
        if dynamic_activations:
            module.register_forward_pre_hook(_fake_quantize_input)
    return model


def _fake_quantize_input(module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1.0)), 0.0).clamp(-127, 127)
    return (q * scale,)


@pytest.mark.parametrize("scheme,fmt,group_size", [
    ("W8A8", "int-quantized", None),
    ("W8A8", "pack-quantized", None),
    ("W8A16", "pack-quantized", 32),
    ("W8A16", "int-quantized", None),
], ids=["w8a8-int", "w8a8-packed", "w8a16-group32-packed", "w8a16-channel-int"])
def test_tiny_llama_matches_its_dequantized_reference(tmp_path: Path, scheme: str, fmt: str,
                                                      group_size: int | None) -> None:
    from pagoda.testing.model_parity import check_parity

    if scheme == "W8A16" and group_size is None:
        from compressed_tensors.quantization import preset_name_to_scheme

        assert preset_name_to_scheme("W8A16", ["Linear"]).weights.strategy == "group"  # the preset is grouped
        group_size = 64  # = hidden_size: one group a row for the 64-wide layers, two for down_proj
    path = make_checkpoint(_tiny_llama(), scheme, fmt, tmp_path / "ckpt", group_size)
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors" and quant["format"] == fmt
    reference = dequantized_reference(path, dynamic_activations=scheme == "W8A8")
    # W8A8: pagoda's and transformers' float activations differ in the last bits; where one element sits
    # on a rounding boundary of its per-token quantization the two round it apart, a whole int8 step
    # (measured: logprobs up to 4e-3 apart at one step of one prompt); tokens must still agree.
    atol = 1e-2 if scheme == "W8A8" else 1e-3
    report = check_parity(reference, tmp_path, model_path=path, logprob_atol=atol)
    assert report.num_tokens_compared >= 40, report


def test_checkpoint_is_served_int8_and_named_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from pagoda import LLM

    path = make_checkpoint(_tiny_llama(), "W8A8", "int-quantized", tmp_path / "ckpt")
    with caplog.at_level(logging.INFO):
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
    assert "compressed-tensors (W8A8" in caplog.text
    runner = llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner
    layer = runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.qweight.dtype == torch.int8 and layer.weight is None
    with pytest.raises(ValueError, match="does not fit the checkpoint"):
        LLM(model=str(path), skip_tokenizer_init=True, quantization="gguf", max_model_len=128)


def test_kv_cache_scheme_scales_reach_the_attention_layers(tmp_path: Path) -> None:
    """An int8 checkpoint with an fp8 kv_cache_scheme: its self_attn.k_scale / v_scale tensors (the names
    compressed-tensors writes, shape [1]) are the scales cpu_paged and torch_paged quantize the cache with."""
    from safetensors.torch import save_file

    from pagoda import LLM, SamplingParams

    path = make_checkpoint(_tiny_llama(), "W8A8", "int-quantized", tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = FP8_KV_CACHE_SCHEME
    (path / "config.json").write_text(json.dumps(config))
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([0.01 * (i + 1) * (2 if kind == "v" else 1)])
              for i in range(2) for kind in "kv"}
    save_file(scales, str(path / "kv_scales.safetensors"))

    def serve(**kwargs: Any) -> tuple[Any, list[list[int]]]:
        llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32,
                  **kwargs)
        prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 384 for j in range(4 + 2 * i)]} for i in range(4)]
        out = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        runner = llm.llm_engine.engine_core.core.model_executor.driver_worker.model_runner
        return runner.attn_layers, [list(o.outputs[0].token_ids) for o in out]

    layers, cpu_tokens = serve(kv_cache_dtype="fp8", attention_backend="cpu_paged")
    for i, layer in enumerate(layers):
        assert float(layer._k_scale) == pytest.approx(float(scales[f"model.layers.{i}.self_attn.k_scale"]))
        assert float(layer._v_scale) == pytest.approx(float(scales[f"model.layers.{i}.self_attn.v_scale"]))
    # the C++ kernel and the torch backend quantize and read with the same scales
    assert serve(kv_cache_dtype="fp8", attention_backend="torch_paged")[1] == cpu_tokens
    layers, _ = serve()  # kv_cache_dtype auto: read, not used (vLLM's handling)
    assert all(layer.kv_scales_from_checkpoint and layer._k_scale is None for layer in layers)
