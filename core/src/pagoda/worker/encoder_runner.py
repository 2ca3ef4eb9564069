"""The model runner's multimodal part: the encoder-output cache, the step's encoder runs, and the prompt
embeddings with each item's outputs written over its placeholder rows (vLLM v1's ``_execute_mm_encoder``
and ``_gather_mm_embeddings``).

The scheduler decides what is encoded (``SchedulerOutput.scheduled_encoder_inputs``) and what the cache
drops (``free_encoder_mm_hashes``); this class follows, so the two views of the cache agree. The one
exception is a step that raised after the scheduler counted its items as cached: an item found missing is
then encoded on the spot from the row's own tensors.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pagoda.scheduler.output import SchedulerOutput
    from pagoda.worker.input_batch import InputBatch
    from pagoda.worker.step_inputs import StepInputs


logger = logging.getLogger(__name__)


class EncoderRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model  # a SupportsMultiModal model
        self.device = device
        # item content hash -> its encoder output [placeholder length, hidden], on the device
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.num_encoded = 0  # items encoded so far (tests read it: a cached item is never encoded again)

    def run_encoders(self, so: SchedulerOutput, batch: InputBatch) -> None:
        """Drop what the scheduler evicted, then encode the step's new items into the cache."""
        for identifier in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(identifier, None)
        items: list[tuple[str, dict[str, torch.Tensor], int]] = []
        for rid, indices in so.scheduled_encoder_inputs.items():
            features = batch.rows[rid].mm_features
            for i in indices:
                f = features[i]
                if f.identifier not in self.encoder_cache and all(f.identifier != it[0] for it in items):
                    data = {k: v.to(self.device, non_blocking=True) for k, v in f.data.items()}
                    items.append((f.identifier, data, f.num_embeds))
        self._encode(items)

    def _encode(self, items: list[tuple[str, dict[str, torch.Tensor], int]]) -> None:
        if not items:
            return
        # one call per group of same-shaped inputs: a vision tower batches images of one size
        groups: dict[tuple[Any, ...], list[int]] = {}
        for j, (_, data, _) in enumerate(items):
            groups.setdefault(tuple((k, tuple(v.shape)) for k, v in sorted(data.items())), []).append(j)
        for indices in groups.values():
            outputs = self.model.embed_multimodal([items[j][1] for j in indices])
            for j, out in zip(indices, outputs):
                identifier, _, length = items[j]
                if out.shape[0] != length:
                    raise ValueError(f"the encoder returned {out.shape[0]} embeddings for an item with {length} "
                                     "embedding placeholder tokens: the processor and the model disagree")
                self.encoder_cache[identifier] = out
        self.num_encoded += len(items)

    def inputs_embeds(self, step: StepInputs, batch: InputBatch, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The step's [T, hidden] input embeddings with its items' rows in place, or None where no scheduled
        token is a placeholder (the model embeds the ids itself)."""
        # (the step's first row of a contiguous run, or the rows of a masked one; the encoder rows they take)
        writes: list[tuple[int | list[int], torch.Tensor]] = []
        for i, rid in enumerate(step.req_ids):
            features = batch.rows[rid].mm_features
            if not features:
                continue
            start = int(step.start[i])
            end = start + int(step.num_scheduled[i])
            first_row = int(step.query_start_loc[i])
            for f in features:
                lo, hi = max(start, f.placeholder.offset), min(end, f.placeholder.end)
                if lo >= hi:
                    continue
                cached = self.encoder_cache.get(f.identifier)
                if cached is None:
                    # only after a step that raised between the scheduler's bookkeeping and the encoder run: the
                    # item's tensors are at hand, so it is encoded here rather than failing this step too
                    logger.warning("request %s: item %s was not in the encoder cache; encoding it now", rid,
                                   f.identifier[:12])
                    self._encode([(f.identifier, {k: v.to(self.device) for k, v in f.data.items()},
                                   f.num_embeds)])
                    cached = self.encoder_cache[f.identifier]
                positions, out_lo, out_hi = f.placeholder.embeds_in(lo, hi)
                if not positions:
                    continue  # the chunk covers only the item's text tokens (its tile markers)
                base = first_row + lo - start
                target: int | list[int] = base if f.placeholder.is_embed is None else [base + p for p in positions]
                writes.append((target, cached[out_lo:out_hi]))
        if not writes:
            return None
        embeds = self.model.embed_input_ids(input_ids)
        for target, rows in writes:
            if isinstance(target, int):
                embeds[target:target + rows.shape[0]] = rows.to(embeds.dtype)
            else:
                embeds[torch.tensor(target, device=embeds.device)] = rows.to(embeds.dtype)
        return embeds


def has_mm_rows(step: StepInputs, batch: InputBatch) -> bool:
    """Whether any scheduled request has items (a cheap check before the per-item walk)."""
    return any(batch.rows[rid].mm_features for rid in step.req_ids)

