"""``runner`` / ``convert`` -> what the engine builds (vLLM's rules), decided once with the model's config.

* A family's ``ModelSpec.runner`` says what its class is: "generate" (a decoder
  with a sampler) or "pooling" (an encoder with its own pooler).
* ``runner="auto"``: the family's kind; an architecture no family names goes
  by vLLM's name suffixes (``…ForCausalLM`` generates, ``…Model`` embeds,
  ``…ForSequenceClassification`` classifies, ``…RewardModel`` rewards).
* A pooling runner over a generative class converts it (``convert``):
  ``embed`` / ``classify`` / ``reward`` (``pagoda.models.adapters``);
  ``Qwen2ForSequenceClassification`` is served by ``Qwen2ForCausalLM``
  converted with ``classify``, as vLLM does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagoda.pooling.config import (
    PoolerConfig,
    PoolingModelInfo,
    load_sentence_transformers_config,
    matryoshka_of,
    suffix_defaults,
)

logger = logging.getLogger(__name__)

# ModelSpec.runner values meaning "a pooling family" (the older names say which task)
_POOLING_RUNNER_NAMES = frozenset({"pooling", "embed", "classify", "reward", "score"})
# RoBERTa-style embeddings number positions from padding_idx + 1
_PADDING_OFFSET_MODEL_TYPES = frozenset({"roberta", "xlm-roberta", "camembert"})


@dataclass(frozen=True)
class RunnerDecision:
    runner_type: str  # "generate" | "pooling"
    pooling: PoolingModelInfo | None
    # the longest input the checkpoint takes when its files bound it below max_position_embeddings
    max_model_len: int | None = None
    max_model_len_origin: str = ""


def _family_runner(architecture: str) -> str | None:
    """The ``runner`` of the family (or in-script registration) naming this architecture; None if none does."""
    from pagoda.models.registry import ModelRegistry, UnsupportedArchitectureError

    try:
        spec = ModelRegistry.spec_for([architecture])
    except UnsupportedArchitectureError:
        return None
    return "pooling" if spec.runner in _POOLING_RUNNER_NAMES else "generate"


def _generative_sibling(architecture: str) -> str | None:
    """``Qwen2ForSequenceClassification`` -> ``Qwen2ForCausalLM`` when a family implements that."""
    for suffix in ("ForSequenceClassification", "ForRewardModeling", "RewardModel", "ForTextEncoding",
                   "EmbeddingModel", "Model"):
        if architecture.endswith(suffix):
            sibling = architecture[: -len(suffix)] + "ForCausalLM"
            if _family_runner(sibling) == "generate":
                return sibling
    return None


def resolve_runner(model_config: Any, source: Any, hf_config: Any) -> RunnerDecision:
    """Decide the runner, the conversion, the pooler settings and any length bound of the checkpoint."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    runner_opt: str = model_config.runner
    convert_opt: str = model_config.convert
    if runner_opt == "generate" and convert_opt not in ("auto", "none"):
        raise ValueError(f"convert={convert_opt!r} turns a model into a pooling model; it needs runner 'pooling' "
                         "or 'auto', not 'generate'")
    arch = architectures[0] if architectures else ""
    family = _family_runner(arch) if arch else None
    by_name_runner, by_name_convert = suffix_defaults(arch)
    if model_config.model_impl == "transformers":
        family = family if family == "generate" else None  # the fallback generates only
    if runner_opt == "auto":
        if convert_opt not in ("auto", "none"):
            runner = "pooling"
        elif family is not None:
            runner = family
        else:
            runner = by_name_runner
    else:
        runner = runner_opt
    if runner == "generate":
        if family == "pooling":
            raise ValueError(f"{arch} is a pooling model (embeddings / classification); it cannot generate text. "
                             "Use runner='pooling' (the default for it) and LLM.embed / classify / score.")
        if model_config.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models; this model runs with runner 'generate'")
        return RunnerDecision("generate", None)

    # -- pooling ------------------------------------------------------------------------------------
    build_arch = arch
    if family == "pooling":
        if convert_opt not in ("auto", "none"):
            raise ValueError(f"{arch} is already a pooling model; convert={convert_opt!r} applies to generative models")
        convert = "none"
    else:
        sibling = None if family == "generate" else _generative_sibling(arch)
        if family is None and sibling is None:
            # no family implements it: the model runner's registry lookup names what is installed
            convert = convert_opt if convert_opt not in ("auto", "none") else by_name_convert
        else:
            build_arch = arch if family == "generate" else sibling  # type: ignore[assignment]
            if convert_opt in ("auto", "none"):
                # a decoder under the pooling runner embeds unless its name says otherwise (vLLM)
                convert = by_name_convert if by_name_convert != "none" else "embed"
                if convert_opt == "none":
                    raise ValueError(f"{arch} is a generative model; runner 'pooling' needs convert 'embed', "
                                     "'classify' or 'reward' (or 'auto')")
            else:
                convert = convert_opt
    st = load_sentence_transformers_config(source.path) if getattr(source, "kind", "hf") == "hf" else None
    pooler = PoolerConfig()
    if st is not None and st.pooler_config is not None:
        pooler = st.pooler_config
    user = model_config.pooler_config
    if user is not None:
        pooler = user.merged_over(pooler)
    if convert == "reward" and pooler.use_activation is None:
        # vLLM's reward conversion returns the hidden states as they are
        pooler = PoolerConfig(**{**pooler.model_dump(), "use_activation": False})
    is_matryoshka, dims = matryoshka_of(hf_config)
    num_labels = int(getattr(hf_config, "num_labels", 0) or 0) if convert in ("none", "classify") else 0
    info = PoolingModelInfo(
        convert_type=convert,
        pooler_config=pooler,
        served_model_name=model_config.served_model_name or (model_config.model or "the model"),
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=dims,
        do_lower_case=bool(st.do_lower_case) if st is not None else False,
        num_labels=num_labels,
        architecture=build_arch,
        # a BERT-style model reads token type ids (pair encodings of a cross-encoder)
        extra={"uses_token_type_ids": convert == "none" and int(getattr(hf_config, "type_vocab_size", 0) or 0) > 1},
    )
    max_len: int | None = None
    origin = ""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and getattr(hf_config, "model_type", "") in _PADDING_OFFSET_MODEL_TYPES:
        max_len = int(positions) - int(getattr(hf_config, "pad_token_id", 1) or 0) - 1
        origin = "max_position_embeddings less the padding_idx offset of RoBERTa positions"
    if st is not None and st.max_seq_length is not None and (max_len is None or st.max_seq_length < max_len):
        max_len = int(st.max_seq_length)
        origin = "max_seq_length of sentence_bert_config.json"
    logger.info("runner: pooling (%s%s); pooler config %s", arch,
                f" served by {build_arch} converted with {convert!r}" if convert != "none" else "",
                pooler.model_dump(exclude_none=True))
    return RunnerDecision("pooling", info, max_len, origin)
