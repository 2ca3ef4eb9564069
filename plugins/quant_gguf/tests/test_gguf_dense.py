"""The dense batched path (``pagoda_quant_gguf.dense``): weight panels dequantized, then ``F.linear``.

Its dequantizer equals the torch reference's, its layer output equals F.linear on the dequantized weight
(above the threshold) and stays the block kernel's (below it), for every block type the plugin keeps, with
panels that do not divide the rows; the threshold is measured, cached and forced as documented.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from pagoda_quant_gguf import dense, kernels
from pagoda_quant_gguf.dequant import dequantize_blocks

BASIC = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
PACKED = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}

pytestmark = pytest.mark.skipif(kernels.library() is None, reason="the gguf CPU kernel cannot be built here")


def _blocks(qtype: Q, n: int, k: int) -> torch.Tensor:
    if qtype in K_QUANTS:
        blocks = torch.randint(0, 256, (n, k // 256 * quantize_size(qtype)), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(int(qtype)))
        dense._set_small_scales(blocks, int(qtype), quantize_size(qtype), torch.Generator().manual_seed(1))
        return blocks
    rng = np.random.default_rng(int(qtype))
    return torch.from_numpy(quantize(rng.standard_normal((n, k)).astype(np.float32), qtype))


def quantize_size(qtype: Q) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][1]


@pytest.mark.parametrize(("qtype", "packed"), [(q, False) for q in BASIC] + [(q, True) for q in BASIC if q in PACKED],
                         ids=lambda v: v.name if isinstance(v, Q) else ("repacked" if v else "stored"))
def test_dequantizer_equals_the_torch_reference(qtype: Q, packed: bool) -> None:
    """Any row range, of the stored or the repacked layout (45 rows: a last group of 1 stays as stored)."""
    n, k = 45, 320
    blocks = _blocks(qtype, n, k)
    weight = kernels.repack(blocks, int(qtype), k) if packed else blocks
    if packed and weight is None:
        pytest.skip("this build has no repacked kernel")
    reference = dequantize_blocks(blocks, int(qtype), k)
    lib = kernels.library()
    for row0, rows in ((0, n), (3, 9), (40, 5), (44, 1)):
        out = torch.full((rows, k), float("nan"))
        assert lib.pagoda_gguf_dequantize(int(qtype), int(packed), weight.data_ptr(), n, k, row0, rows,
                                          out.data_ptr(), 2) == 0
        torch.testing.assert_close(out, reference[row0:row0 + rows], rtol=1e-6, atol=1e-7)
    out = torch.empty(1, k)
    assert lib.pagoda_gguf_dequantize(int(qtype), int(packed), weight.data_ptr(), n, k, n, 1, out.data_ptr(), 1) == -2
    assert lib.pagoda_gguf_dequantize(int(qtype), int(packed), weight.data_ptr(), n, k, -1, 1, out.data_ptr(), 1) == -2


def test_dequantizer_refuses_what_it_does_not_handle() -> None:
    lib = kernels.library()
    blocks = _blocks(Q.Q4_K, 4, 256)
    out = torch.empty(4, 256)
    assert lib.pagoda_gguf_dequantize(int(Q.Q4_K), 0, blocks.data_ptr(), 4, 256, 0, 4, out.data_ptr(), 1) == -1
    q8 = _blocks(Q.Q8_0, 4, 64)
    assert lib.pagoda_gguf_dequantize(int(Q.Q8_0), 1, q8.data_ptr(), 4, 64, 0, 4, out.data_ptr(), 1) == -1


def _layer(qtype: Q, n: int, k: int, dtype: torch.dtype, blocks: torch.Tensor):
    from pagoda.layers import Linear
    from pagoda_quant_gguf import config

    layer = Linear(k, n, bias=True, dtype=dtype)
    # a Linear's bias is torch.empty until a checkpoint loads it: set it, or the output is whatever memory
    # the process freed last (NaN after some earlier tests, which made torch.equal fail in the full suite)
    assert layer.bias is not None
    layer.bias.data.copy_(torch.linspace(-1.0, 1.0, n, dtype=dtype))
    method = config.GGUFLinearMethod()
    method.create_weights(layer, k, [n], k, n, dtype)
    layer.quant_method = method
    layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(qtype)), None)
    layer.qweight.weight_loader(layer.qweight, blocks, None)
    method.process_weights_after_loading(layer)
    return layer, method


def _close(y: torch.Tensor, expected: torch.Tensor) -> None:
    """Float tolerance: the panels' matmuls may sum in another order than one matmul on the whole weight;
    bfloat16 output: one rounding apart."""
    tol = 1e-5 if y.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol * float(expected.abs().max()))


@pytest.mark.parametrize("qtype", BASIC + K_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_rows_below_and_above_the_threshold(qtype: Q, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced threshold 8: 7 rows are the block kernel's output exactly; 8 and 9 rows are F.linear on the
    dequantized weight (float32, rounded once to the model's dtype), over panels of 12 rows (45 = 3 x 12 + 9)."""
    monkeypatch.setenv("PAGODA_GGUF_DENSE_MIN_ROWS", "8")
    monkeypatch.setattr(dense, "PANEL_BYTES", 12 * 4 * 512)
    from pagoda_quant_gguf import config

    n, k = 45, 512
    blocks = _blocks(qtype, n, k)
    layer, method = _layer(qtype, n, k, dtype, blocks)
    assert isinstance(method.forward, config.KernelForward)
    assert method.forward.dense.panel == 12
    weight = dequantize_blocks(blocks, int(qtype), k)
    bias = torch.randn(n).to(dtype)
    for rows in (7, 8, 9):
        x = torch.randn(rows, k).to(dtype)
        y = method.apply(layer, x, bias)
        if rows < 8:
            expected = kernels.matmul(x.float(), blocks, int(qtype), k).to(dtype) + bias
            assert torch.equal(y, expected)
        else:
            expected = F.linear(x.float(), weight).to(dtype) + bias
            _close(y, expected)
            # and the block kernel's result up to its int8 activations (~0.5% of the output's range)
            block = kernels.matmul(x.float(), blocks, int(qtype), k)
            assert float((y.float() - bias.float() - block).abs().max() / block.abs().max()) < 0.03
    x3 = torch.randn(2, 5, k).to(dtype)  # leading dims: 10 rows
    _close(method.apply(layer, x3), F.linear(x3.float(), weight).to(dtype))


def test_off_keeps_the_block_kernel_at_any_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_GGUF_DENSE_MIN_ROWS", "off")
    assert dense.min_rows(int(Q.Q4_1), torch.float32) == 0
    blocks = _blocks(Q.Q4_1, 16, 64)
    layer, method = _layer(Q.Q4_1, 16, 64, torch.float32, blocks)
    x = torch.randn(300, 64)
    assert torch.equal(method.apply(layer, x), kernels.matmul(x, blocks, int(Q.Q4_1), 64))
    monkeypatch.setenv("PAGODA_GGUF_DENSE_MIN_ROWS", "-3")
    with pytest.raises(ValueError):
        dense.min_rows(int(Q.Q4_1), torch.float32)


def test_layers_of_several_types_take_the_dense_path_per_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused layer whose shards differ in type (q/k/v of two types) goes through ``config.matmul``."""
    from pagoda_quant_gguf import config

    monkeypatch.setenv("PAGODA_GGUF_DENSE_MIN_ROWS", "4")
    k = 256
    shards = [config.Shard(int(Q.Q4_0), _blocks(Q.Q4_0, 8, k)), config.Shard(int(Q.Q6_K), _blocks(Q.Q6_K, 5, k))]
    weight = torch.cat([dequantize_blocks(s.blocks, s.qtype, k) for s in shards])
    x = torch.randn(6, k)
    _close(config.matmul(shards, x, k), F.linear(x, weight))
    few = torch.randn(3, k)
    assert torch.equal(config.matmul(shards, few, k),
                       torch.cat([kernels.matmul(few, s.blocks, s.qtype, k) for s in shards], dim=-1))


def test_dense_layer_replays_in_a_kernel_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The panel loop (the dequantizer's kernel calls and the torch matmuls between them) is captured and
    replays to the eager result on new input."""
    from pagoda.cpp_extension import graph

    monkeypatch.setenv("PAGODA_GGUF_DENSE_MIN_ROWS", "4")
    monkeypatch.setattr(dense, "PANEL_BYTES", 8 * 4 * 64)
    blocks = _blocks(Q.Q4_1, 20, 64)
    layer, _ = _layer(Q.Q4_1, 20, 64, torch.bfloat16, blocks)
    x = torch.randn(6, 64).to(torch.bfloat16)
    captured, output = graph.capture(lambda: layer(x), roots=[layer, x])
    assert captured.num_kernel_calls == 3  # 20 rows in panels of 8, 8 and 4
    first = output.clone()
    x.copy_(torch.randn(6, 64).to(torch.bfloat16))
    expected = layer(x)
    assert not torch.equal(expected, first)
    captured.replay()
    assert torch.equal(output, expected)


def test_threshold_is_measured_once_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A measured threshold is one of the measured row counts (or 0: never), written to the disk cache and
    read back from it by a later process (here: the function's own cache cleared)."""
    monkeypatch.delenv("PAGODA_GGUF_DENSE_MIN_ROWS", raising=False)
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PAGODA_DISABLE_CACHE", raising=False)
    monkeypatch.setattr(dense, "ROWS", (32, 64, 128))  # a short sweep: the test checks the mechanism
    monkeypatch.setattr(dense, "TIME_LIMIT_S", 60.0)  # a loaded test machine must not refuse it (nothing cached)
    dense._measured_min_rows.cache_clear()
    try:
        rows = dense.min_rows(int(Q.Q8_0), torch.float32)
        assert rows in (0, 32, 64, 128)  # a win at the largest count alone stands (measure)
        [path] = (tmp_path / "gguf_dense").glob("*.json")
        data = json.loads(path.read_text())
        assert data["min_rows"] == rows and set(data["ratios"]) <= {"32", "64", "128"}
        path.write_text(json.dumps({"min_rows": 77, "ratios": {}}))  # the cache, not a new measurement, answers
        dense._measured_min_rows.cache_clear()
        assert dense.min_rows(int(Q.Q8_0), torch.float32) == 77
    finally:
        dense._measured_min_rows.cache_clear()
