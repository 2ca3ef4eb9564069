"""PoolingParams: what a pooling request asks of the pooler (vLLM's fields and checks).

A pooling request runs its prompt once (prefill only) and returns a pooled
tensor instead of sampled tokens. ``verify`` fills the defaults of its task
(embeddings normalized, classification activated) and refuses parameters the
task or the model does not support, so bad requests fail before the core.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pagoda.sampling_params import RequestOutputKind

# vLLM's pooling tasks. "encode" is the generic per-token task: it runs as
# "token_embed" or "token_classify", whichever the model supports.
PoolingTask = Literal["encode", "embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)

# Parameters each task honours; any other one set on a request is an error.
_VALID_PARAMETERS: dict[str, tuple[str, ...]] = {
    "embed": ("dimensions", "normalize"),
    "token_embed": ("dimensions", "normalize"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
    "token_classify": ("use_activation",),
    "encode": (),
}
_ALL_PARAMETERS: tuple[str, ...] = ("dimensions", "normalize", "use_activation")


@dataclass
class PoolingParams:
    """vLLM's ``PoolingParams``.

    ``dimensions``: keep the first N dimensions of an embedding (matryoshka
    models only); ``normalize``: L2-normalize embeddings (default on);
    ``use_activation``: softmax / sigmoid on classification logits (default
    on; ``activation`` is its older name); ``task``: set by the API method
    (``LLM.embed`` -> "embed", ...) or by ``verify``.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    # vLLM's deprecated name of ``use_activation``; folded into it on construction
    activation: bool | None = None
    # STEP pooling (process reward models): keep only positions whose token is this id ...
    step_tag_id: int | None = None
    # ... and only these columns of the per-token output
    returned_token_ids: list[int] | None = None
    task: PoolingTask | None = None
    # pooler-specific extras a model family may read (e.g. token type ids of a cross-encoder pair)
    extra_kwargs: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY
    # the prompt's token ids reach the pooler (STEP pooling reads them); set by ``verify``
    requires_token_ids: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.activation is not None:
            if self.use_activation is not None and self.use_activation != self.activation:
                raise ValueError("activation and use_activation disagree; activation is the old name, use use_activation")
            self.use_activation = self.activation
            self.activation = None
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task={self.task!r} is not a pooling task; expected one of {', '.join(POOLING_TASKS)}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1):
            raise ValueError("truncate_prompt_tokens must be -1 (the model's maximum length) or a positive integer")

    @property
    def all_parameters(self) -> list[str]:
        return list(_ALL_PARAMETERS)

    @property
    def valid_parameters(self) -> dict[str, list[str]]:
        return {task: list(params) for task, params in _VALID_PARAMETERS.items()}

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

    def verify(self, task: str, model_config: Any = None) -> None:
        """Fix the task, merge the model's pooler-config defaults, fill the task's defaults, refuse the rest.

        ``model_config`` is anything with ``pooler_config`` (a ``PoolerConfig``),
        ``is_matryoshka``, ``matryoshka_dimensions`` and ``served_model_name``
        (the engine passes its resolved pooling model); None skips the model checks.
        """
        if task not in POOLING_TASKS:
            raise ValueError(f"{task!r} is not a pooling task; expected one of {', '.join(POOLING_TASKS)}")
        if self.task is None:
            self.task = task  # type: ignore[assignment]
        elif self.task != task:
            raise ValueError(f"You cannot overwrite {self.task=!r} with {task=!r}!")
        self._merge_default_parameters(model_config)
        self._set_default_parameters(model_config)
        self._verify_valid_parameters()

    def _merge_default_parameters(self, model_config: Any) -> None:
        pooler_config = getattr(model_config, "pooler_config", None)
        if pooler_config is None:
            return
        assert self.task is not None
        for name in _VALID_PARAMETERS[self.task]:
            default = getattr(pooler_config, name, None)
            if default is not None and getattr(self, name) is None:
                setattr(self, name, default)

    def _set_default_parameters(self, model_config: Any) -> None:
        if self.task in ("embed", "token_embed"):
            if self.normalize is None:
                self.normalize = True
            if self.dimensions is not None and model_config is not None:
                name = getattr(model_config, "served_model_name", None) or "this model"
                if not getattr(model_config, "is_matryoshka", False):
                    raise ValueError(
                        f'Model "{name}" does not support matryoshka representation, changing output dimensions '
                        "will lead to poor results."
                    )
                allowed = getattr(model_config, "matryoshka_dimensions", None)
                if allowed and self.dimensions not in allowed:
                    raise ValueError(
                        f'Model "{name}" only supports {list(allowed)} matryoshka dimensions, use other output '
                        "dimensions will lead to poor results."
                    )
        elif self.task in ("classify", "score", "token_classify"):
            if self.use_activation is None:
                self.use_activation = True

    def _verify_valid_parameters(self) -> None:
        assert self.task is not None
        valid = _VALID_PARAMETERS[self.task]
        invalid = [name for name in _ALL_PARAMETERS if name not in valid and getattr(self, name) is not None]
        if invalid:
            raise ValueError(
                f"Task {self.task} only supports {list(valid)} parameters, does not support {invalid} parameters"
            )
