"""Prometheus export of engine statistics with vLLM's metric names under the ``pagoda:`` prefix.

Each logger owns its registry, so several engines (or test servers) in one
process never collide on the global default registry. With ``prefixes=("pagoda",
"vllm")`` (`pagoda serve --vllm-metric-names`) every metric is exported under
both prefixes, for dashboards and alerts written against vLLM's ``vllm:*``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagoda.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

# vLLM's buckets: latency spans from a fast GPU decode to a slow CPU prefill.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TOKEN_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The *_created samples double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()
FINISH_REASONS = ("stop", "length", "abort", "error")


class _Same:
    """One metric under several names: ``labels()`` / ``inc`` / ``set`` / ``observe`` reach every copy."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics

    def labels(self, *values: str) -> _Same:
        return _Same([m.labels(*values) for m in self.metrics])

    def inc(self, amount: float = 1) -> None:
        for m in self.metrics:
            m.inc(amount)

    def set(self, value: float) -> None:
        for m in self.metrics:
            m.set(value)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)

    def set_to_current_time(self) -> None:
        for m in self.metrics:
            m.set_to_current_time()


class _Families:
    """The metric families of one registry, unlabelled: each model's logger takes its ``model_name`` series."""

    def __init__(self, registry: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        labels = ["model_name"]
        r = registry

        def gauge(name: str, doc: str) -> _Same:
            return _Same([Gauge(f"{p}:{name}", doc, labels, registry=r) for p in prefixes])

        def counter(name: str, doc: str, extra: list[str] | None = None) -> _Same:
            return _Same([Counter(f"{p}:{name}", doc, labels + (extra or []), registry=r) for p in prefixes])

        def histogram(name: str, doc: str, buckets: list[float]) -> _Same:
            return _Same([Histogram(f"{p}:{name}", doc, labels, buckets=buckets, registry=r) for p in prefixes])

        self.num_requests_running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("request_success", "Count of successfully processed requests.", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Histogram of time per output token in seconds (mean over a request's decode).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ["position"])
        token_buckets = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]
        self.prompt_tokens_per_request = histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens_per_request = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        # vLLM's LoRA gauge: the labels carry the adapters, the value the time they were read
        self.lora_info = _Same([Gauge(f"{p}:lora_requests_info", "Running stats on lora requests.",
                                      ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
                                for p in prefixes])


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 prefixes: tuple[str, ...] = ("pagoda",), _families: _Families | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        f = _families if _families is not None else _Families(self.registry, prefixes)
        self._families = f
        self.num_requests_running = f.num_requests_running.labels(model_name)
        self.num_requests_waiting = f.num_requests_waiting.labels(model_name)
        self.kv_cache_usage = f.kv_cache_usage.labels(model_name)
        self.prefix_cache_queries = f.prefix_cache_queries.labels(model_name)
        self.prefix_cache_hits = f.prefix_cache_hits.labels(model_name)
        self.num_preemptions = f.num_preemptions.labels(model_name)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.request_success = {reason: f.request_success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = f.ttft.labels(model_name)
        self.inter_token_latency = f.inter_token_latency.labels(model_name)
        self.time_per_output_token = f.time_per_output_token.labels(model_name)
        self.e2e_latency = f.e2e_latency.labels(model_name)
        self.queue_time = f.queue_time.labels(model_name)
        self.spec_decode_num_drafts = f.spec_decode_num_drafts.labels(model_name)
        self.spec_decode_num_draft_tokens = f.spec_decode_num_draft_tokens.labels(model_name)
        self.spec_decode_num_accepted_tokens = f.spec_decode_num_accepted_tokens.labels(model_name)
        self._accepted_per_pos = f.accepted_per_pos
        self._model_name = model_name
        self.spec_decode_num_accepted_tokens_per_pos: list[_Same] = []
        self.prompt_tokens_per_request = f.prompt_tokens_per_request.labels(model_name)
        self.generation_tokens_per_request = f.generation_tokens_per_request.labels(model_name)
        self.lora_info = f.lora_info

    def for_model(self, model_name: str) -> PrometheusStatLogger:
        """A logger for another model of the same server: the same registry and metrics, its own
        ``model_name`` series (a many-model server's /metrics renders them all at once)."""
        return PrometheusStatLogger(model_name, self.registry, _families=self._families)

    def record_iteration(self, scheduler: SchedulerStats, iteration: IterationStats) -> None:
        self.num_requests_running.set(scheduler.num_running_reqs)
        self.num_requests_waiting.set(scheduler.num_waiting_reqs)
        self.kv_cache_usage.set(scheduler.kv_cache_usage)
        if scheduler.prefix_cache_queries:
            self.prefix_cache_queries.inc(scheduler.prefix_cache_queries)
        if scheduler.prefix_cache_hits:
            self.prefix_cache_hits.inc(scheduler.prefix_cache_hits)
        if scheduler.num_preemptions:
            self.num_preemptions.inc(scheduler.num_preemptions)
        spec = scheduler.spec_decoding_stats
        if spec is not None:
            self.spec_decode_num_drafts.inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            while len(per_pos) < len(spec.num_accepted_tokens_per_pos):
                per_pos.append(self._accepted_per_pos.labels(self._model_name, str(len(per_pos))))
            for counter_, accepted in zip(per_pos, spec.num_accepted_tokens_per_pos):
                counter_.inc(accepted)
        if iteration.num_prompt_tokens:
            self.prompt_tokens.inc(iteration.num_prompt_tokens)
        if iteration.num_generation_tokens:
            self.generation_tokens.inc(iteration.num_generation_tokens)
        if scheduler.max_lora:
            # one series, the latest (vLLM keeps every combination ever seen; a scrape wants the current one)
            for gauge in self.lora_info.metrics:
                gauge.clear()
            self.lora_info.labels(str(scheduler.max_lora), ",".join(sorted(scheduler.waiting_lora_adapters)),
                                  ",".join(sorted(scheduler.running_lora_adapters))).set_to_current_time()

    def record_finished(self, finished: FinishedRequestStats) -> None:
        reason = finished.finish_reason if finished.finish_reason in self.request_success else "error"
        self.request_success[reason].inc()
        self.e2e_latency.observe(finished.e2e_latency)
        self.prompt_tokens_per_request.observe(finished.num_prompt_tokens)
        self.generation_tokens_per_request.observe(finished.num_generation_tokens)
        if finished.queue_time is not None:
            self.queue_time.observe(max(0.0, finished.queue_time))
        if finished.ttft is not None:
            self.ttft.observe(finished.ttft)
        for latency in finished.inter_token_latencies:
            self.inter_token_latency.observe(latency)
        if finished.decode_time is not None and finished.num_generation_tokens > 1:
            self.time_per_output_token.observe(finished.decode_time / (finished.num_generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
