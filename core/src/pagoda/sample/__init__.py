"""Batched sampling: per-row state (SamplingBatch), per-step tensors (SamplingMetadata), the Sampler."""

from pagoda.sample.batch import SamplingBatch
from pagoda.sample.metadata import PenaltyTensors, ProcessorCall, SamplingMetadata
from pagoda.sample.output import LogprobsTensors, SamplerOutput, to_sample_logprobs
from pagoda.sample.sampler import LogprobsMode, Sampler, exponential_race, gather_logprobs

__all__ = [
    "LogprobsMode",
    "LogprobsTensors",
    "PenaltyTensors",
    "ProcessorCall",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingMetadata",
    "exponential_race",
    "gather_logprobs",
    "to_sample_logprobs",
]
