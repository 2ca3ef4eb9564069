"""One prompt's beam search group: which continuations survive each step.

Live beams are scheduler requests that fork and share KV blocks
(``pagoda.beam_search.scheduling`` does that); this module is only the policy.

The selection follows transformers' beam search (``generate(num_beams=W,
do_sample=False)``) step for step: from the top ``2W`` continuations by
cumulative logprob, those among the best ``W`` that end (EOS, or the length
limit) become finished hypotheses scored ``cum_logprob / generated_len **
length_penalty`` (the EOS token counts in the length), the best ``W`` that do
not end become the next beams, and the search stops when ``W`` hypotheses are
finished and, by ``early_stopping``'s rule, no live beam can beat the worst of
them (False, the default: the best live beam's score at the current length;
True: stop as soon as ``W`` are finished; "never": its score at the longest
length when ``length_penalty > 0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

EarlyStopping = bool | Literal["never"]


@dataclass
class FinishedBeam:
    score: float
    token_ids: list[int]  # generated tokens only (the EOS included when it ended the beam)
    cum_logprob: float
    token_logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class Continuation:
    """One candidate next token of one live beam."""

    cum_logprob: float
    beam_id: str
    token_id: int
    logprob: float


@dataclass
class Selection:
    """The outcome of one step: the next live beams (best first) and whether the search is over."""

    running: list[Continuation]
    done: bool


@dataclass
class BeamGroup:
    group_id: str
    prompt_token_ids: list[int]
    beam_width: int
    max_tokens: int
    eos_token_id: int | None  # None when EOS is ignored
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    temperature: float = 0.0
    max_model_len: int | None = None
    # live beams (request ids), best first, with their scores so far
    beam_ids: list[str] = field(default_factory=list)
    cum_logprobs: dict[str, float] = field(default_factory=dict)
    token_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # candidates reported by the runner this step, per live beam
    candidates: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)
    finished: list[FinishedBeam] = field(default_factory=list)
    num_generated: int = 0
    improvable: bool = True
    admitted: bool = False
    _beam_counter: int = 0

    def __post_init__(self) -> None:
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    @property
    def num_candidates(self) -> int:
        """Continuations kept per step (and asked of each beam): 2W, as transformers keeps."""
        return 2 * self.beam_width

    def new_beam_id(self) -> str:
        beam_id = f"{self.group_id}#beam{self._beam_counter}"
        self._beam_counter += 1
        return beam_id

    def add_beam(self, beam_id: str, parent_id: str | None = None) -> None:
        self.beam_ids.append(beam_id)
        self.cum_logprobs[beam_id] = self.cum_logprobs[parent_id] if parent_id else 0.0
        self.token_logprobs[beam_id] = list(self.token_logprobs[parent_id]) if parent_id else []

    def drop_beam(self, beam_id: str) -> None:
        self.beam_ids.remove(beam_id)
        self.cum_logprobs.pop(beam_id, None)
        self.token_logprobs.pop(beam_id, None)
        self.candidates.pop(beam_id, None)

    def ready(self) -> bool:
        """Every live beam has reported its candidates for this step."""
        return bool(self.beam_ids) and all(b in self.candidates for b in self.beam_ids)

    def _ends(self, token_id: int) -> bool:
        if self.eos_token_id is not None and token_id == self.eos_token_id:
            return True
        if self.num_generated + 1 >= self.max_tokens:
            return True
        total = len(self.prompt_token_ids) + self.num_generated + 1
        return self.max_model_len is not None and total >= self.max_model_len

    def select(self, output_token_ids: dict[str, list[int]]) -> Selection:
        """Rank this step's continuations; record finished hypotheses; return the next beams.

        ``output_token_ids`` maps each live beam to its generated tokens so far
        (finished hypotheses copy them).
        """
        width = self.beam_width
        pool: list[Continuation] = []
        for beam_id in self.beam_ids:
            base = self.cum_logprobs[beam_id]
            ids, logprobs = self.candidates[beam_id]
            pool.extend(Continuation(base + lp, beam_id, tok, lp) for tok, lp in zip(ids, logprobs))
        self.candidates.clear()
        # sorted() is stable: ties keep beam order, then the runner's token order
        top = sorted(pool, key=lambda c: -c.cum_logprob)[: self.num_candidates]
        ends = [self._ends(c.token_id) for c in top]
        running = [c for c, end in zip(top, ends) if not end][:width]

        full = len(self.finished) >= width
        if self.improvable and not (full and self.early_stopping is True):
            length = self.num_generated + 1
            for c, end in zip(top[:width], ends[:width]):
                if end:
                    eos = self.eos_token_id is not None and c.token_id == self.eos_token_id
                    self.finished.append(FinishedBeam(
                        score=c.cum_logprob / (length ** self.length_penalty),
                        token_ids=output_token_ids[c.beam_id] + [c.token_id],
                        cum_logprob=c.cum_logprob,
                        token_logprobs=self.token_logprobs[c.beam_id] + [c.logprob],
                        finish_reason="stop" if eos else "length",
                    ))
            self.finished = sorted(self.finished, key=lambda f: -f.score)[:width]
        self.num_generated += 1

        if len(self.finished) >= width and running:
            if self.early_stopping is True:
                self.improvable = False
            else:
                best_len = self.max_tokens if (self.early_stopping == "never" and self.length_penalty > 0) else self.num_generated
                best_possible = running[0].cum_logprob / (best_len ** self.length_penalty)
                self.improvable = self.improvable and best_possible > self.finished[-1].score
        done = not self.improvable or all(ends) or not running
        return Selection(running=running, done=done)

    def result(self) -> list[FinishedBeam]:
        return sorted(self.finished, key=lambda f: -f.score)


def beam_request_params() -> Any:
    """The per-beam SamplingParams: no stop checks of its own (the group decides when beams end)."""
    from pagoda.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, detokenize=False)
