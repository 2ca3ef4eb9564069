"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

# The longest run of whitespace a JSON constraint allows between its tokens (unless disable_any_whitespace:
# none). Unbounded, a sampled model could spend max_tokens on whitespace (at temperature 1 it did); 4 keeps
# a newline and an indent level. Every backend applies it (xgrammar's max_whitespace_cnt, llguidance's
# whitespace_pattern).
JSON_MAX_WHITESPACE = 4

# The fields that name a constraint; exactly one may be set.
_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint (vLLM's field names); options shape how the backend compiles it."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # The backend that serves this request, chosen in the front end when the engine's backend is "auto"
    # (vLLM's private ``_backend``).
    _backend: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_fields = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {set_fields or 'none'}."
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by pagoda's backends.")
        if self.disable_additional_properties:
            raise ValueError("structured_outputs.disable_additional_properties is not supported by pagoda's backends.")

    @property
    def kind(self) -> str:
        """The constraint's field name: json, regex, choice, grammar, json_object or structural_tag."""
        return next(name for name in _CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """Identical constraints compile once: (kind, canonical spec, whitespace option)."""
        kind = self.kind
        value = getattr(self, kind)
        spec = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return kind, spec, self.disable_any_whitespace


@dataclass
class GuidedDecodingParams:
    """The older name (vLLM < 0.11): same constraint fields, plus ``backend``."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    backend: str | None = None
    disable_any_whitespace: bool = False

    def to_structured_outputs(self) -> StructuredOutputsParams:
        if self.backend is not None:
            raise ValueError(
                "GuidedDecodingParams.backend per request is not supported; pagoda picks the backend "
                "from the installed pagoda.structured_output_backends plugins."
            )
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "backend"}
        return StructuredOutputsParams(**values)
