"""Per-request timing for the stat loggers, kept by a front end from the core's outputs alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.metrics.stats import FinishedRequestStats, IterationStats


@dataclass
class RequestMetrics:
    """One user request (all its sequences): times in seconds since the epoch."""

    arrival_time: float
    num_prompt_tokens: int
    num_sequences: int = 1
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    recorded: bool = False

    def on_output(self, num_new_tokens: int, first_scheduled_time: float | None, now: float,
                  iteration: IterationStats) -> None:
        """A sequence of this request produced ``num_new_tokens`` (> 0) tokens in the step that ended at ``now``."""
        if first_scheduled_time is not None and (self.first_scheduled_time is None
                                                 or first_scheduled_time < self.first_scheduled_time):
            self.first_scheduled_time = first_scheduled_time
        if self.first_token_time is None:
            self.first_token_time = now
            iteration.num_prompt_tokens += self.num_prompt_tokens
        elif self.last_token_time is not None and self.num_sequences == 1:
            # several tokens in one step share its latency
            per_token = (now - self.last_token_time) / num_new_tokens
            self.inter_token_latencies.extend([per_token] * num_new_tokens)
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens
        iteration.num_generation_tokens += num_new_tokens

    def finish(self, reason: str, now: float) -> FinishedRequestStats | None:
        """The request's record, once; None if it was already recorded."""
        if self.recorded:
            return None
        self.recorded = True
        first_token, last_token = self.first_token_time, self.last_token_time
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - self.arrival_time,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            queue_time=(self.first_scheduled_time - self.arrival_time) if self.first_scheduled_time is not None else None,
            ttft=(first_token - self.arrival_time) if first_token is not None else None,
            inter_token_latencies=self.inter_token_latencies,
            decode_time=(last_token - first_token) if first_token is not None and last_token is not None else None,
        )
