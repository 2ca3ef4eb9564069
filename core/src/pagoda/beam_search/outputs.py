"""Beam search results with vLLM's names and shapes (``BeamSearchSequence``, ``BeamSearchOutput``).

The search runs in the engine core (``pagoda.beam_search.scheduling``); this
module turns a finished group into what ``LLM.beam_search`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.logprobs import Logprob
from pagoda.outputs import CompletionOutput, RequestOutput


@dataclass
class BeamSearchSequence:
    """One finished beam: ``tokens`` and ``text`` hold the prompt followed by the generated part."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_search_score(generated_len: int, cum_logprob: float, length_penalty: float) -> float:
    """transformers' hypothesis score: the EOS token counts in the length."""
    return cum_logprob / (generated_len ** length_penalty)


def beams_to_request_output(request_id: str, prompt: str | None, prompt_token_ids: list[int],
                            beams: list[Any], tokenizer: Any) -> RequestOutput:
    """A finished group as a RequestOutput: one CompletionOutput per beam (generated part only), best first."""
    outputs = []
    for i, beam in enumerate(beams):
        text = tokenizer.decode(beam.token_ids, skip_special_tokens=True) if tokenizer is not None else ""
        outputs.append(CompletionOutput(
            index=i, text=text, token_ids=list(beam.token_ids), cumulative_logprob=beam.cum_logprob,
            logprobs=[{t: Logprob(lp, None)} for t, lp in zip(beam.token_ids, beam.token_logprobs)],
            finish_reason=beam.finish_reason,
        ))
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                         prompt_logprobs=None, outputs=outputs, finished=True)


def request_output_to_beam_search_output(output: RequestOutput, tokenizer: Any) -> BeamSearchOutput:
    """vLLM's shape: each sequence carries the prompt tokens and text too."""
    sequences = []
    for o in output.outputs:
        tokens = list(output.prompt_token_ids) + list(o.token_ids)
        text = tokenizer.decode(tokens) if tokenizer is not None else None
        sequences.append(BeamSearchSequence(
            tokens=tokens, logprobs=list(o.logprobs or []), cum_logprob=o.cumulative_logprob or 0.0,
            text=text, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
        ))
    return BeamSearchOutput(sequences=sequences)

