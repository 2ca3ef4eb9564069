"""Bridges the runner's persistent rows and the batched sampler."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagoda.sample import Sampler, SamplingBatch, to_sample_logprobs
from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.worker.input_batch import InputBatch, RowState


class RunnerSampler:
    def __init__(self, config: Any, text_config: Any, batch: InputBatch, device: torch.device, model: Any) -> None:
        self.batch = batch
        vocab = int(getattr(text_config, "vocab_size"))
        self.state = SamplingBatch(batch.max_num_reqs, vocab, device)
        self.sampler = Sampler(logprobs_mode=config.model.logprobs_mode)

    def add(self, state: RowState) -> None:
        prompt = self.batch.token_ids[state.row, : state.num_prompt_tokens]
        self.state.add_request(state.row, state.sampling_params, prompt, state.output_token_ids)

    def remove(self, state: RowState) -> None:
        self.state.remove(state.row)

    def sample(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], out: ModelRunnerOutput) -> torch.Tensor:
        metadata = self.state.metadata(rows)
        result = self.sampler(logits, metadata)
        if result.logprobs_tensors is not None:
            tensors = result.logprobs_tensors.to_cpu()
            per_row = to_sample_logprobs(tensors, metadata.num_logprobs)
            sampled_lp = tensors.logprobs[:, 0].tolist()
            out.logprobs = {}
            out.sampled_logprobs = {}
            for rid, record, lp in zip(req_ids, per_row, sampled_lp):
                if record is not None:
                    out.logprobs[rid] = [record]
                    out.sampled_logprobs[rid] = [lp]
        return result.sampled_token_ids.to("cpu")
