"""One ``--lora-modules`` entry, parsed with nothing heavy imported.

`pagoda serve` checks its ``--lora-modules`` before it spawns the engine core, so this module imports
no torch (``pagoda.lora`` does): the spawn would otherwise wait for torch's import (~2.5 s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's name)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: str) -> LoRAModulePath:
        """``name=path`` or a JSON object with ``name``, ``path`` and optionally ``base_model_name``."""
        text = value.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules {value!r}: not valid JSON: {exc}") from exc
            if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
                raise ValueError(f"--lora-modules {value!r}: the JSON form needs string 'name' and 'path'")
            unknown = set(data) - {"name", "path", "base_model_name"}
            if unknown:
                raise ValueError(f"--lora-modules {value!r}: unknown key(s) {sorted(unknown)}")
            return cls(data["name"], data["path"], data.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path or a JSON object")
        return cls(name, path)
