"""GGUF files at tensor_parallel_size=2 (mp executor, gloo on loopback) against the same file at one rank.

The linear layers keep their blocks, each rank its rows (column-parallel) or its whole blocks of every
row (row-parallel); the token table and the LM head, split by vocabulary rows padded to the ranks, are
loaded dequantized at TP > 1. A split inside a block (K-quants hold 256 values a block) is refused by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from pagoda import LLM
from pagoda.testing.quantized_checkpoint import W8A8_LOGPROB_ATOL, W8A8_TIE_GAP
from pagoda.testing.tensor_parallel import check_tensor_parallel_matches_single_rank
from pagoda_quant_gguf import kernels
from plugins.quant_gguf.tests.test_gguf_models import VOCAB, write_tiny_llama


@pytest.fixture(autouse=True)
def _loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_1], ids=lambda q: q.name)
def test_tp2_serves_what_one_rank_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: Q) -> None:
    """The torch reference path (float activations): the split changes only the order of the sums."""
    monkeypatch.setenv(kernels.KERNEL_ENV, "0")  # the workers too
    monkeypatch.setattr(kernels, "_library", None)
    # token table and head in F32, so both runs hold the same float vocabulary layers (at one rank a
    # quantized table stays in blocks, at two it is dequantized: that difference is not the split's)
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype, vocab_qtype=Q.F32)
    report = check_tensor_parallel_matches_single_rank(path, VOCAB, new_tokens=6, llm_kwargs={"max_model_len": 64})
    print(qtype.name, report)
    assert report.num_tokens_compared >= 66, report


def test_tp2_on_the_cpu_kernel_with_a_quantized_vocabulary(tmp_path: Path) -> None:
    """Every matrix Q8_0, the C++ kernel: it rounds activations to int8 per block of 32 (as llama.cpp does),
    so a last-bit difference from the row-parallel sums can move an element a whole int8 step, as W8A8's
    per-token rounding does (the same bounds); and at two ranks the table and head are dequantized, at one
    kept in blocks."""
    path = write_tiny_llama(tmp_path / "tiny.gguf", Q.Q8_0)
    report = check_tensor_parallel_matches_single_rank(path, VOCAB, new_tokens=6, logprob_atol=W8A8_LOGPROB_ATOL,
                                                       tie_gap=W8A8_TIE_GAP, llm_kwargs={"max_model_len": 64})
    print("Q8_0 kernel", report)
    assert report.num_tokens_compared >= 50, report


def test_a_split_inside_a_k_quant_block_is_refused(tmp_path: Path) -> None:
    # attn_output has 256 inputs: 128 a rank, half of one Q4_K block of 256
    path = write_tiny_llama(tmp_path / "tiny.gguf", Q.Q4_K)
    with pytest.raises(Exception, match="gguf Q4_K blocks of 256"):
        LLM(model=str(path), skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=8, block_size=16,
            tensor_parallel_size=2, distributed_executor_backend="mp")
