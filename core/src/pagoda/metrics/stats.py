"""Plain records the engine hands to stat loggers; no Prometheus here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pagoda.spec_decode.scheduling import SpecDecodingStats


@dataclass
class SchedulerStats:
    """The scheduler's state after one step; counters are increments since the previous record."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # enable_lora: adapter name -> requests running / waiting with it, and the slots (vLLM's lora_requests_info)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0
    # speculative decoding's counters since the previous record (None: nothing drafted)
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass
class IterationStats:
    """Tokens that reached the frontend in one step."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


@dataclass
class FinishedRequestStats:
    """One finished (stopped, length-capped, aborted or failed) request; times in seconds."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queue_time: float | None = None
    ttft: float | None = None
    decode_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)


class StatLogger(Protocol):
    def record_iteration(self, scheduler: SchedulerStats, iteration: IterationStats) -> None: ...

    def record_finished(self, finished: FinishedRequestStats) -> None: ...
