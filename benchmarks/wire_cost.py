"""What the engine-core process's wire costs: one request in, one step's outputs out, as the process sends them.

    python -m benchmarks.wire_cost [--repeat 2000]

Times ``pagoda.engine.core_proc.dumps`` + ``loads`` (the frames the API process and the engine-core process
exchange) for the messages of a busy step: an "add" of a 1,024-token prompt (what the front end sends for one
sequence) and the "outputs" of a 32-request decode step, plain and with logprobs=5. The messages are built the
way the front end and scheduler build them, so the same command measures any revision: run it on two trees
(``PYTHONPATH=<tree>/core/src``) back to back to compare wire formats.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagoda.engine.core_proc import dumps, loads
from pagoda.logprobs import Logprob
from pagoda.sampling_params import SamplingParams

try:  # the typed wire (pagoda.engine.messages)
    from pagoda.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
    from pagoda.scheduler.request import prompt_block_hashes

    def add_message(prompt: list[int], params: SamplingParams) -> Any:
        # as the Processor sends it: the prompt's block keys hashed by the front end
        return EngineCoreRequest("req-0", prompt, params, 2, time.time(),
                                 block_hashes=prompt_block_hashes(prompt, 16, None))
except ImportError:  # before it: the scheduler's Request crossed whole
    from pagoda.engine.core_client import EngineCoreOutputs  # type: ignore[no-redef]
    from pagoda.scheduler.output import EngineCoreOutput  # type: ignore[no-redef]
    from pagoda.scheduler.request import Request

    def add_message(prompt: list[int], params: SamplingParams) -> Any:
        return Request("req-0", prompt, params, 2, 16, arrival_time=time.time())


def step_outputs(num_reqs: int, logprobs: int | None) -> Any:
    outs = []
    for i in range(num_reqs):
        out = EngineCoreOutput(req_id=f"req-{i}", new_token_ids=[1000 + i], num_cached_tokens=0)
        if logprobs is not None:
            out.new_logprobs = [{1000 + i + k: Logprob(-0.5 * k, k + 1) for k in range(logprobs + 1)}]
            out.new_sampled_logprobs = [-0.1]
        outs.append(out)
    return EngineCoreOutputs(outputs=outs)


def round_trip_us(kind: str, payload: Any, repeat: int) -> dict[str, float]:
    frame = dumps(kind, payload)
    t0 = time.perf_counter()
    for _ in range(repeat):
        dumps(kind, payload)
    t1 = time.perf_counter()
    for _ in range(repeat):
        loads(frame)
    t2 = time.perf_counter()
    return {"bytes": len(frame), "dumps_us": (t1 - t0) / repeat * 1e6, "loads_us": (t2 - t1) / repeat * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=128, temperature=0.7, top_p=0.9)
    results = {
        "add_1024_tokens": round_trip_us("add", add_message(list(range(1024)), params), args.repeat),
        "outputs_32": round_trip_us("outputs", step_outputs(32, None), args.repeat),
        "outputs_32_logprobs5": round_trip_us("outputs", step_outputs(32, 5), args.repeat),
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
