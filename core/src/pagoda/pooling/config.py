"""How a model pools: vLLM's ``PoolerConfig``, the runner / convert choice, sentence-transformers files.

Torch-free: the front ends read this to validate requests before the core runs.
Precedence of pooler settings (vLLM's): ``--pooler-config`` > the
sentence-transformers files of the checkpoint > the model family's default.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

PoolingType = Literal["LAST", "ALL", "CLS", "STEP", "MEAN"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)
RunnerOption = Literal["auto", "generate", "pooling"]
ConvertOption = Literal["auto", "none", "embed", "classify", "reward"]


class PoolerConfig(BaseModel):
    """vLLM's ``PoolerConfig``: overrides of the model's pooler (``--pooler-config '{"pooling_type": "MEAN"}'``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    pooling_type: PoolingType | None = Field(default=None, description="CLS, MEAN, LAST, ALL or STEP; None = the model's.")
    normalize: bool | None = Field(default=None, description="Default of PoolingParams.normalize (embeddings).")
    dimensions: int | None = Field(default=None, gt=0, description="Default of PoolingParams.dimensions (matryoshka models).")
    use_activation: bool | None = Field(default=None, description="Default of PoolingParams.use_activation (classification).")
    logit_bias: float | None = Field(default=None, description="Subtracted from classification logits before the activation.")
    step_tag_id: int | None = Field(default=None, description="STEP pooling: keep the positions whose token is this id.")
    returned_token_ids: list[int] | None = Field(default=None, description="STEP / ALL pooling: keep these output columns.")

    @model_validator(mode="before")
    @classmethod
    def _vllm_names(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if isinstance(data.get("pooling_type"), str):
            data["pooling_type"] = data["pooling_type"].upper()
        # vLLM's older names of use_activation
        for old in ("activation", "softmax"):
            if old in data:
                value = data.pop(old)
                if data.get("use_activation") is not None and value is not None and data["use_activation"] != value:
                    raise ValueError(f"pooler_config: {old} and use_activation disagree")
                data.setdefault("use_activation", value)
        for name in ("enable_chunked_processing", "max_embed_len"):
            if data.get(name):
                raise ValueError(f"pooler_config: {name} (vLLM's chunked processing of over-long inputs) is not "
                                 "supported by pagoda; inputs longer than max_model_len are refused or truncated with "
                                 "truncate_prompt_tokens")
            data.pop(name, None)
        return data

    def merged_over(self, base: PoolerConfig | None) -> PoolerConfig:
        """This config's set fields on top of ``base``'s."""
        if base is None:
            return self
        values = base.model_dump()
        values.update({k: v for k, v in self.model_dump().items() if v is not None})
        return PoolerConfig(**values)


# -- sentence-transformers files -------------------------------------------------------------------------

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# ST pooling modes pagoda's poolers reproduce (Pooling config key -> pooling type)
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a checkpoint's sentence-transformers files say about pooling and inputs."""

    pooler_config: PoolerConfig | None = None
    max_seq_length: int | None = None
    do_lower_case: bool = False


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_sentence_transformers_config(model_dir: Path) -> SentenceTransformersConfig:
    """``modules.json`` (+ the Pooling module's ``config.json``) and ``sentence_bert_config.json``, if present.

    A module pagoda cannot apply (a Dense projection, max pooling, ...) is an
    error rather than an embedding that silently differs from the model's.
    """
    pooler: PoolerConfig | None = None
    modules_file = model_dir / "modules.json"
    if modules_file.is_file():
        modules = _read_json(modules_file)
        types = [m.get("type", "") for m in modules]
        unknown = [t for t in types if t not in (_ST_POOLING, _ST_NORMALIZE, _ST_TRANSFORMER)]
        if unknown:
            raise ValueError(f"{modules_file} lists sentence-transformers module(s) {unknown} that pagoda does not "
                             "apply (it applies Transformer, Pooling and Normalize)")
        pooling_type: str | None = None
        for module in modules:
            if module.get("type") != _ST_POOLING:
                continue
            pooling_file = model_dir / module.get("path", "") / "config.json"
            if not pooling_file.is_file():
                raise ValueError(f"{modules_file} names a Pooling module whose {pooling_file} is missing")
            settings = _read_json(pooling_file)
            modes = [name for name, on in settings.items() if name.startswith("pooling_mode") and on]
            unsupported = [m for m in modes if m not in _ST_MODES]
            if unsupported or len(modes) != 1:
                raise ValueError(f"{pooling_file}: pagoda pools with exactly one of {sorted(_ST_MODES)}, the file "
                                 f"sets {modes or 'none'}")
            pooling_type = _ST_MODES[modes[0]]
        pooler = PoolerConfig(pooling_type=pooling_type, normalize=_ST_NORMALIZE in types or None)  # type: ignore[arg-type]
    max_seq_length: int | None = None
    do_lower_case = False
    bert_file = model_dir / "sentence_bert_config.json"
    if bert_file.is_file():
        settings = _read_json(bert_file)
        max_seq_length = settings.get("max_seq_length")
        do_lower_case = bool(settings.get("do_lower_case", False))
    return SentenceTransformersConfig(pooler, max_seq_length, do_lower_case)


# -- the runner ------------------------------------------------------------------------------------------

# vLLM's architecture-suffix defaults: (suffix, (runner, convert)), first match wins
_SUFFIX_DEFAULTS: tuple[tuple[str, tuple[str, str]], ...] = (
    ("ForCausalLM", ("generate", "none")),
    ("ForConditionalGeneration", ("generate", "none")),
    ("ChatModel", ("generate", "none")),
    ("LMHeadModel", ("generate", "none")),
    ("ForTextEncoding", ("pooling", "embed")),
    ("EmbeddingModel", ("pooling", "embed")),
    ("ForSequenceClassification", ("pooling", "classify")),
    ("ClassificationModel", ("pooling", "classify")),
    ("ForRewardModeling", ("pooling", "reward")),
    ("RewardModel", ("pooling", "reward")),
    ("Model", ("pooling", "embed")),
)


def suffix_defaults(architecture: str) -> tuple[str, str]:
    for suffix, defaults in _SUFFIX_DEFAULTS:
        if architecture.endswith(suffix):
            return defaults
    return ("generate", "none")


@dataclass(frozen=True)
class PoolingModelInfo:
    """The pooling side of a resolved model: what the front ends validate requests against.

    Duck-types what ``PoolingParams.verify`` reads from vLLM's ModelConfig.
    """

    convert_type: str  # "none" (a pooling family) | "embed" | "classify" | "reward"
    pooler_config: PoolerConfig
    served_model_name: str
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    do_lower_case: bool = False
    num_labels: int = 0
    # the registered architecture whose class is built (a generative sibling when converting)
    architecture: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def matryoshka_of(hf_config: Any) -> tuple[bool, tuple[int, ...] | None]:
    """vLLM's ``is_matryoshka``: the config lists ``matryoshka_dimensions`` or sets ``is_matryoshka``."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return True, tuple(int(d) for d in dims)
    return bool(getattr(hf_config, "is_matryoshka", False)), None
