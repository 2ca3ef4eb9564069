"""The quantization contract: methods registered by plugins, chosen per checkpoint and platform,
installed on a model's layers before its weights load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from pagoda.layers import Embedding, Linear
from pagoda.model_loader.source import ModelSource
from pagoda.models.interface import SupportsQuant
from pagoda.plugins import PluginManager, QuantizationSpec, hookimpl
from pagoda.quantization import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    get_quantization_config,
    quantization_methods,
    resolve_quantization,
)
from pagoda.quantization.model import checkpoint_module_filter, process_weights_after_loading, quantize_model


class Int8RowMethod(LinearMethodBase):
    """A weight-only int8 method with one scale per output row: small, but a real method."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],  # type: ignore[override]
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra: Any) -> None:
        layer.register_parameter("weight", None)
        for name, shape, dtype in (("qweight", (output_size, input_size), torch.int8), ("scales", (output_size,), torch.float32)):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = lambda p, loaded, shard_id: p.data.copy_(loaded)  # type: ignore[attr-defined]
            layer.register_parameter(name, param)
        self.processed = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.dequantized = layer.qweight.float() * layer.scales[:, None]
        self.processed = True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        return torch.nn.functional.linear(x, layer.dequantized, bias)


class Int8RowConfig(QuantizationConfig):
    def __init__(self, ignore: list[str]) -> None:
        super().__init__()
        self.ignore = ignore

    @classmethod
    def get_name(cls) -> str:
        return "int8-row"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Int8RowConfig:
        return cls(cls.get_from_keys_or(config, ["ignore"], []))

    def is_layer_skipped(self, prefix: str) -> bool:
        return prefix in self.ignore

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, Linear) and not self.is_layer_skipped(prefix):
            return Int8RowMethod()
        return None


class QuantPlugin:
    PAGODA_PLUGIN_API_VERSION = "1.0"

    @hookimpl
    def pagoda_register_quantization_methods(self) -> list[QuantizationSpec]:
        return [QuantizationSpec(name="int8-row", cls=f"{__name__}:Int8RowConfig")]


class TinyModel(nn.Module, SupportsQuant):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.embed = Embedding(10, 8, torch.float32)
        self.qkv_proj = Linear(8, 12, False, torch.float32)
        self.out = Linear(12, 8, True, torch.float32)
        self.lm_head = Linear(8, 10, False, torch.float32)
        self.lm_head.weight = self.embed.weight


@pytest.fixture
def quant_plugin(isolated_plugin_manager: PluginManager) -> PluginManager:
    isolated_plugin_manager.register(QuantPlugin(), name="int8-row", kind="quantization")
    return isolated_plugin_manager


def _platform(supported: list[str]) -> Any:
    return SimpleNamespace(name="testplat", supported_quantization=supported)


def _hf_source(tmp_path: Path) -> ModelSource:
    return ModelSource(kind="hf", path=tmp_path)


def _hf_config(quant: dict[str, Any] | None) -> Any:
    return SimpleNamespace(quantization_config=quant) if quant is not None else SimpleNamespace()


def test_registered_method_is_listed_and_loaded(quant_plugin: PluginManager) -> None:
    assert "int8-row" in quantization_methods()
    assert get_quantization_config("int8-row") is Int8RowConfig
    info = next(i for i in quant_plugin.infos if i.name == "int8-row")
    assert info.provides == ["quantization_methods:int8-row"]


def test_unknown_method_names_the_installed_ones(quant_plugin: PluginManager) -> None:
    with pytest.raises(ValueError, match=r"'gptq' is not installed \(installed methods: int8-row\)"):
        get_quantization_config("gptq")


def test_method_from_the_checkpoint_config(quant_plugin: PluginManager, tmp_path: Path) -> None:
    hf = _hf_config({"quant_method": "int8-row", "ignore": ["lm_head"]})
    config = resolve_quantization(None, _hf_source(tmp_path), hf, _platform(["int8-row"]), torch.float32)
    assert isinstance(config, Int8RowConfig) and config.ignore == ["lm_head"]


def test_platform_that_cannot_run_the_method_says_so(quant_plugin: PluginManager, tmp_path: Path) -> None:
    hf = _hf_config({"quant_method": "int8-row"})
    with pytest.raises(ValueError, match=r"platform 'testplat' cannot run quantization 'int8-row' \(it runs: gguf\)"):
        resolve_quantization(None, _hf_source(tmp_path), hf, _platform(["gguf"]), torch.float32)


def test_requested_method_must_fit_the_checkpoint(quant_plugin: PluginManager, tmp_path: Path) -> None:
    hf = _hf_config({"quant_method": "awq"})
    with pytest.raises(ValueError, match=r"quantization='int8-row' does not fit the checkpoint, which is stored as 'awq'"):
        resolve_quantization("int8-row", _hf_source(tmp_path), hf, _platform(["int8-row"]), torch.float32)


def test_unsupported_activation_dtype_is_refused(quant_plugin: PluginManager, tmp_path: Path) -> None:
    hf = _hf_config({"quant_method": "int8-row"})
    with pytest.raises(ValueError, match="activations in float32, not bfloat16"):
        resolve_quantization(None, _hf_source(tmp_path), hf, _platform(["int8-row"]), torch.bfloat16)


def test_none_dequantizes_gguf_only(quant_plugin: PluginManager, tmp_path: Path) -> None:
    hf = _hf_config({"quant_method": "int8-row"})
    with pytest.raises(ValueError, match="does not dequantize"):
        resolve_quantization("none", _hf_source(tmp_path), hf, _platform(["int8-row"]), torch.float32)
    assert resolve_quantization(None, _hf_source(tmp_path), _hf_config(None), _platform([]), torch.float32) is None


def test_quantize_model_installs_methods_and_loads_through_weight_loaders() -> None:
    torch.manual_seed(0)
    model = TinyModel()
    quantized = quantize_model(model, Int8RowConfig(ignore=["out"]))
    # the tied head follows the embedding, which this method leaves in float
    assert quantized == {"qkv_proj"}
    assert model.qkv_proj.weight is None and model.out.quant_method is None and model.lm_head.quant_method is None
    keep = checkpoint_module_filter(model, quantized)
    assert keep("q_proj.weight") and keep("qkv_proj.weight") and not keep("out.weight") and not keep("embed.weight")
    q = torch.randint(-127, 128, (12, 8), dtype=torch.int8)
    scales = torch.rand(12)
    params = dict(model.named_parameters())
    params["qkv_proj.qweight"].weight_loader(params["qkv_proj.qweight"], q, None)
    params["qkv_proj.scales"].weight_loader(params["qkv_proj.scales"], scales, None)
    assert process_weights_after_loading(model) == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(model.qkv_proj(x), x @ (q.float() * scales[:, None]).T)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = Linear(4, 4, False, torch.float32)


def test_family_without_quant_support_is_refused() -> None:
    with pytest.raises(ValueError, match="Plain does not load quantized weights .*does not declare SupportsQuant"):
        quantize_model(Plain(), Int8RowConfig(ignore=[]))


class Declined(TinyModel):
    quant_unsupported_reason = "its projections are no Linear layers"


def test_architecture_that_declines_quant_is_refused_with_its_reason() -> None:
    with pytest.raises(ValueError, match="Declined does not load quantized weights .its projections are no Linear"):
        quantize_model(Declined(), Int8RowConfig(ignore=[]))


def test_family_without_quant_support_loads_dequantized_when_the_method_was_only_detected() -> None:
    # a GGUF file's method found from its tensor types: the family loads it dequantized, as before
    config = Int8RowConfig(ignore=[])
    config.dequantize_unsupported = True
    model = Plain()
    assert quantize_model(model, config) == set()
    assert model.proj.quant_method is None and checkpoint_module_filter(model, set()) is None


def test_config_that_does_not_split_across_ranks_is_refused_at_tensor_parallel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pagoda.quantization.model as quant_model

    monkeypatch.setattr(quant_model, "get_tensor_model_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"'int8-row' quantization runs with tensor_parallel_size=1 only \(its "
                                         r"methods do not split their weights across ranks\)"):
        quantize_model(TinyModel(), Int8RowConfig(ignore=[]))

    class SplittingConfig(Int8RowConfig):
        supports_tensor_parallel = True

    assert quantize_model(TinyModel(), SplittingConfig(ignore=["out"])) == {"qkv_proj"}
