"""Default sampling parameters from the model: vLLM's ``--generation-config auto|vllm|PATH``.

A model's ``generation_config.json`` says how its authors sample it; vLLM takes
a subset of it as the defaults of every request that leaves those fields
unset, and so does pagoda. The embedded default model is a GGUF file without
one, so it gets the sampling its model card recommends.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.model_loader.errors import ModelLoadError
from pagoda.model_loader.source import ModelSource

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field: the subset vLLM applies
# (vllm.config.ModelConfig.get_diff_sampling_param).
SAMPLING_FIELDS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
# SmolLM2-135M-Instruct's model card: "temperature=0.2, top_p=0.9". Its GGUF
# carries no generation config; at pagoda's 1.0 a reply now and then wanders
# off and never samples <|im_end|> (measured: docs/benchmarks.md, "The default model's sampling defaults").
DEFAULT_MODEL_SAMPLING: dict[str, Any] = {"temperature": 0.2, "top_p": 0.9}


@dataclass(frozen=True)
class GenerationDefaults:
    """What requests that leave sampling fields unset get, and where it came from."""

    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id (extra stop tokens)
    origin: str = "pagoda's defaults"

    def describe(self) -> str:
        if not self.sampling:
            return f"Default sampling parameters: {self.origin} (SamplingParams' own defaults)"
        return (
            f"Default sampling parameters have been overridden by {self.origin}: {self.sampling}. "
            "Requests that set a field keep their value; pass generation_config='vllm' "
            "(--generation-config vllm) for pagoda's own defaults"
        )


def load_generation_defaults(
    source: ModelSource, generation_config: str = "auto", overrides: dict[str, Any] | None = None
) -> GenerationDefaults:
    """The defaults for ``source`` under ``generation_config`` ('auto', 'vllm' or a directory / file path)."""
    if generation_config in ("auto", "vllm"):
        path: Path | None = source.path / GENERATION_CONFIG_FILE
        origin = f"the model's generation config ({path})"
        values = _read(path) if path is not None and path.is_file() else None
        if values is None and source.is_default:
            values, origin = dict(DEFAULT_MODEL_SAMPLING), "the embedded default model's recommended sampling (its model card)"
    else:
        path = Path(generation_config).expanduser()
        if path.is_dir():
            path = path / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ModelLoadError(
                f"generation_config={generation_config!r} is neither 'auto', 'vllm' nor a directory holding "
                f"{GENERATION_CONFIG_FILE} (or that file)"
            )
        values, origin = _read(path), f"the generation config {path}"
    values = values or {}
    eos = values.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(int(t) for t in eos or ())

    sampling: dict[str, Any] = {}
    if generation_config != "vllm":
        sampling = {SAMPLING_FIELDS[k]: v for k, v in values.items() if k in SAMPLING_FIELDS and v is not None}
    else:
        origin = "pagoda's defaults (generation_config='vllm')"
    if overrides:
        unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
        if unknown:
            raise ModelLoadError(
                f"override_generation_config has unknown keys {unknown}; allowed: {', '.join(SAMPLING_FIELDS)}"
            )
        sampling.update({SAMPLING_FIELDS[k]: v for k, v in overrides.items()})
        origin += " with override_generation_config"
    _check(sampling, origin)
    return GenerationDefaults(sampling=sampling, eos_token_ids=eos_ids, origin=origin)


def _read(path: Path) -> dict[str, Any]:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def _check(sampling: dict[str, Any], origin: str) -> None:
    """Fail at start-up, naming the source, rather than in every request."""
    from pagoda.sampling_params import SamplingParams

    try:
        SamplingParams(**sampling)
    except (ValueError, TypeError) as exc:
        raise ModelLoadError(f"Invalid default sampling parameters from {origin}: {exc}") from exc
