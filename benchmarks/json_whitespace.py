"""Validity of sampled JSON on the 50-schema corpus (pagoda.testing.json_schemas) with the default whitespace:
how many of the outputs at temperature 1 end inside max_tokens and validate, per backend.

    python -m benchmarks.json_whitespace [--backends xgrammar,guidance] [--seeds 2] [--max-tokens 120]

The default whitespace is the backends' (vLLM's: any whitespace between tokens unless
disable_any_whitespace); pagoda bounds each run at JSON_MAX_WHITESPACE. Run it on two checkouts to
compare; the row it prints names the bound it ran with ("unbounded" where the core has none).
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.testing.json_schemas import SCHEMAS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", default="xgrammar,guidance")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=120)
    args = parser.parse_args()
    try:
        from pagoda.structured_output.params import JSON_MAX_WHITESPACE
        bound = str(JSON_MAX_WHITESPACE)
    except ImportError:
        bound = "unbounded"
    for backend in args.backends.split(","):
        llm = LLM(max_model_len=512, structured_outputs_config={"backend": backend})
        params = [SamplingParams(temperature=1.0, seed=1000 * s + i, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema))
                  for s in range(args.seeds) for i, schema in enumerate(SCHEMAS)]
        started = time.perf_counter()
        outs = llm.generate(["Answer in JSON:"] * len(params), params)
        seconds = time.perf_counter() - started
        valid = cut = 0
        tokens = 0
        for out, p in zip(outs, params):
            o = out.outputs[0]
            tokens += len(o.token_ids)
            if o.finish_reason == "length":
                cut += 1
                continue
            try:
                jsonschema.validate(json.loads(o.text), p.structured_outputs.json)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        print(json.dumps({"backend": backend, "whitespace_bound": bound, "outputs": len(params), "valid": valid,
                          "cut_by_max_tokens": cut, "mean_tokens": round(tokens / len(params), 1),
                          "seconds": round(seconds, 1)}), flush=True)
        del llm


if __name__ == "__main__":
    main()
