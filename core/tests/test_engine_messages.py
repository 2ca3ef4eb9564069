"""The front end <-> core wire (pagoda.engine.messages) and the scheduler's Request built from it."""

from __future__ import annotations

import pickle

import pytest
import torch

from pagoda.engine.core_proc import dumps, loads
from pagoda.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagoda.logprobs import Logprob
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.request import Request, prompt_block_hashes

BLOCK = 4


def test_the_core_takes_the_front_ends_block_hashes_and_they_equal_its_own() -> None:
    prompt = list(range(1, 11))  # two full blocks and a partial one
    sent = EngineCoreRequest("r", prompt, SamplingParams(max_tokens=3), 0, 1.0, cache_salt="s",
                             block_hashes=prompt_block_hashes(prompt, BLOCK, "s"))
    req = Request.from_engine_core_request(sent, BLOCK)
    assert req.block_hashes is not sent.block_hashes and req.block_hashes == sent.block_hashes
    hashed_here = Request("r", prompt, SamplingParams(max_tokens=3), 0, BLOCK, cache_salt="s")
    assert len(req.block_hashes) == 2 and req.block_hashes == hashed_here.block_hashes
    # the salt is part of the key
    assert prompt_block_hashes(prompt, BLOCK, None) != req.block_hashes


def test_hashes_for_another_block_size_are_computed_again() -> None:
    prompt = list(range(1, 11))
    sent = EngineCoreRequest("r", prompt, SamplingParams(), 0, 1.0, block_hashes=prompt_block_hashes(prompt, 2, None))
    req = Request.from_engine_core_request(sent, BLOCK)
    assert req.block_hashes == prompt_block_hashes(prompt, BLOCK, None)


def test_params_are_read_typed() -> None:
    sampled = Request.from_engine_core_request(EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=7), 0, 1.0),
                                               BLOCK)
    assert sampled.sampling_params is sampled.params and sampled.pooling_params is None and sampled.max_tokens == 7
    pooled = Request.from_engine_core_request(EngineCoreRequest("b", [1, 2], PoolingParams(), None, 1.0,
                                                                token_type_ids=[0, 1]), BLOCK)
    assert pooled.pooling_params is pooled.params and pooled.sampling_params is None and pooled.max_tokens is None
    assert pooled.token_type_ids == [0, 1]
    with pytest.raises(TypeError, match="exactly one"):
        Request("c", [1], None, None, BLOCK)
    with pytest.raises(TypeError, match="exactly one"):
        Request("c", [1], SamplingParams(), None, BLOCK, pooling_params=PoolingParams())


def test_a_step_of_outputs_crosses_the_process_wire_whole() -> None:
    outs = EngineCoreOutputs(outputs=[
        EngineCoreOutput("a", [5], new_logprobs=[{5: Logprob(-0.1, 1)}], new_sampled_logprobs=[-0.1]),
        EngineCoreOutput("b", [], finish_reason="stop", pooling_output=torch.ones(3)),
    ], failed={"c": ValueError("boom")})
    kind, back = loads(dumps("outputs", outs))
    assert kind == "outputs"
    a, b = back.outputs
    assert a == outs.outputs[0]
    assert b.finish_reason == "stop" and torch.equal(b.pooling_output, torch.ones(3))
    assert str(back.failed["c"]) == "boom"
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(temperature=0.5), 2, 1.0, priority=3)
    assert pickle.loads(pickle.dumps(request)) == request
