"""The model contract: what a model-family plugin's model class implements, and what it may declare it supports.

A model is written for the engine: it takes the flat token batch (no padding),
absolute positions and the step's ``AttentionMetadata``, and uses
``pagoda.attention.Attention`` layers for paged attention.

**The base contract** (vLLM's ``interfaces_base``): a generative model implements
``CausalLMModel`` (vLLM's ``VllmModelForTextGeneration``); a pooling model (an
encoder, a classifier) inherits ``PoolingModel`` (vLLM's ``VllmModelForPooling``).

**Capabilities** (vLLM's ``interfaces``): a model class declares what it supports
beyond the base by inheriting the capability's class beside ``nn.Module``, as vLLM's
families do (``class LlamaForCausalLM(nn.Module, SupportsPP, SupportsQuant)``):

=========================  ==========================  ============================================
class                      helper (what core reads)    what the model then does
=========================  ==========================  ============================================
``SupportsPP``             ``supports_pp``             pipeline parallelism (vLLM's name)
``SupportsQuant``          ``supports_quant``          loads quantized weights (vLLM's name)
``SupportsOutputRows``     ``supports_output_rows``    returns only the rows that sample
``SupportsTokenTypeIds``   ``supports_token_type_ids`` reads token type ids (BERT's segment ids)
``SupportsLoRA``           ``supports_lora``           serves LoRA adapters on its linears (vLLM's name)
``SupportsMultiModal``     ``supports_multimodal``     takes images: encodes them, embeds them (vLLM's name)
``SupportsInputsEmbeds``   ``supports_inputs_embeds``  ``forward`` takes ``inputs_embeds`` (a multimodal LM)
``NoCudaGraphs``           ``supports_cuda_graphs``    (opts out) decode steps stay eager
``PoolingModel``           ``is_pooling_model``        pools hidden states (vLLM's name)
=========================  ==========================  ============================================

A declaration is the class in the model's MRO, nothing else: core reads a
capability only through its helper (``isinstance``), never by probing the model
with ``getattr``/``hasattr`` (``core/tests/test_platforms.py`` fails on such a
probe), and a capability's data are typed ``ClassVar``s on its class. A class that
still sets one of the old flags (``supports_pp = True`` ...) without the
declaration is refused when it loads (``check_declarations``), not silently
served without the capability.

**Adding a capability** (multi-LoRA's ``SupportsLoRA``, multimodal's
``SupportsMultiModal``): one class here with its typed ``ClassVar``s (and, under
``TYPE_CHECKING``, the methods the runner calls), one helper with vLLM's name
(``supports_lora``, ``supports_multimodal``) that the code reading it calls, a row
in the table above, and the declaration on the families that implement it. Add it
with the code that reads it: a capability nothing reads is a promise nobody keeps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeGuard, runtime_checkable

from typing_extensions import TypeIs

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagoda.attention import AttentionMetadata
    from pagoda.distributed.pipeline import IntermediateTensors
    from pagoda.multimodal.inputs import PlaceholderRange
    from pagoda.pooling.pooler import DispatchPooler


@runtime_checkable
class CausalLMModel(Protocol):
    """Constructor: ``cls(hf_config: PretrainedConfig, dtype: torch.dtype)`` on the meta or target device."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute positions
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden_size]
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32 or the model dtype (only rows that sample are passed).

        The sampler widens to float32 where it needs to; a greedy step takes the argmax as is.
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Consume (HF parameter name, tensor) pairs; return the checkpoint names consumed.

        Must raise ``ValueError`` naming the weight when a checkpoint tensor fits no
        parameter, has the wrong shape, or when a parameter is left unloaded.
        """
        ...


class PoolingModel:
    """A model whose hidden states go to its ``pooler`` instead of an LM head (vLLM's ``VllmModelForPooling``).

    Constructor: ``cls(hf_config, dtype, pooler_config=None)``; ``forward`` as ``CausalLMModel``'s,
    ``load_weights`` too, no ``compute_logits``. The runner serves it with ``runner="pooling"``
    (``ModelSpec.runner``) and hands the pooler the final hidden states. A generative family needs
    none of this to embed or classify: ``pagoda.models.adapters.as_pooling_model`` converts it.
    Pooling steps are prefills, so a pooling model never runs in a decode graph.
    """

    pooler: DispatchPooler


class SupportsPP:
    """Pipeline parallelism (vLLM's ``SupportsPP``): the runner may split the model's layers across stages.

    The family builds its decoder layers with ``pagoda.distributed.pipeline.make_layers``, its
    embedding only on the first stage and its final norm and LM head only on the last
    (``PPMissingLayer`` elsewhere); ``forward`` takes ``intermediate_tensors`` on every stage but the
    first and returns ``IntermediateTensors`` on every stage but the last. Generative models only.
    """

    if TYPE_CHECKING:

        def make_empty_intermediate_tensors(
            self, num_tokens: int, dtype: torch.dtype, device: torch.device
        ) -> IntermediateTensors:
            """What a stage receives from the previous one (vLLM's name), zero-filled."""
            ...


class SupportsQuant:
    """Loads quantized weights (vLLM's ``SupportsQuant``): a quantization method may take over its layers.

    Every projection is a core ``Linear`` (or parallel subclass) and ``load_weights`` fills a parameter
    through its ``weight_loader(param, loaded_weight, shard_id)`` where it has one (``shard_id``: the
    index of the checkpoint tensor within a fused layer, None for a whole one), so
    ``pagoda.quantization.model.quantize_model`` can swap the float weights for a method's own.
    """

    # fused module -> the checkpoint modules stacked into it, in row order (vLLM's name): how a
    # quantization config matches a checkpoint's per-module scheme to the model's fused layers
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}
    # an architecture of a family that declares this but cannot load quantized weights says why here
    # (the refusal quotes it); None: it can
    quant_unsupported_reason: ClassVar[str | None] = None

    def map_checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name under the model's parameter names (the GGUF keep-blocks filter asks)."""
        return name


class SupportsLoRA:
    """Serves LoRA adapters (vLLM's ``SupportsLoRA``): every projection is a core ``Linear`` (or parallel
    subclass), whose LoRA wrapper (``pagoda.lora.layers``) adds each token's adapter to its output.

    ``packed_modules_mapping`` (vLLM's name) says which checkpoint projections a fused layer stacks, in row
    order, so an adapter's ``q_proj`` / ``k_proj`` / ``v_proj`` factors land in their rows of ``qkv_proj``;
    ``map_checkpoint_name`` turns an adapter's (Hugging Face) module names into the model's. The LM head
    and the embeddings take no adapter.
    """

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {}

    def map_checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name under the model's parameter names."""
        return name


class SupportsMultiModal:
    """Takes multimodal items (vLLM's ``SupportsMultiModal``): the front end processes them with the model's
    ``AutoProcessor`` and the runner calls the two methods below (docs/multimodal.md).

    ``embed_multimodal`` turns items' processed tensors (``MultiModalFeature.data``) into one
    ``[placeholder length, hidden]`` tensor each (the encoder: a vision tower and projector);
    ``embed_input_ids`` embeds text tokens; ``forward`` then takes ``inputs_embeds`` ([T, hidden], the
    text embeddings with each item's rows written over its placeholders) in place of ``input_ids``.
    """

    # the modalities the model takes (a key of multi_modal_data); the front end refuses the others
    supported_modalities: ClassVar[tuple[str, ...]] = ("image",)

    if TYPE_CHECKING:

        def embed_multimodal(self, items: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
            """One ``[num placeholder tokens, hidden]`` tensor per item, in order (vLLM's name)."""
            ...

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            """[T] -> [T, hidden]: the text embeddings (vLLM's name)."""
            ...

        @classmethod
        def split_mm_items(cls, processor: Any, ids: list[int], outputs: dict[str, torch.Tensor],
                           num_items: int) -> list[tuple[PlaceholderRange, dict[str, torch.Tensor]]]:
            """Optional (beyond vLLM, whose families register a processor class): the front end's split of one
            processed prompt into its items, each its placeholder range (with ``is_embed`` where text tokens
            sit among its image tokens) and its own tensors. Without it the front end assumes one
            contiguous run of image tokens and one tensor row per image
            (``pagoda.multimodal.processing.split_items``)."""
            ...


class SupportsInputsEmbeds:
    """A language model whose ``forward`` takes ``inputs_embeds`` ([T, hidden], in place of the embedding of
    ``input_ids``) and which embeds ids with ``embed_input_ids``: what a multimodal family needs of the
    decoder it runs (reached through ``ModelRegistry``, never imported from another plugin)."""

    if TYPE_CHECKING:

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            ...


class SupportsOutputRows:
    """``forward`` takes ``output_rows`` and returns only those rows (beyond vLLM, whose models return every row).

    ``output_rows`` ([R] int64, ascending, or None) are the rows whose final hidden states the step
    reads (the tokens that sample). The model then returns ``[R, hidden_size]``, those rows in that
    order, and may skip the rest past its last attention (which still writes every row's K/V). The
    runner passes it in eager steps whose sampled rows are fewer than the step's tokens; not with
    prompt logprobs, pooling, or on a pipeline stage other than the last.
    """


class SupportsTokenTypeIds:
    """``forward`` takes ``token_type_ids`` ([T] int64, BERT's segment ids): the batch keeps them per row."""


class NoCudaGraphs:
    """A model whose decode step cannot be captured in a CUDA (or CPU kernel) graph: its steps stay eager.

    ``pagoda.layers.FusedMoE`` reads its per-expert token counts on the host, which a graph cannot
    capture; a family whose architectures use it declares this on those classes.
    """


def _declares(model: object, capability: type) -> bool:
    """Whether ``model`` (an instance or a model class) has ``capability`` in its MRO."""
    return issubclass(model, capability) if isinstance(model, type) else isinstance(model, capability)


def is_pooling_model(model: object) -> bool:
    """``model`` (an instance or a class) is a ``PoolingModel`` (vLLM's name)."""
    return _declares(model, PoolingModel)


def supports_pp(model: object) -> TypeIs[SupportsPP]:
    """``model`` declares ``SupportsPP`` (vLLM's name)."""
    return isinstance(model, SupportsPP)


def supports_quant(model: object) -> TypeGuard[SupportsQuant]:
    """``model`` declares ``SupportsQuant`` and its architecture names no reason it cannot."""
    return isinstance(model, SupportsQuant) and model.quant_unsupported_reason is None


def quant_unsupported_reason(model: object) -> str:
    """Why ``model`` loads no quantized weights (for a model ``supports_quant`` refuses)."""
    if isinstance(model, SupportsQuant) and model.quant_unsupported_reason is not None:
        return model.quant_unsupported_reason
    return "its model family does not declare SupportsQuant"


def supports_lora(model: object) -> TypeIs[SupportsLoRA]:
    """``model`` declares ``SupportsLoRA`` (vLLM's name)."""
    return _declares(model, SupportsLoRA)


def supports_multimodal(model: object) -> TypeIs[SupportsMultiModal]:
    """``model`` (an instance or a class) declares ``SupportsMultiModal`` (vLLM's name)."""
    return _declares(model, SupportsMultiModal)


def supports_inputs_embeds(model: object) -> TypeIs[SupportsInputsEmbeds]:
    """``model`` (an instance or a class) declares ``SupportsInputsEmbeds``."""
    return _declares(model, SupportsInputsEmbeds)


def supports_output_rows(model: object) -> TypeIs[SupportsOutputRows]:
    return isinstance(model, SupportsOutputRows)


def supports_token_type_ids(model: object) -> TypeIs[SupportsTokenTypeIds]:
    return isinstance(model, SupportsTokenTypeIds)


def supports_cuda_graphs(model: object) -> bool:
    """The runner may capture ``model``'s decode steps in graphs: no ``NoCudaGraphs``, no pooling model."""
    return not _declares(model, NoCudaGraphs) and not is_pooling_model(model)


# The class attributes that declared these before the classes did (pagoda's plugin API 1.0 - 1.4), and
# (the value that meant "declared", the class that declares it now).
_OLD_FLAGS: dict[str, tuple[bool, type]] = {
    "supports_pp": (True, SupportsPP),
    "supports_quant": (True, SupportsQuant),
    "supports_output_rows": (True, SupportsOutputRows),
    "uses_token_type_ids": (True, SupportsTokenTypeIds),
    "is_pooling_model": (True, PoolingModel),
    "supports_cuda_graphs": (False, NoCudaGraphs),
}


def check_declarations(cls: type) -> None:
    """Refuse a model class that sets an old capability flag without the capability's class.

    Core no longer reads the flags: such a class would be served without the capability it meant to
    declare (its token type ids dropped, a MoE decode captured in a graph), so it fails to load instead.
    """
    for klass in cls.__mro__:
        for name, (declared, capability) in _OLD_FLAGS.items():
            if vars(klass).get(name, not declared) is declared and not issubclass(cls, capability):
                raise TypeError(
                    f"{cls.__qualname__} sets {name} = {declared} (in {klass.__qualname__}), a model capability "
                    f"flag core no longer reads: inherit pagoda.models.interface.{capability.__name__} instead"
                )


def config_for(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The text config of a possibly multimodal config."""
    return getattr(hf_config, "text_config", None) or hf_config
