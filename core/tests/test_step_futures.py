"""Steps in flight (pagoda.executor.step_futures): collected oldest first in the caller's thread, a failure
fails that step and every later one, done() collects only what is ready."""

from __future__ import annotations

import pytest

from pagoda.executor import ExecutorFailedError
from pagoda.executor.step_futures import StepQueue
from pagoda.scheduler.output import ModelRunnerOutput


def _out(rid: str) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[rid], sampled_token_ids=[[1]])


def test_asking_for_a_later_step_collects_the_earlier_ones_first() -> None:
    q = StepQueue()
    order: list[str] = []
    ready = {"a": False, "b": False, "c": False}

    def step(name: str) -> tuple:
        def collect() -> ModelRunnerOutput:
            order.append(name)
            return _out(name)
        return collect, lambda: ready[name]

    a, b, c = (q.submit(*step(n)) for n in "abc")
    assert not b.done() and order == []  # not the oldest: never collected by done()
    assert not a.done() and order == []  # oldest but its replies are not there
    ready["a"] = True
    assert a.done() and order == ["a"]
    assert c.result().req_ids == ["c"] and order == ["a", "b", "c"]
    assert b.result().req_ids == ["b"] and len(q) == 0
    with pytest.raises(ValueError, match="no timeout"):
        a.result(timeout=1.0)


def test_a_failed_step_fails_every_later_one() -> None:
    q = StepQueue()

    def broken() -> ModelRunnerOutput:
        raise ExecutorFailedError("worker rank 1 died")

    first = q.submit(lambda: _out("a"), lambda: True)
    second = q.submit(broken, lambda: True)
    third = q.submit(lambda: _out("c"), lambda: True)
    assert first.result().req_ids == ["a"]
    with pytest.raises(ExecutorFailedError, match="rank 1"):
        third.result()
    with pytest.raises(ExecutorFailedError, match="rank 1"):
        second.result()
    assert len(q) == 0
    q.drain()  # nothing left: a no-op
