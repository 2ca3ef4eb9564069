"""GPTQ and AWQ checkpoints at tensor_parallel_size=2 (mp executor, gloo on loopback) against the same checkpoint
at one rank: each rank loads its slice of qweight / qzeros / scales / g_idx (output columns of q/k/v, gate/up;
input rows of o_proj, down_proj on whole groups), and a row-parallel layer adds its bias once, after the sum.
Same sums split in two: greedy tokens equal, logprobs within float32 rounding. The slicing itself, and the
refusals of splits that are not on a pack / group boundary, are checked in one process
(``test_int4_tp_slices.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from int4_checkpoints import write_checkpoint

from pagoda.testing.model_parity import build_tiny_model
from pagoda.testing.tensor_parallel import check_tensor_parallel_matches_single_rank


def _tiny_llama_with_biases() -> Any:
    """Biases on every projection: o_proj's and down_proj's (row-parallel) must be added once, not per rank."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
    return build_tiny_model(cfg, seed=0)


def _tiny_qwen2() -> Any:
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    return build_tiny_model(cfg, seed=0)


CASES = {
    "gptq-g32-biases": (_tiny_llama_with_biases, dict(method="gptq", group_size=32)),
    # act order: every rank keeps all groups of o_proj / down_proj, g_idx sliced; q/k/v biased, each its own g_idx
    "gptq-g16-desc_act-qwen2": (_tiny_qwen2, dict(method="gptq", group_size=16, desc_act=True)),
    "gptq8-g32": (_tiny_qwen2, dict(method="gptq", group_size=32, bits=8)),
    "awq-g32-biases": (_tiny_llama_with_biases, dict(method="awq", group_size=32)),
    "awq-g-1": (_tiny_qwen2, dict(method="awq", group_size=-1)),  # one group: the scales stay whole
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_serves_what_one_rank_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    build, kwargs = CASES[case]
    path = write_checkpoint(build(), tmp_path / "ckpt", **kwargs)  # type: ignore[arg-type]
    report = check_tensor_parallel_matches_single_rank(path, 384)
    print(case, report)
    assert report.num_tokens_compared >= 80, report
