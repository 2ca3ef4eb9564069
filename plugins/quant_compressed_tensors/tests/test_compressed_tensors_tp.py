"""compressed-tensors int8 checkpoints at tensor_parallel_size=2 (mp executor, gloo on loopback) against the
same checkpoint at one rank: each rank loads its slice of the int8 weight and of its scales.

W8A16 computes the same sums split in two: greedy tokens equal, logprobs within float32 rounding.
W8A8 quantizes each rank's slice of a row-parallel layer's input with that slice's own per-token
scale (as vLLM does), not the whole row's: its logprobs move by int8 rounding, so the bounds are
``W8A8_LOGPROB_ATOL`` / ``W8A8_TIE_GAP`` (a token may differ only at such a near-tie).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.testing.quantized_checkpoint import W8A8_LOGPROB_ATOL, W8A8_TIE_GAP
from pagoda.testing.tensor_parallel import check_tensor_parallel_matches_single_rank
from plugins.quant_compressed_tensors.tests.test_compressed_tensors import _tiny_llama, make_checkpoint


@pytest.mark.parametrize("scheme,fmt,group_size", [
    ("W8A8", "int-quantized", None),
    ("W8A16", "pack-quantized", 32),
], ids=["w8a8-channel-int", "w8a16-group32-packed"])
def test_tp2_serves_what_one_rank_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheme: str, fmt: str,
                                         group_size: int | None) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    path = make_checkpoint(_tiny_llama(), scheme, fmt, tmp_path / "ckpt", group_size)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["format"] == fmt
    w8a8 = scheme == "W8A8"
    report = check_tensor_parallel_matches_single_rank(
        path, 384, logprob_atol=W8A8_LOGPROB_ATOL if w8a8 else 1e-3, tie_gap=W8A8_TIE_GAP if w8a8 else 1e-3)
    print(scheme, report)
    assert report.num_tokens_compared >= 40, report
