"""What a model runner does differently on a pipeline stage: activations in and out, sampled tokens from the engine.

Stage ``s`` receives the previous stage's ``IntermediateTensors`` (shapes from the model's
``make_empty_intermediate_tensors``), runs its layers and sends its own to stage ``s + 1``; the last
stage computes logits and samples. The stages before it never wait for the sampled tokens: the engine
sends them back with the step that computes them (vLLM's way), so a stage is free for the next batch as
soon as it has sent its activations, and several micro-batches can be in flight at once.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.distributed.parallel_state import GroupCoordinator
from pagoda.distributed.pipeline import IntermediateTensors
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


def take_scheduled_tokens(batch: InputBatch, row: int, token_ids: list[int], end: int) -> None:
    """On a stage before the last: append the scheduled output tokens (ending at position ``end``) it lacks.

    Only the last stage samples; the engine hands the sampled tokens back with the step that computes
    them (``CachedRequestData.scheduled_output_token_ids``). Counting from ``end`` makes this a no-op
    on the last stage and for tokens the stage already holds (beam search's, sent as ``new_token_ids``).
    """
    missing = end - int(batch.num_tokens[row])
    if missing > 0:
        batch.append_tokens(row, token_ids[-missing:])
