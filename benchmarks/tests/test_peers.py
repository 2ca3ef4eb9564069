"""The peer comparison's table: one row per engine, same-run ratios against pagoda."""

from __future__ import annotations

from typing import Any

from benchmarks.peers import _print


def test_peer_table_prints_same_run_ratios(capsys: Any) -> None:
    _print({
        "W1/float32/pagoda": {"output_tokens_per_s": 300.0},
        "W1/float32/vllm[bind=0-1]": {"output_tokens_per_s": 200.0},
        "W2/float32/pagoda": {"decode_tokens_per_s": 30.0},
        "W2/float32/llama.cpp": {"error": "not installed"},
    })
    out = capsys.readouterr().out
    assert "ratio W1/float32: pagoda / vllm[bind=0-1] = 1.50" in out
    assert "llama.cpp" in out and "not installed" in out
