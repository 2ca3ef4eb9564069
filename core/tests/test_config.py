"""Engine configuration: validation that names the field, vLLM aliases, sections, CLI options."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import typer
from pydantic import ValidationError
from typer.testing import CliRunner

from pagoda.config import (
    CacheConfig,
    DeviceConfig,
    EngineArgs,
    LoRAConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagoda.entrypoints.cli.engine_options import with_engine_options


def _error_fields(exc: ValidationError) -> set[str]:
    return {".".join(str(part) for part in err["loc"]) for err in exc.errors()}


@pytest.mark.parametrize(
    ("kwargs", "field", "why"),
    [
        ({"block_size": 0}, "block_size", "greater than 0"),
        ({"dtype": "fp8"}, "dtype", "'auto'"),
        ({"max_num_seqs": -1}, "max_num_seqs", "greater than 0"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "less than or equal to 1"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy", "'fcfs'"),
        ({"max_model_len": "long"}, "max_model_len", "valid integer"),
        ({"no_such_option": 1}, "no_such_option", "Extra inputs are not permitted"),
    ],
)
def test_validation_errors_name_the_field_and_why(kwargs: dict[str, Any], field: str, why: str) -> None:
    with pytest.raises(ValidationError) as caught:
        EngineArgs(**kwargs)
    assert _error_fields(caught.value) == {field}
    assert field in str(caught.value)
    assert why in str(caught.value)


def test_world_size_is_tensor_times_pipeline_ranks() -> None:
    parallel = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=3).create_engine_config().parallel_config
    assert parallel.world_size == 6
    assert parallel.executor_backend == "mp"
    with pytest.raises(ValidationError, match="world size 2"):
        EngineArgs(pipeline_parallel_size=2, distributed_executor_backend="uni").create_engine_config()


def test_executor_backend_defaults_and_refusals() -> None:
    assert EngineArgs().create_engine_config().parallel_config.executor_backend == "uni"
    assert EngineArgs(tensor_parallel_size=2).create_engine_config().parallel_config.executor_backend == "mp"
    with pytest.raises(ValidationError, match="'uni' runs one rank"):
        EngineArgs(tensor_parallel_size=2, distributed_executor_backend="uni").create_engine_config()
    with pytest.raises(ValidationError, match="distributed_executor_backend"):
        EngineArgs(distributed_executor_backend="threads")


def test_num_gpu_blocks_override_is_vllms_name_for_num_kv_blocks() -> None:
    assert EngineArgs(num_gpu_blocks_override=128).num_kv_blocks == 128
    with pytest.raises(ValidationError, match="num_kv_blocks"):
        EngineArgs(num_gpu_blocks_override=0)


def test_assignment_is_validated_too() -> None:
    args = EngineArgs()
    with pytest.raises(ValidationError, match="block_size"):
        args.block_size = -16


def test_create_engine_config_fills_every_section() -> None:
    args = EngineArgs(
        model="/models/tiny",
        dtype="float32",
        max_model_len=512,
        hf_overrides={"architectures": ["LlamaForCausalLM"]},
        block_size=32,
        enable_prefix_caching=False,
        num_gpu_blocks_override=64,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        scheduling_policy="priority",
        device="cpu",
        load_format="dummy",
    )
    config = args.create_engine_config()

    assert isinstance(config, EngineConfig)
    assert config.model_config_ == config.model
    assert config.model == ModelConfig(
        model="/models/tiny",
        dtype="float32",
        max_model_len=512,
        hf_overrides={"architectures": ["LlamaForCausalLM"]},
    )
    assert config.cache_config == CacheConfig(block_size=32, enable_prefix_caching=False, num_kv_blocks=64)
    assert config.scheduler_config == SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=1024, scheduling_policy="priority"
    )
    assert config.parallel_config == ParallelConfig()
    assert config.device_config == DeviceConfig(device="cpu")
    assert config.load_config == LoadConfig(load_format="dummy")
    assert config.plugins is None
    assert config.registered_models == {}


def test_engine_config_survives_pickling_for_worker_processes() -> None:
    config = EngineArgs(max_model_len=256, block_size=16).create_engine_config()
    config.plugins = ["cpu", "llama"]
    config.registered_models = {"TinyForCausalLM": "tiny:TinyForCausalLM"}

    clone = pickle.loads(pickle.dumps(config))
    assert clone == config
    assert clone.plugins == ["cpu", "llama"]


def test_every_engine_arg_belongs_to_exactly_one_section() -> None:
    sections = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig, LoadConfig, LoRAConfig)
    section_fields = [name for section in sections for name in section.model_fields]
    assert len(section_fields) == len(set(section_fields))
    # structured_outputs_config is a whole section (as in vLLM), passed as is; reasoning_parser (vLLM's flat
    # --reasoning-parser) lands in it; enable_lora (vLLM's flag) decides whether lora_config exists;
    # speculative_config is a whole section too
    assert (set(section_fields) | {"structured_outputs_config", "reasoning_parser", "enable_lora", "speculative_config"}
            == set(EngineArgs.model_fields))
    # inherited, not re-declared: each EngineArgs field is its section's (default, bounds, description)
    for section in sections:
        assert issubclass(EngineArgs, section)
        for name, info in section.model_fields.items():
            assert repr(EngineArgs.model_fields[name]) == repr(info), name


def test_sections_know_which_fields_the_user_set() -> None:
    config = EngineArgs(block_size=32, enable_chunked_prefill=True).create_engine_config()
    assert config.cache_config.model_fields_set == {"block_size"}
    assert config.scheduler_config.model_fields_set == {"enable_chunked_prefill"}


def test_structured_outputs_config_from_args_and_cli_json() -> None:
    assert EngineArgs().create_engine_config().structured_outputs_config.backend == "auto"
    config = EngineArgs(structured_outputs_config={"backend": "xgrammar"}).create_engine_config()
    assert config.structured_outputs_config.backend == "xgrammar"
    with pytest.raises(ValueError):
        EngineArgs(structured_outputs_config={"backend": "xgrammar", "nope": 1})


def test_speculative_config_from_args_and_cli_json() -> None:
    from pagoda.entrypoints.cli.engine_options import engine_args_from_cli

    assert EngineArgs().create_engine_config().speculative_config is None
    args = engine_args_from_cli({"speculative_config": '{"method": "ngram", "num_speculative_tokens": 4}'})
    spec = args.create_engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        "ngram", 4, 5, 5)
    # vLLM's inference of the method from the model
    assert EngineArgs(speculative_config={"model": "[ngram]", "num_speculative_tokens": 2,
                                          "prompt_lookup_max": 3}).speculative_config.method == "ngram"
    assert EngineArgs(speculative_config={"method": "suffix"}).speculative_config.num_speculative_tokens == 24
    with pytest.raises(ValueError, match="draft_tensor_parallel_size"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="prompt_lookup"):
        EngineArgs(speculative_config={"method": "suffix", "prompt_lookup_max": 2})


def test_reasoning_parser_lands_in_the_structured_outputs_section() -> None:
    config = EngineArgs(reasoning_parser="qwen3").create_engine_config().structured_outputs_config
    assert (config.reasoning_parser, config.enable_in_reasoning) == ("qwen3", False)
    same = EngineArgs(reasoning_parser="qwen3", structured_outputs_config={"reasoning_parser": "qwen3",
                                                                          "enable_in_reasoning": True})
    assert same.create_engine_config().structured_outputs_config.enable_in_reasoning
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs(reasoning_parser="qwen3",
                   structured_outputs_config={"reasoning_parser": "deepseek_r1"}).create_engine_config()


# -- CLI options derived from EngineArgs ----------------------------------------------------


def _cli_app(received: list[EngineArgs]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @with_engine_options()
    def run(engine_args: EngineArgs, verbose: bool = False) -> None:
        received.append(engine_args)

    return app


def _invoke(args: list[str]) -> tuple[Any, list[EngineArgs]]:
    received: list[EngineArgs] = []
    result = CliRunner().invoke(_cli_app(received), args)
    return result, received


def test_cli_defaults_equal_engine_args_defaults() -> None:
    result, received = _invoke([])
    assert result.exit_code == 0, result.output
    assert received == [EngineArgs()]


def test_cli_exposes_engine_options() -> None:
    result, received = _invoke(
        [
            "--max-model-len", "2048",
            "--no-enable-prefix-caching",
            "--hf-overrides", '{"architectures": ["Qwen2ForCausalLM"], "rope_theta": 10000}',
            "--dtype", "bfloat16",
            "--block-size", "32",
            "--verbose",
        ]
    )
    assert result.exit_code == 0, result.output
    (args,) = received
    assert args.max_model_len == 2048
    assert args.enable_prefix_caching is False
    assert args.hf_overrides == {"architectures": ["Qwen2ForCausalLM"], "rope_theta": 10000}
    assert args.dtype == "bfloat16"
    assert args.block_size == 32


def test_cli_enable_flag_turns_prefix_caching_back_on() -> None:
    result, received = _invoke(["--enable-prefix-caching"])
    assert result.exit_code == 0, result.output
    assert received[0].enable_prefix_caching is True


def test_cli_help_lists_engine_options_with_descriptions() -> None:
    result = CliRunner().invoke(_cli_app([]), ["--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0
    for flag in ("--max-model-len", "--enable-prefix-caching", "--no-enable-prefix-caching", "--hf-overrides"):
        assert flag in result.output
    assert "Context length" in result.output


def test_cli_bad_json_names_the_option() -> None:
    result, received = _invoke(["--hf-overrides", "{not json"])
    assert result.exit_code != 0
    assert received == []
    assert "--hf-overrides must be JSON" in result.output


def test_cli_invalid_value_names_the_field() -> None:
    result, received = _invoke(["--block-size", "0"])
    assert result.exit_code != 0
    assert received == []
    assert "block_size" in str(result.exception) + result.output


def test_kv_cache_dtype_is_vllms_engine_arg_for_cache_dtype() -> None:
    config = EngineArgs(kv_cache_dtype="fp8_e5m2", calculate_kv_scales=True).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8_e5m2" and config.cache_config.calculate_kv_scales
    assert EngineArgs(cache_dtype="fp8").kv_cache_dtype == "fp8"  # CacheConfig's name is taken too
    args = EngineArgs()
    args.kv_cache_dtype = "fp8_e4m3"
    assert args.create_engine_config().cache_config.cache_dtype == "fp8_e4m3"
    with pytest.raises(ValidationError):
        EngineArgs(kv_cache_dtype="fp4")


def test_vllms_none_defaults_and_lora_switches() -> None:
    # what lm-eval's vllm model passes to LLM(...) on every run
    args = EngineArgs(max_num_seqs=None, enable_lora=False, max_lora_rank=16, tokenizer_mode="auto")
    assert args.max_num_seqs == 256 and args.tokenizer_mode == "auto"
    assert "max_num_seqs" not in args.model_fields_set  # None = "not given", so the default's source stays
    assert args.create_engine_config().lora_config is None
    with pytest.raises(ValidationError, match="tokenizer_mode"):
        EngineArgs(tokenizer_mode="slow")


def test_lora_config_is_built_only_with_enable_lora() -> None:
    assert EngineArgs().create_engine_config().lora_config is None
    config = EngineArgs(enable_lora=True, max_loras=4, max_lora_rank=32).create_engine_config()
    assert config.lora_config == LoRAConfig(max_loras=4, max_lora_rank=32)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineArgs(max_loras=2).create_engine_config()
