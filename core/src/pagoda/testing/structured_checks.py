"""End-to-end checks that every structured-output backend plugin runs against the default model.

A backend (``pagoda_register_structured_output_backends``) is judged by what the engine writes
under its constraints, whichever library compiles them. The xgrammar and llguidance plugins,
and a third party's backend, run the same checks; each plugin keeps its own tests for what only
its library has (its grammar syntax, its matcher API). Typical use::

    from pagoda.testing import structured_checks as sc

    def test_json_schemas(llm):
        sc.check_json_schemas_validate(llm)

    def test_preemption_keeps_outputs_valid():
        sc.check_preemption_keeps_outputs_valid(backend="mine")

    def test_bit_layout_matches_core_masking():
        sc.check_bit_layout_matches_core_masking(mylib.apply_token_bitmask_inplace)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import jsonschema
import torch

from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output import apply_token_bitmask
from pagoda.testing.json_schemas import SCHEMAS


def json_params(schema: dict[str, Any], temperature: float, seed: int, max_tokens: int = 120) -> SamplingParams:
    """A request constrained to ``schema``; sampled ones use compact JSON so they end within ``max_tokens``."""
    return SamplingParams(
        temperature=temperature, seed=seed if temperature else None, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=temperature > 0),
    )


def check_json_schemas_validate(llm: Any, schemas: Sequence[dict[str, Any]] = SCHEMAS) -> None:
    """Every schema, greedy and at temperature 1, in one batch: each output stops and validates."""
    prompts, params, expected = [], [], []
    for i, schema in enumerate(schemas):
        for temperature in (0.0, 1.0):
            prompts.append(f"Answer in JSON matching this schema: {json.dumps(schema)}")
            params.append(json_params(schema, temperature, seed=i))
            expected.append(schema)
    for out, schema in zip(llm.generate(prompts, params), expected):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def check_preemption_keeps_outputs_valid(backend: str | None = None) -> None:
    """Requests preempted and recomputed keep their matchers: every output still obeys its constraint.

    24 blocks of 16 tokens; the regex requests need ~7 blocks each (100 digits + EOS), so 8 requests
    cannot all run at once. ``backend`` None leaves the engine's default ("auto").
    """
    from pagoda import LLM

    config = {} if backend is None else {"structured_outputs_config": {"backend": backend}}
    small = LLM(num_kv_blocks=24, block_size=16, max_model_len=192, max_num_seqs=8, enable_prefix_caching=False,
                **config)
    digits = StructuredOutputsParams(regex="[0-9]{100}")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=110, structured_outputs=digits) for i in range(4)]
    params += [json_params(SCHEMAS[16], 1.0, seed=i) for i in range(4)]
    outputs = small.generate([f"Order {i}:" for i in range(8)], params)
    assert small.llm_engine.engine_core.core.scheduler.num_preemptions > 0
    for out in outputs[:4]:
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch("[0-9]{100}", out.outputs[0].text), out
    for out in outputs[4:]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[16])


def check_bit_layout_matches_core_masking(apply_inplace: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
    """A library's own bitmask application (``apply_inplace(logits, bitmask)``) masks as core's does.

    Backends fill core's int32 bitmask (bit ``t % 32`` of word ``t // 32`` allows token ``t``); a
    library whose layout differed would silently allow the wrong tokens.
    """
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 100, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    bitmask[2] = -1  # an unconstrained row stays as it is
    expected = logits.clone()
    apply_token_bitmask(expected, torch.arange(5), bitmask)
    apply_inplace(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[2]).all()
