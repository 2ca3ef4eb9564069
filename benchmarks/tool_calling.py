"""Tool calling on a running server: time to the first argument fragment of a named function call and of a
``tool_choice="required"`` call, with tool schemas never seen before (compiled on arrival) vs cached, beside an
unconstrained chat request. Rounds interleave the five kinds so a loaded machine slows them alike.

    pagoda serve --port 8000 &
    python -m benchmarks.tool_calling --url http://127.0.0.1:8000 --rounds 9

Each "new" request changes a description inside the parameters schema, so the constraint's cache key differs
and the grammar is compiled again; "cached" repeats one schema.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tools(version: int) -> list[dict[str, Any]]:
    weather = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20, "description": f"v{version}"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit", "days"]}
    time_zone = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10,
                                                           "description": f"v{version}"}}, "required": ["zone"]}
    return [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
            {"type": "function", "function": {"name": "get_time", "parameters": time_zone}}]


def first_fragment(client: Any, model: str, **kwargs: Any) -> tuple[float, float]:
    """(seconds to the first content or argument fragment, seconds to the end) of one streamed request."""
    start = time.perf_counter()
    first = None
    stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0, stream=True,
                                            **kwargs)
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if first is None and (delta.content or any(p.function.arguments for p in (delta.tool_calls or []))):
            first = time.perf_counter() - start
    end = time.perf_counter() - start
    return (first if first is not None else end), end


def main() -> None:
    from openai import OpenAI

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    client = OpenAI(base_url=args.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    kinds = {
        "plain": lambda i: {},
        "named, new schema": lambda i: {"tools": tools(2 * i + 1), "tool_choice": NAMED},
        "named, cached schema": lambda i: {"tools": tools(0), "tool_choice": NAMED},
        "required, new schema": lambda i: {"tools": tools(2 * i + 2), "tool_choice": "required"},
        "required, cached schema": lambda i: {"tools": tools(0), "tool_choice": "required"},
    }
    for warm in ("named, cached schema", "required, cached schema"):
        first_fragment(client, args.model, **kinds[warm](0))
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(1, args.rounds + 1):
        for kind, make in kinds.items():
            results[kind].append(first_fragment(client, args.model, **make(i)))
    for kind, runs in results.items():
        print(f"{kind:24s} first fragment median {1e3 * statistics.median(r[0] for r in runs):8.1f} ms   "
              f"whole request median {1e3 * statistics.median(r[1] for r in runs):8.1f} ms   (n={len(runs)})")


if __name__ == "__main__":
    main()
