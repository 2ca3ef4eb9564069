"""What a model-family plugin's model class implements.

A model is written for the engine: it takes the flat token batch (no padding),
absolute positions and the step's ``AttentionMetadata``, and uses
``pagoda.attention.Attention`` layers for paged attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from pagoda.attention import AttentionMetadata


@runtime_checkable
class CausalLMModel(Protocol):
    """Constructor: ``cls(hf_config: PretrainedConfig, dtype: torch.dtype)`` on the meta or target device.

    Optional: a class attribute ``supports_output_rows = True`` declares that ``forward`` takes
    ``output_rows`` ([R] int64, ascending, or None): the rows whose final hidden states the step
    reads (the tokens that sample). The model then returns ``[R, hidden_size]``, those rows in that
    order, and may skip the rest past its last attention (which still writes every row's K/V). The
    runner passes it in eager steps whose sampled rows are fewer than the step's tokens; not
    with prompt logprobs, pooling, or on a pipeline stage other than the last. (Beyond vLLM,
    whose models always return every row.)
    """

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


def config_for(hf_config: PretrainedConfig) -> PretrainedConfig:
    """The text config of a possibly multimodal config."""
    return getattr(hf_config, "text_config", None) or hf_config
