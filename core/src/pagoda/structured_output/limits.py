"""Cheap bounds on a constraint's size, checked in the front end before anything compiles it.

A grammar compile's time and memory grow much faster than the schema: an object
of 10,000 optional properties never finished and grew the engine-core process past
15 GB; 400 took 0.36 s, 700 4.1 s, 1,000 17 s (xgrammar, the shared 2-vCPU guest).
So the first budget is enforced where it costs nothing: the schema's shape is
counted (one walk, no recursion) and a constraint over a bound is a 400 naming it.
For shapes the counts do not catch, ``compile_pool`` runs the compile in a worker
process under ``compile_timeout`` and ``compile_memory_bytes``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pagoda.structured_output.backend import StructuredOutputError
from pagoda.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagoda.config import StructuredOutputsConfig


def check_constraint_size(params: StructuredOutputsParams, limits: StructuredOutputsConfig) -> None:
    """StructuredOutputError naming the limit when ``params`` is over one of ``limits``' bounds (0 = none)."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            _check_chars(schema, "json", limits)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):
                return  # the backend's validate names what is wrong with it
        _check_schema(schema, limits)
    elif kind in ("regex", "grammar"):
        _check_chars(getattr(params, kind) or "", kind, limits)
    elif kind == "choice":
        _check_chars("".join(params.choice or []), "choice", limits)
    elif kind == "structural_tag":
        tag = params.structural_tag
        _check_chars(tag if isinstance(tag, str) else json.dumps(tag), "structural_tag", limits)


def _check_chars(text: str, kind: str, limits: StructuredOutputsConfig) -> None:
    if limits.max_constraint_chars and len(text) > limits.max_constraint_chars:
        raise StructuredOutputError(
            f"structured_outputs.{kind} has {len(text)} characters, more than this server's limit of "
            f"{limits.max_constraint_chars} (structured_outputs_config max_constraint_chars)")


def _check_schema(schema: Any, limits: StructuredOutputsConfig) -> None:
    nodes = 0
    stack = [schema]
    while stack:
        item = stack.pop()
        nodes += 1
        if limits.max_schema_nodes and nodes > limits.max_schema_nodes:
            raise StructuredOutputError(
                f"structured_outputs.json has more than {limits.max_schema_nodes} values, this server's limit "
                "(structured_outputs_config max_schema_nodes)")
        if isinstance(item, dict):
            properties = item.get("properties")
            if isinstance(properties, dict) and limits.max_schema_properties \
                    and len(properties) > limits.max_schema_properties:
                raise StructuredOutputError(
                    f"structured_outputs.json declares an object of {len(properties)} properties, more than this "
                    f"server's limit of {limits.max_schema_properties} (structured_outputs_config "
                    "max_schema_properties)")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
