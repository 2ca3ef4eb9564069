"""Sampler against a per-row reference written in plain numpy, plus the batch bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagoda.sample import LogprobsTensors, Sampler, SamplingBatch, gather_logprobs, to_sample_logprobs
from pagoda.sample.sampler import argmax_rows
from pagoda.sample.truncation import apply_top_k_only, apply_top_k_top_p, apply_top_k_top_p_by_candidates
from pagoda.sampling_params import SamplingParams

VOCAB = 32


def reference_constrained(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """Everything up to (not including) temperature, one token at a time."""
    out = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        for token in range(len(out)):
            if token not in params.allowed_token_ids:
                out[token] = -np.inf
    for word in params.bad_words_token_ids or []:
        if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
            out[word[-1]] = -np.inf
    if len(output) < params.min_tokens:
        for token in params.all_stop_token_ids:
            out[token] = -np.inf
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    for token in range(len(out)):
        count = output.count(token)
        if count or token in prompt:
            if out[token] > 0:
                out[token] /= params.repetition_penalty
            else:
                out[token] *= params.repetition_penalty
        out[token] -= params.frequency_penalty * count
        out[token] -= params.presence_penalty * (count > 0)
    return out


def softmax(values: np.ndarray) -> np.ndarray:
    shifted = np.exp(values - values[np.isfinite(values)].max())
    return shifted / shifted.sum()


def reference_processed(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """The logits the random draw is made from (greedy rows: the constrained logits)."""
    out = reference_constrained(logits, params, prompt, output)
    if params.temperature < 1e-5:
        return out
    out = out / params.temperature
    if params.min_p > 0:
        probs = softmax(out)
        out[probs < params.min_p * probs.max()] = -np.inf
    if params.top_k > 0:
        kth = np.sort(out)[::-1][params.top_k - 1]
        out[out < kth] = -np.inf
    if params.top_p < 1.0:
        probs = softmax(out)
        order = np.argsort(-probs, kind="stable")
        mass_before = np.concatenate(([0.0], np.cumsum(probs[order])[:-1]))
        out[order[mass_before >= params.top_p]] = -np.inf
    return out


MIXED_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.8),
    SamplingParams(temperature=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5),
    SamplingParams(temperature=0.6, presence_penalty=-1.0, top_k=10, logit_bias={3: 2.5, 9: -4.0}),
    SamplingParams(temperature=1.1, min_p=0.02, top_p=0.9, top_k=12, repetition_penalty=1.1),
]


def build_batch(
    params_list: list[SamplingParams], seed: int = 0
) -> tuple[SamplingBatch, list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(seed)
    batch = SamplingBatch(max_num_seqs=len(params_list) + 4, vocab_size=VOCAB)
    prompts = [rng.integers(0, VOCAB, size=rng.integers(1, 12)).tolist() for _ in params_list]
    outputs = [rng.integers(0, VOCAB, size=rng.integers(0, 10)).tolist() for _ in params_list]
    for row, params in enumerate(params_list):
        batch.add_request(row, params, prompts[row], outputs[row])
    return batch, prompts, outputs


def full_vectors(tensors: LogprobsTensors) -> np.ndarray:
    """Undo the top-V sort: values by token id."""
    ids = tensors.logprob_token_ids[:, 1:].numpy()
    values = tensors.logprobs[:, 1:].numpy()
    full = np.empty_like(values)
    np.put_along_axis(full, ids, values, axis=1)
    return full


def with_logprobs(params: SamplingParams, count: int) -> SamplingParams:
    clone = params.clone()
    clone.logprobs = count
    return clone


def test_processed_logits_match_reference() -> None:
    params_list = [with_logprobs(p, VOCAB) for p in MIXED_PARAMS]
    batch, prompts, outputs = build_batch(params_list)
    logits = torch.randn(len(params_list), VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    raw = logits.numpy().copy()
    result = Sampler("processed_logits")(logits.clone(), batch.metadata(range(len(params_list))))
    assert result.logprobs_tensors is not None
    got = full_vectors(result.logprobs_tensors)
    for row, params in enumerate(params_list):
        expected = reference_processed(raw[row], params, prompts[row], outputs[row])
        np.testing.assert_array_equal(np.isinf(got[row]), np.isinf(expected), err_msg=f"row {row}: masked tokens")
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[row][finite], expected[finite], atol=1e-4, rtol=1e-5, err_msg=f"row {row}")
        sampled = int(result.sampled_token_ids[row])
        assert np.isfinite(expected[sampled]), f"row {row} sampled a masked token"
        if params.temperature == 0.0:
            assert sampled == int(np.argmax(expected))


def test_processed_logprobs_match_reference() -> None:
    params_list = [with_logprobs(p, VOCAB) for p in MIXED_PARAMS]
    batch, prompts, outputs = build_batch(params_list, seed=3)
    logits = torch.randn(len(params_list), VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    raw = logits.numpy().copy()
    result = Sampler("processed_logprobs")(logits, batch.metadata(range(len(params_list))))
    got = full_vectors(result.logprobs_tensors)
    for row, params in enumerate(params_list):
        processed = reference_processed(raw[row], params, prompts[row], outputs[row])
        with np.errstate(divide="ignore"):
            expected = np.log(softmax(processed))
        finite = np.isfinite(expected)
        np.testing.assert_allclose(got[row][finite], expected[finite], atol=1e-4, err_msg=f"row {row}")
        assert np.all(np.isneginf(got[row][~finite]))


@pytest.mark.parametrize("candidates", [2, 7, 40])
@pytest.mark.parametrize("use_top_k", [False, True])
def test_top_p_candidate_search_matches_full_sort(candidates: int, use_top_k: bool) -> None:
    rows, vocab = 12, 64
    # From flat rows (the top-p set needs many tokens, so the full sort takes over) to peaked ones.
    scale = torch.linspace(0.2, 6.0, rows).unsqueeze(1)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)) * scale
    top_p = torch.tensor([0.5, 0.8, 1.0, 0.9, 0.95, 0.3, 1.0, 0.7, 0.85, 0.99, 0.6, 1.0])
    top_k = torch.tensor([vocab, 5, 3, vocab, 30, vocab, vocab, 1, 12, 50, vocab, 9]) if use_top_k else None
    max_top_k = 50 if use_top_k else 0
    expected = apply_top_k_top_p(logits.clone(), top_k, top_p)
    got = apply_top_k_top_p_by_candidates(logits.clone(), top_k, top_p, max_top_k, candidates=candidates)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.equal(got[torch.isfinite(got)], expected[torch.isfinite(expected)])
    # The rows with top_p = 1 and no top-k are untouched.
    assert torch.equal(got[6], logits[6])


def test_top_k_without_sort_matches_full_sort() -> None:
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(9))
    top_k = torch.tensor([1, 4, vocab, 17, 49, vocab])
    expected = apply_top_k_top_p(logits.clone(), top_k, None)
    got = logits.clone()
    apply_top_k_only(got, top_k, 49)
    assert torch.equal(got, expected)
    assert (torch.isfinite(got).sum(dim=-1) == top_k).all()


def test_raw_logprobs_ranks_and_top_n() -> None:
    params_list = [with_logprobs(p, n) for p, n in zip(MIXED_PARAMS, [0, 1, 2, 3, 5, 0, 4, 2, 1, 5], strict=True)]
    batch, _, _ = build_batch(params_list, seed=5)
    logits = torch.randn(len(params_list), VOCAB, generator=torch.Generator().manual_seed(6))
    raw = logits.numpy().astype(np.float64).copy()
    result = Sampler("raw_logprobs")(logits, batch.metadata(range(len(params_list))))
    tensors = result.logprobs_tensors
    assert tensors is not None and tensors.logprobs.shape == (len(params_list), 6)
    for row in range(len(params_list)):
        expected = raw[row] - np.log(np.exp(raw[row]).sum())
        sampled = int(result.sampled_token_ids[row])
        assert int(tensors.logprob_token_ids[row, 0]) == sampled
        assert abs(float(tensors.logprobs[row, 0]) - expected[sampled]) < 1e-4
        assert int(tensors.selected_token_ranks[row]) == 1 + int((expected > expected[sampled]).sum())
        top = np.argsort(-expected)[:5]
        np.testing.assert_array_equal(tensors.logprob_token_ids[row, 1:].numpy(), top)
        np.testing.assert_allclose(tensors.logprobs[row, 1:].numpy(), expected[top], atol=1e-4)


def test_raw_logits_mode_reports_unprocessed_logits() -> None:
    batch = SamplingBatch(2, VOCAB)
    batch.add_request(0, SamplingParams(temperature=0.5, logprobs=3, logit_bias={0: 50.0}), [1], [])
    logits = torch.randn(1, VOCAB)
    raw = logits.clone()
    result = Sampler("raw_logits")(logits, batch.metadata([0]))
    assert int(result.sampled_token_ids[0]) == 0
    assert torch.allclose(result.logprobs_tensors.logprobs[0, 1:], raw[0].topk(3).values)


def test_all_greedy_fast_path_is_argmax_after_penalties() -> None:
    params_list = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    batch = SamplingBatch(4, VOCAB)
    batch.add_request(0, params_list[0], [5], [])
    batch.add_request(1, params_list[1], [5], [])
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 4.0
    logits[:, 6] = 3.0
    metadata = batch.metadata([0, 1])
    assert metadata.all_greedy and metadata.temperature is None
    result = Sampler()(logits, metadata)
    assert result.sampled_token_ids.tolist() == [5, 6]
    assert result.logprobs_tensors is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [49152, 50000, 3000, 1500, 100])
def test_argmax_rows_is_torch_argmax(dtype: torch.dtype, width: int) -> None:
    """Blocked argmax == torch.argmax: ties to the first index, across and inside blocks and in the tail."""
    g = torch.Generator().manual_seed(width)
    values = torch.randn(12, width, generator=g).to(dtype)
    # Row 1: one maximum in the last column (the tail when width is not a block multiple).
    values[1, -1] = 100.0
    # Row 2: equal maxima in two blocks and twice inside the later block.
    for col in (width - 2, width // 2, width // 2 + 1):
        values[2, col] = 50.0
    # Row 3: all equal; row 4: all -inf (a fully masked row); row 5: a NaN wins, the first of two.
    values[3] = 1.0
    values[4] = float("-inf")
    values[5, width // 3] = float("nan")
    values[5, width - 1] = float("nan")
    # Row 6: the maximum in column 0.
    values[6, 0] = 100.0
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    assert torch.equal(argmax_rows(values[:, : width - 1]), values[:, : width - 1].argmax(dim=-1))  # strided view


def test_greedy_fast_path_takes_low_precision_logits_as_they_are() -> None:
    """bf16 logits from the model: the greedy argmax is the one of their exact float32 widening."""
    batch = SamplingBatch(4, 5000)
    for row in range(3):
        batch.add_request(row, SamplingParams(temperature=0.0), [1], [])
    logits = torch.randn(3, 5000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits[1, 4999] = logits[1, 17] = logits[1].max() + 1  # a tie across blocks
    result = Sampler()(logits, batch.metadata([0, 1, 2]))
    assert torch.equal(result.sampled_token_ids, logits.float().argmax(dim=-1))
    assert result.sampled_token_ids.tolist()[1] == 17


def test_greedy_rows_mixed_with_random_rows() -> None:
    batch = SamplingBatch(8, VOCAB)
    outputs: list[list[int]] = [[] for _ in range(6)]
    for row in range(6):
        batch.add_request(row, SamplingParams(temperature=0.0 if row % 2 == 0 else 5.0), [1], outputs[row])
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    expected_greedy = logits.argmax(dim=-1)
    draws = [Sampler()(logits.clone(), batch.metadata(range(6))).sampled_token_ids for _ in range(30)]
    stacked = torch.stack(draws)
    assert torch.equal(stacked[:, 0::2], expected_greedy[0::2].expand(30, 3))
    # Temperature 5 over 32 tokens: the random rows do not always take the argmax.
    assert (stacked[:, 1::2] != expected_greedy[1::2]).any()


def test_seeded_row_reproduces_whatever_the_rest_of_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def generate(other_rows: int, position: int) -> list[int]:
        batch = SamplingBatch(8, VOCAB)
        rows = list(range(other_rows + 1))
        outputs: dict[int, list[int]] = {row: [] for row in rows}
        for row in rows:
            params = seeded if row == position else SamplingParams(temperature=0.8, top_k=4)
            batch.add_request(row, params, [1, 2], outputs[row])
        # Same logits for the seeded row at each step, whatever its position.
        sampler = Sampler()
        generator = torch.Generator().manual_seed(7)
        for _ in range(12):
            shared = torch.randn(VOCAB, generator=generator)
            logits = torch.randn(len(rows), VOCAB)
            logits[position] = shared
            sampled = sampler(logits, batch.metadata(rows)).sampled_token_ids.tolist()
            for row, token in zip(rows, sampled, strict=True):
                outputs[row].append(token)
        return outputs[position]

    first = generate(other_rows=0, position=0)
    assert generate(other_rows=0, position=0) == first
    assert generate(other_rows=5, position=3) == first
    assert generate(other_rows=2, position=2) == first
    assert len(set(first)) > 1


def test_min_tokens_masks_eos_until_reached() -> None:
    eos = 7
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11])
    params.update_from_generation_config({}, model_eos_token_id=eos)
    batch = SamplingBatch(2, VOCAB)
    output: list[int] = []
    batch.add_request(0, params, [1], output)
    logits = torch.zeros(1, VOCAB)
    logits[0, eos] = 10.0
    logits[0, 11] = 9.0
    logits[0, 4] = 1.0
    for _ in range(3):
        token = int(Sampler()(logits.clone(), batch.metadata([0])).sampled_token_ids[0])
        output.append(token)
    assert output == [4, 4, 4]
    assert int(Sampler()(logits.clone(), batch.metadata([0])).sampled_token_ids[0]) == eos


def test_bad_words_single_and_multi_token() -> None:
    params = SamplingParams(temperature=0.0)
    params._bad_words_token_ids = [[3], [5, 6]]
    batch = SamplingBatch(2, VOCAB)
    output: list[int] = [1]
    batch.add_request(0, params, [1], output)
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 10.0
    logits[0, 6] = 9.0
    logits[0, 2] = 1.0
    # Token 3 is always banned; 6 only after 5.
    assert int(Sampler()(logits.clone(), batch.metadata([0])).sampled_token_ids[0]) == 6
    output.append(5)
    assert int(Sampler()(logits.clone(), batch.metadata([0])).sampled_token_ids[0]) == 2


def test_allowed_token_ids_only() -> None:
    batch = SamplingBatch(3, VOCAB)
    batch.add_request(0, SamplingParams(temperature=2.0, allowed_token_ids=[4, 9, 20]), [1], [])
    batch.add_request(1, SamplingParams(temperature=2.0), [1], [])
    drawn = set()
    for _ in range(40):
        drawn.add(int(Sampler()(torch.randn(2, VOCAB), batch.metadata([0, 1])).sampled_token_ids[0]))
    assert drawn <= {4, 9, 20} and len(drawn) > 1


def test_logit_bias_moves_argmax() -> None:
    batch = SamplingBatch(2, VOCAB)
    batch.add_request(1, SamplingParams(temperature=0.0, logit_bias={17: 100.0}), [1], [])
    assert int(Sampler()(torch.randn(1, VOCAB), batch.metadata([1])).sampled_token_ids[0]) == 17


def test_logits_processors_both_signatures() -> None:
    seen: list[tuple] = []

    def ban_first(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(("output", list(output_ids)))
        logits[0] = -math.inf
        return logits

    def favour_prompt_start(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(("prompt", list(prompt_ids)))
        out = logits.clone()
        out[prompt_ids[0]] += 100.0
        return out

    batch = SamplingBatch(3, VOCAB)
    batch.add_request(0, SamplingParams(temperature=0.0), [1], [])
    batch.add_request(
        2, SamplingParams(temperature=0.0, logits_processors=[ban_first, favour_prompt_start]), [13, 2], [4]
    )
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 50.0
    assert Sampler()(logits, batch.metadata([0, 2])).sampled_token_ids.tolist() == [0, 13]
    assert seen == [("output", [4]), ("prompt", [13, 2])]


def test_row_management() -> None:
    batch = SamplingBatch(4, VOCAB)
    batch.add_request(0, SamplingParams(temperature=0.0, logit_bias={1: 100.0}), [1], [])
    batch.add_request(2, SamplingParams(temperature=0.0, logit_bias={2: 100.0}), [1], [])
    batch.move(2, 1)
    assert not batch.is_active(2) and batch.is_active(1) and batch.num_active == 2
    assert Sampler()(torch.zeros(2, VOCAB), batch.metadata([1, 0])).sampled_token_ids.tolist() == [2, 1]
    batch.swap(0, 1)
    assert Sampler()(torch.zeros(2, VOCAB), batch.metadata(torch.tensor([0, 1]))).sampled_token_ids.tolist() == [2, 1]
    batch.remove(0)
    with pytest.raises(ValueError, match=r"rows \[0\] hold no request"):
        batch.metadata([0, 1])
    with pytest.raises(ValueError, match="already in use"):
        batch.add_request(1, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="row must be in"):
        batch.add_request(4, SamplingParams(), [1], [])
    with pytest.raises(ValueError, match="logit_bias"):
        batch.add_request(0, SamplingParams(logit_bias={VOCAB: 1.0}), [1], [])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        batch.add_request(0, SamplingParams(allowed_token_ids=[VOCAB + 3]), [1], [])


def test_metadata_skips_list_work_when_unused() -> None:
    batch = SamplingBatch(4, VOCAB)
    for row in range(3):
        batch.add_request(row, SamplingParams(temperature=0.9, top_p=0.95), [1], [2])
    metadata = batch.metadata([0, 1, 2])
    assert not metadata.needs_constraints and metadata.top_k is None and metadata.min_p is None
    assert metadata.all_random and metadata.max_num_logprobs is None


def test_to_sample_logprobs_and_gather() -> None:
    values = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0, -1.0]]), dim=-1)
    tensors = gather_logprobs(values, 2, torch.tensor([2]))
    assert tensors.logprob_token_ids.tolist() == [[2, 1, 2]]
    assert tensors.selected_token_ranks.tolist() == [2]
    records = to_sample_logprobs(tensors, [1], decode=lambda t: f"<{t}>")
    assert list(records[0]) == [2, 1]
    assert records[0][2].rank == 2 and records[0][1].rank == 1 and records[0][1].decoded_token == "<1>"
    assert to_sample_logprobs(tensors, [None]) == [None]


def test_unseeded_draws_follow_the_global_seed_and_accept_bf16() -> None:
    batch = SamplingBatch(8, VOCAB)
    for row in range(8):
        batch.add_request(row, SamplingParams(temperature=1.5), [1], [])
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)

    def draw() -> list[int]:
        torch.manual_seed(11)
        sampler = Sampler()
        return [t for _ in range(4) for t in sampler(logits, batch.metadata(range(8))).sampled_token_ids.tolist()]

    assert draw() == draw()
    assert logits.dtype == torch.bfloat16  # a non-fp32 input is copied, not edited
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(VOCAB), batch.metadata([0]))
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("softmax")  # type: ignore[arg-type]
