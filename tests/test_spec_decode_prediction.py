"""Predicted outputs (OpenAI's ``prediction``) offline: the proposer's alignment, and on a tiny float model the
greedy output with a prediction equals the one without, token for token, with or without
``speculative_config``, for a right, an edited and a wrong prediction."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.spec_decode import DraftRequest
from pagoda.spec_decode.prediction import PredictionProposer

VOCAB = 384
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _drafts(pred: list[int], output: list[int], prompt: list[int], k: int = 4) -> list[list[int]]:
    """The proposer's draft after each output token (as the scheduler asks, one step at a time)."""
    proposer = PredictionProposer(pred)
    tokens = list(prompt)
    drafts = []
    for tok in output:
        tokens.append(tok)
        drafts.append(proposer.propose([DraftRequest("r", tokens, len(prompt), k)])[0])
    return drafts


def test_proposer_follows_the_prediction() -> None:
    pred = list(range(100, 120))
    drafts = _drafts(pred, pred[:3], [1, 2])
    assert drafts == [pred[1:5], pred[2:6], pred[3:7]]


def test_proposer_rejoins_after_an_insertion_and_a_deletion() -> None:
    pred = list(range(100, 130))
    # an insertion: 100..104, then 7 8 9, then the prediction goes on at 105
    out = pred[:5] + [7, 8, 9] + pred[5:10]
    d = _drafts(pred, out, [1])
    assert d[4] == pred[5:9] and d[5:8] == [[], [], []]
    # re-joined once three output tokens match the prediction again (105 106 107)
    assert d[10] == pred[8:12]
    # a deletion: 100..104, then 115.. (110..114 left out)
    out = pred[:5] + pred[15:22]
    d = _drafts(pred, out, [1])
    assert d[5] == [] and d[7] == pred[18:22]
    proposer = PredictionProposer(pred)
    counts = proposer.counts([1, *out], 1)
    # 5 + 6 matched (the first two tokens after the jump re-join it only with the third)
    assert counts.rejected_prediction_tokens == len(pred) - 10


def test_proposer_wrong_prediction_drafts_nothing() -> None:
    assert _drafts([5, 6, 7, 8], [9, 10, 11, 12], [1]) == [[], [], [], []]
    counts = PredictionProposer([5, 6, 7, 8]).counts([1, 9, 10], 1)
    assert (counts.accepted_prediction_tokens, counts.rejected_prediction_tokens) == (0, 4)


def _prompts(seed: int, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def _llm(path: Any, **kwargs: Any) -> LLM:
    base = dict(model=str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
                max_num_batched_tokens=64, num_kv_blocks=40, block_size=16)
    return LLM(**{**base, **kwargs})


def _generate(llm: LLM, prompts: list[list[int]], predictions: list[list[int]] | None) -> list[Any]:
    items = [{"prompt_token_ids": p, **({"prediction_token_ids": predictions[i]} if predictions else {})}
             for i, p in enumerate(prompts)]
    return [o.outputs[0] for o in llm.generate(items, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def model_and_reference(tiny_model_dir) -> tuple[Any, list[list[int]], list[list[int]]]:
    path, _ = tiny_model_dir("llama")
    prompts = _prompts(seed=11)
    return path, prompts, [list(o.token_ids) for o in _generate(_llm(path), prompts, None)]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["prediction-only", "ngram"])
def test_greedy_output_unchanged_by_any_prediction(model_and_reference, spec: dict[str, Any] | None) -> None:
    path, prompts, reference = model_and_reference
    llm = _llm(path, speculative_config=spec)
    # right, edited (a token changed in the middle, a span cut), and wrong
    edited = [r[:10] + [(r[10] + 1) % VOCAB] + r[11:20] + r[25:] for r in reference]
    wrong = [[(t + 7) % VOCAB for t in r] for r in reference]
    right = _generate(llm, prompts, reference)
    assert [list(o.token_ids) for o in right] == reference
    for o in right:
        assert o.prediction is not None
        # each verify step adds one token of the target's own beside its accepted drafts (k=3: 1 in 4)
        assert o.prediction.accepted_prediction_tokens >= 25, o.prediction
        assert o.prediction.rejected_prediction_tokens == 0
    out = _generate(llm, prompts, edited)
    assert [list(o.token_ids) for o in out] == reference
    assert all(0 < o.prediction.accepted_prediction_tokens < 40 for o in out)
    assert all(o.prediction.rejected_prediction_tokens > 0 for o in out)
    out = _generate(llm, prompts, wrong)
    assert [list(o.token_ids) for o in out] == reference
    assert all(o.prediction.rejected_prediction_tokens == 40 for o in out)
    # requests without a prediction in the same engine report none
    assert all(o.prediction is None for o in _generate(llm, prompts[:1], None))
    core = llm.llm_engine.engine_core.core
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_usable_blocks


def test_bad_prediction_token_ids_refused(model_and_reference) -> None:
    path, prompts, _ = model_and_reference
    llm = _llm(path)
    with pytest.raises(ValueError, match="prediction_token_ids"):
        llm.generate([{"prompt_token_ids": prompts[0], "prediction_token_ids": [VOCAB + 5]}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="prediction_token_ids"):
        llm.generate([{"prompt_token_ids": prompts[0], "prediction_token_ids": "abc"}], GREEDY, use_tqdm=False)


def test_prediction_refused_with_beam_search(model_and_reference) -> None:
    from pagoda.sampling_params import BeamSearchParams

    path, prompts, _ = model_and_reference
    llm = _llm(path)
    with pytest.raises(ValueError, match="beam search"):
        llm.beam_search([{"prompt_token_ids": prompts[0], "prediction_token_ids": [1, 2]}],
                        BeamSearchParams(beam_width=2, max_tokens=4))
    # a prediction-only engine still runs beam search for requests without one
    _generate(llm, prompts[:1], [[1, 2, 3]])
    assert llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=2, max_tokens=4))
