"""Per-request timings a front end keeps from the core's outputs alone."""

from __future__ import annotations

import pytest

from pagoda.metrics import IterationStats, RequestMetrics


def test_timings_of_one_sequence() -> None:
    m = RequestMetrics(arrival_time=10.0, num_prompt_tokens=5)
    first = IterationStats()
    m.on_output(1, first_scheduled_time=10.5, now=11.0, iteration=first)
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (5, 1)
    later = IterationStats()
    m.on_output(2, first_scheduled_time=None, now=12.0, iteration=later)  # two tokens share the step's latency
    assert (later.num_prompt_tokens, later.num_generation_tokens) == (0, 2)
    record = m.finish("stop", now=12.5)
    assert record is not None
    assert record.queue_time == pytest.approx(0.5)
    assert record.ttft == pytest.approx(1.0)
    assert record.decode_time == pytest.approx(1.0)
    assert record.e2e_latency == pytest.approx(2.5)
    assert record.inter_token_latencies == pytest.approx([0.5, 0.5])
    assert record.num_generation_tokens == 3
    assert m.finish("abort", now=13.0) is None  # recorded once


def test_several_sequences_take_the_earliest_schedule_and_no_inter_token_latency() -> None:
    m = RequestMetrics(arrival_time=0.0, num_prompt_tokens=3, num_sequences=2)
    it = IterationStats()
    m.on_output(1, first_scheduled_time=0.4, now=1.0, iteration=it)
    m.on_output(1, first_scheduled_time=0.2, now=1.0, iteration=it)
    m.on_output(1, first_scheduled_time=None, now=2.0, iteration=it)
    record = m.finish("length", now=2.0)
    assert record is not None
    assert record.queue_time == pytest.approx(0.2)
    assert record.inter_token_latencies == []
    assert it.num_prompt_tokens == 3 and it.num_generation_tokens == 3


def test_a_request_aborted_before_its_first_token_has_no_token_timings() -> None:
    record = RequestMetrics(arrival_time=0.0, num_prompt_tokens=3).finish("abort", now=1.0)
    assert record is not None
    assert (record.queue_time, record.ttft, record.decode_time) == (None, None, None)
