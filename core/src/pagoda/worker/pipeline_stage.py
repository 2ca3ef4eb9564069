"""What a model runner does differently on a pipeline stage: activations in and out, sampled tokens shared.

Stage ``s`` receives the previous stage's ``IntermediateTensors`` (shapes from the model's
``make_empty_intermediate_tensors``), runs its layers and sends its own to stage ``s + 1``; the last
stage computes logits and samples, then broadcasts the sampled token ids over the pipeline group, so
every stage's batch holds the same tokens (the first needs them as the next step's inputs, all of them
to know which rows sample). One micro-batch is in flight at a time: the stages run one after another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagoda.distributed.parallel_state import GroupCoordinator
from pagoda.distributed.pipeline import IntermediateTensors
from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.worker.input_batch import InputBatch


def stage_inputs(pp: GroupCoordinator, model: Any, num_tokens: int, dtype: torch.dtype, device: torch.device,
                 *, receive: bool) -> dict[str, Any]:
    """The ``intermediate_tensors`` argument of a stage after the first (zeros when not ``receive``: profiling)."""
    if pp.world_size == 1 or pp.is_first_rank:
        return {}
    tensors: IntermediateTensors = model.make_empty_intermediate_tensors(num_tokens, dtype, device)
    if receive:
        for key in sorted(tensors):
            tensors[key] = pp.recv_prev(tuple(tensors[key].shape), tensors[key].dtype)
    return {"intermediate_tensors": tensors}


def send_to_next_stage(pp: GroupCoordinator, tensors: Any) -> None:
    """Send a stage's ``IntermediateTensors`` (what its model returned) to the next stage."""
    if not isinstance(tensors, IntermediateTensors):
        raise TypeError(f"a stage before the last must return IntermediateTensors, got {type(tensors).__name__}")
    for key in sorted(tensors):
        pp.send_next(tensors[key])


def share_sampled_tokens(pp: GroupCoordinator, tokens: torch.Tensor) -> None:
    """On the last stage: every other stage receives these sampled ids."""
    pp.broadcast_from_last(tokens.to(torch.int64).contiguous())


def follow_last_stage(pp: GroupCoordinator, batch: InputBatch, req_ids: list[str], rows: np.ndarray,
                      samples: np.ndarray) -> ModelRunnerOutput:
    """On a stage before the last: take the last stage's sampled ids into this stage's batch.

    The rows that sample are the same on every stage (same batch, same step); beam rows never sample.
    """
    sample_idx = np.nonzero(samples)[0]
    if len(sample_idx):
        sample_idx = sample_idx[batch.num_beam_candidates[rows[sample_idx]] == 0]
    sampled: list[list[int]] = [[] for _ in req_ids]
    if len(sample_idx):
        tokens = pp.broadcast_from_last(torch.empty(len(sample_idx), dtype=torch.int64))
        sample_rows = rows[sample_idx]
        batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = tokens.numpy()
        batch.num_tokens[sample_rows] += 1
        for i, tok in zip(sample_idx.tolist(), tokens.tolist()):
            sampled[i].append(tok)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
