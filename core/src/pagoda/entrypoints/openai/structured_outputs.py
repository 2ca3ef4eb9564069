"""A request's constraint from its OpenAI / vLLM fields: response_format, structured_outputs, guided_*."""

from __future__ import annotations

import json
from typing import Any

from pagoda.entrypoints.openai.errors import APIError
from pagoda.structured_output.params import StructuredOutputsParams

# vLLM's older per-field names -> StructuredOutputsParams fields
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError('response_format "json_schema" needs json_schema.schema (an object)', 400, "response_format")
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        # vLLM's: {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}, or
        # xgrammar's {"type": "structural_tag", "format": {...}}; the backend reads it whole
        return StructuredOutputsParams(structural_tag=json.dumps(response_format))
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema, structural_tag)",
                   400, "response_format")


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The one constraint the request sets, or None; two ways of setting one are a 400."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    try:
        response_format = getattr(req, "response_format", None)
        if response_format is not None:
            params = _from_response_format(response_format)
            if params is not None:
                found.append(("response_format", params))
        if req.structured_outputs is not None:
            found.append(("structured_outputs", StructuredOutputsParams(**req.structured_outputs)))
        guided = {field: getattr(req, name) for name, field in _GUIDED_FIELDS.items() if getattr(req, name) is not None}
        if guided:
            found.append((", ".join(n for n in _GUIDED_FIELDS if getattr(req, n) is not None),
                          StructuredOutputsParams(**guided)))
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), 400, "structured_outputs") from None
    if len(found) > 1:
        raise APIError(f"set one structured output constraint, got {' and '.join(name for name, _ in found)}",
                       400, found[1][0])
    return found[0][1] if found else None
