"""``vllm.sampling_params``: pagoda's request-side sampling types under vLLM's module path."""

from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, SamplingType
from pagoda.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = [
    "BeamSearchParams", "GuidedDecodingParams", "RequestOutputKind", "SamplingParams", "SamplingType",
    "StructuredOutputsParams",
]
