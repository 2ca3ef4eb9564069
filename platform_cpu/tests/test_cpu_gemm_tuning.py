"""The packed matmul's per-CPU tuning: the measurement, its cache, and what the platform takes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagoda.config import EngineArgs
from pagoda_platform_cpu import gemm as gemm_module
from pagoda_platform_cpu import gemm_tuning
from pagoda_platform_cpu.gemm import PackedGemmKernel
from pagoda_platform_cpu.gemm_tuning import BUDGETS, GemmTuning, TooBusy, _ranges
from pagoda_platform_cpu.platform import CpuPlatform

needs_bf16_kernel = pytest.mark.skipif(
    gemm_module.unavailable_reason(torch.bfloat16) is not None, reason=str(gemm_module.unavailable_reason(torch.bfloat16))
)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    monkeypatch.delenv("PAGODA_CPU_GEMM_TUNE", raising=False)
    gemm_tuning.tuning.cache_clear()
    yield
    gemm_tuning.tuning.cache_clear()


def test_row_ranges_around_the_measured_points() -> None:
    rows = (64, 256, 512, 1024, 2048)
    assert _ranges(rows, set()) == ()
    # a point owns the rows up to the geometric midpoints with its neighbours; the first never reaches decode sizes
    assert _ranges(rows, {512}) == ((363, 725),)
    assert _ranges(rows, {512, 1024}) == ((363, 1449),)
    assert _ranges(rows, {64, 2048}) == ((48, 129), (1449, 0))
    t = GemmTuning(dtype="bfloat16", threads=1, onednn_rows=_ranges(rows, {512, 2048}))
    assert [r for r in (1, 4, 362, 363, 724, 725, 1448, 1449, 100_000) if t.uses_onednn(r)] == [363, 724, 1449, 100_000]


@needs_bf16_kernel
def test_rows_handed_to_f_linear_are_f_linear_exactly_and_the_rest_stay_packed() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 48, generator=g).to(torch.bfloat16)
    b = torch.randn(70, generator=g).to(torch.bfloat16)
    kernel = PackedGemmKernel((torch.bfloat16,), onednn_rows=((10, 20),))
    prepared = kernel.prepare(w)
    assert prepared.plain is not None
    plain_only = PackedGemmKernel((torch.bfloat16,))
    assert plain_only.prepare(w).plain is None  # no plain copy unless some rows need it
    for rows in (3, 10, 19, 20):
        x = torch.randn(rows, 48, generator=g).to(torch.bfloat16)
        out = kernel.apply(x, prepared, b)
        packed_out = plain_only.apply(x, plain_only.prepare(w), b)
        if 10 <= rows < 20:
            assert torch.equal(out, F.linear(x, w, b))
        else:
            assert torch.equal(out, packed_out)
    with pytest.raises(ValueError, match="onednn_rows"):
        PackedGemmKernel((torch.bfloat16,), onednn_rows=((5, 5),))


def test_turned_off_gives_the_defaults_without_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_CPU_GEMM_TUNE", "0")
    monkeypatch.setattr(gemm_tuning, "measure", lambda *a, **k: pytest.fail("measured"))
    t = gemm_tuning.tuning(torch.float32)
    assert (t.row_tile, t.onednn_rows, t.max_num_batched_tokens, t.measured) == (8, (), 512, False)
    assert "PAGODA_CPU_GEMM_TUNE=0" in t.describe()


def test_measured_once_then_read_from_the_disk_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    made = GemmTuning(dtype="bfloat16", threads=1, row_tile=14, onednn_rows=((363, 725),), max_num_batched_tokens=1024,
                      pagoda_gflops={512: 600.0}, f_linear_gflops={512: 900.0}, tile_gflops={8: 500.0, 14: 600.0},
                      measured=True, peak_gflops=1000.0)
    calls = []
    monkeypatch.setattr(gemm_tuning, "measure", lambda dtype: calls.append(dtype) or made)
    assert gemm_tuning.tuning(torch.bfloat16) == made
    files = list((tmp_path / "cache" / "gemm_tuning").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["row_tile"] == 14
    gemm_tuning.tuning.cache_clear()
    monkeypatch.setattr(gemm_tuning, "measure", lambda dtype: pytest.fail("measured again"))
    assert gemm_tuning.tuning(torch.bfloat16) == made  # from disk, equal field by field (int keys, tuples)
    assert calls == [torch.bfloat16]


def test_an_untrusted_measurement_gives_defaults_and_is_not_cached(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def busy(dtype: torch.dtype) -> GemmTuning:
        raise TooBusy("the matmul reached 30 of the core's 236 GFLOP/s")

    monkeypatch.setattr(gemm_tuning, "measure", busy)
    t = gemm_tuning.tuning(torch.float32)
    assert (t.row_tile, t.max_num_batched_tokens, t.measured) == (8, 512, False) and "not trusted" in t.describe()
    assert not (tmp_path / "cache" / "gemm_tuning").exists()


@needs_bf16_kernel
def test_the_real_measurement_returns_choices_it_has_or_says_it_was_too_busy() -> None:
    try:
        t = gemm_tuning.measure(torch.bfloat16, repeats=2, time_limit_s=20.0)
    except TooBusy as exc:
        assert "GFLOP/s" in str(exc) or "took over" in str(exc)
        return
    assert t.measured and t.row_tile in gemm_module.ROW_TILES and t.max_num_batched_tokens in BUDGETS
    assert set(t.pagoda_gflops) == set(gemm_tuning.ROWS) and all(v > 0 for v in t.f_linear_gflops.values())
    assert 0 < t.tile_gflops[t.row_tile] <= 1.05 * t.peak_gflops  # nothing runs faster than the FMA peak
    assert torch.get_num_threads() >= 1


@needs_bf16_kernel
def test_the_api_process_leaves_the_step_budget_to_the_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # config_defaults runs in the API process: it neither measures nor waits for the matmul's build
    monkeypatch.setattr(gemm_tuning, "measure", lambda dtype: pytest.fail("measured in the API process"))
    monkeypatch.setattr("pagoda_platform_cpu.platform.start_kernel_builds", lambda: None)
    config = EngineArgs(model="unused", dtype="bfloat16").create_engine_config()
    defaults = CpuPlatform().config_defaults(config)
    assert defaults.max_num_batched_tokens is None and defaults.max_num_batched_tokens_in_engine_core


@needs_bf16_kernel
def test_each_dtype_takes_its_own_budget_measured_in_the_engine_core_and_both_processes_log_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pagoda.config import ResolvedModel
    from pagoda.engine import config_resolution

    budgets = {torch.bfloat16: 1024, torch.float32: 2048}
    measured: list[torch.dtype] = []

    def measure(dtype: torch.dtype) -> GemmTuning:
        measured.append(dtype)
        return GemmTuning(dtype=str(dtype), threads=1, max_num_batched_tokens=budgets[dtype], measured=True)

    monkeypatch.setattr(gemm_tuning, "measure", measure)
    monkeypatch.setattr("pagoda_platform_cpu.platform.start_kernel_builds", lambda: None)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        def resolved(model: object, platform: CpuPlatform, download_dir: object, dtype: torch.dtype = dtype) -> ResolvedModel:
            return ResolvedModel(source=None, hf_config=None, text_config=None, dtype=dtype,
                                 max_model_len=256, vocab_size=0)

        monkeypatch.setattr(config_resolution, "resolve_model", resolved)
        config = EngineArgs(model="unused", dtype=name, device="cpu").create_engine_config()
        caplog.clear()
        with caplog.at_level("INFO", logger="pagoda.engine.config_resolution"):
            platform = config_resolution.prepare_engine_config(config)
        assert measured == list(budgets)[:len(measured)] and len(measured) == list(budgets).index(dtype)
        assert config.scheduler_config.max_num_batched_tokens is None
        assert ("scheduler_config.max_num_batched_tokens = None (platform default: decided in the engine core "
                "(this CPU's measured matmul curve") in caplog.text
        caplog.clear()
        with caplog.at_level("INFO", logger="pagoda.engine.config_resolution"):
            config_resolution.resolve_in_engine_core(config, platform)  # what EngineCore does first
        assert config.max_num_batched_tokens == budgets[dtype]
        assert (f"scheduler_config.max_num_batched_tokens = {budgets[dtype]} (platform default: decided in the "
                "engine core (this CPU's measured matmul curve") in caplog.text
        config_resolution.resolve_in_engine_core(config, platform)  # once only
    assert measured == [torch.bfloat16, torch.float32]
    # the user's value is not the platform's: nothing is left to the engine core, the log says whose it is
    config = EngineArgs(model="unused", dtype="bfloat16", device="cpu", max_num_batched_tokens=300).create_engine_config()
    caplog.clear()
    with caplog.at_level("INFO", logger="pagoda.engine.config_resolution"):
        platform = config_resolution.prepare_engine_config(config)
        config_resolution.resolve_in_engine_core(config, platform)
    assert config.scheduler_config.max_num_batched_tokens == 300
    assert "scheduler_config.max_num_batched_tokens = 300 (user)" in caplog.text
    assert measured == [torch.bfloat16, torch.float32]


@needs_bf16_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_peak_in_cpu_time_is_never_below_the_peak_in_wall_time(dtype: torch.dtype) -> None:
    # One thread's CPU time never exceeds the wall time of the same loop, so its rate is at least the
    # wall-time rate (a 10% allowance for clock-speed drift between the two runs); on a shared core it
    # is the higher one, the neighbours' turns not counted.
    wall = max(gemm_module.measure_peak_gflops(dtype, 1) for _ in range(3))
    cpu = max(gemm_module.measure_peak_gflops_thread_time(dtype) for _ in range(3))
    assert cpu >= 0.9 * wall > 0
    flops_per_cycle = 64 if dtype == torch.bfloat16 else 32  # >= one 512-bit multiply-add a cycle
    assert cpu < flops_per_cycle * 2 * 6.0  # at most two a cycle, under 6 GHz: the FLOP count is right
