"""``vllm.logprobs``: pagoda's per-token logprob record."""

from pagoda.logprobs import Logprob

__all__ = ["Logprob"]
