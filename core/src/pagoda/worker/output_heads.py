"""What the last pipeline stage does with a step's hidden states: one head per runner kind, chosen at load.

* ``GenerateHead``: prompt logprobs where asked, logits at the rows that sample, then the logits stages in
  order (beam search rows take their candidates out, the grammar masks the constrained rows), then the
  sampler for the rows left.
* ``PoolingHead``: the model's pooler over each request whose prompt is all computed.

A logits stage is a small object with one job; a new feature that edits logits before sampling adds a
stage to the list ``GenerateHead`` is built with, not a branch in the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.pooling.pooler import PoolingMetadata
from pagoda.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagoda.structured_output.backend import StructuredOutputBackend
from pagoda.structured_output.manager import load_backend_class
from pagoda.worker.input_batch import InputBatch
from pagoda.worker.sampling import RunnerSampler
from pagoda.worker.step_inputs import StepInputs


class OutputHead(Protocol):
    def __call__(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput,
                 only_sampled_rows: bool) -> ModelRunnerOutput: ...


@dataclass(slots=True)
class SampleRows:
    """The rows a logits tensor holds: positions in the step's batch (``StepInputs.req_ids`` order)."""

    index: np.ndarray

    def req_ids(self, step: StepInputs) -> list[str]:
        return [step.req_ids[i] for i in self.index.tolist()]


class LogitsStage(Protocol):
    def __call__(self, logits: torch.Tensor, rows: SampleRows, step: StepInputs, so: SchedulerOutput,
                 out: ModelRunnerOutput) -> tuple[torch.Tensor, SampleRows]:
        """-> the logits (and rows) the next stage sees."""
        ...


class BeamCandidatesStage:
    """Beam search rows report their top next tokens (the scheduler picks the beams' tokens) and sample nothing."""

    def __init__(self, batch: InputBatch, sampler: RunnerSampler) -> None:
        self.batch = batch
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, rows: SampleRows, step: StepInputs, so: SchedulerOutput,
                 out: ModelRunnerOutput) -> tuple[torch.Tensor, SampleRows]:
        batch_rows = step.rows[rows.index]
        is_beam = self.batch.num_beam_candidates[batch_rows] > 0
        if not is_beam.any():
            return logits, rows
        beam = rows.index[is_beam]
        out.beam_candidates = self.sampler.beam_candidates(
            logits[torch.from_numpy(np.nonzero(is_beam)[0]).to(logits.device)], [step.req_ids[i] for i in beam],
            step.rows[beam])
        keep = np.nonzero(~is_beam)[0]
        return logits[torch.from_numpy(keep).to(logits.device)], SampleRows(rows.index[keep])


class GrammarMaskStage:
    """Structured outputs: mask the constrained rows' logits with the scheduler's bitmask, one op for the batch."""

    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name
        # the class only (its kernel is a static method): the backend instance lives beside the scheduler;
        # loaded on the first constrained step
        self._backend: type[StructuredOutputBackend] | None = None

    def __call__(self, logits: torch.Tensor, rows: SampleRows, step: StepInputs, so: SchedulerOutput,
                 out: ModelRunnerOutput) -> tuple[torch.Tensor, SampleRows]:
        grammar = so.grammar
        if grammar is None:
            return logits, rows
        # a request verifying drafts has consecutive logits rows and as many consecutive bitmask rows
        idx = rows.index
        positions = np.arange(len(idx))
        group_start = np.maximum.accumulate(np.where(np.r_[True, idx[1:] != idx[:-1]], positions, 0))
        offsets = (positions - group_start).tolist()
        mask_rows = [grammar.request_rows.get(rid, -1) for rid in rows.req_ids(step)]
        mask_rows = [r + o if r >= 0 else -1 for r, o in zip(mask_rows, offsets)]
        if max(mask_rows) < 0:
            return logits, rows
        if self._backend is None:
            self._backend = load_backend_class(self.backend_name)
        # a row per sampled request, all ones (everything allowed) for the unconstrained ones
        bitmask = torch.full((len(mask_rows), grammar.bitmask.shape[1]), -1, dtype=torch.int32)
        constrained = [i for i, r in enumerate(mask_rows) if r >= 0]
        bitmask[constrained] = grammar.bitmask[[mask_rows[i] for i in constrained]]
        # float32 so a half-precision model's -inf fill and the sampler's in-place edits agree
        logits = logits.to(torch.float32)
        self._backend.apply_token_bitmask(logits, bitmask.to(logits.device))
        return logits, rows


class GenerateHead:
    def __init__(self, model: Any, batch: InputBatch, sampler: RunnerSampler, stages: list[LogitsStage]) -> None:
        self.model = model
        self.batch = batch
        self.sampler = sampler
        self.stages = stages

    @classmethod
    def build(cls, model: Any, batch: InputBatch, config: EngineConfig, text_config: Any,
              device: torch.device) -> GenerateHead:
        sampler = RunnerSampler(config, text_config, batch, device)
        stages: list[LogitsStage] = [BeamCandidatesStage(batch, sampler),
                                     GrammarMaskStage(config.structured_outputs_config.backend)]
        return cls(model, batch, sampler, stages)

    def __call__(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput,
                 only_sampled_rows: bool) -> ModelRunnerOutput:
        out = ModelRunnerOutput.empty(step.req_ids)
        if step.wants_prompt_logprobs:
            out.prompt_logprobs = self.sampler.prompt_logprobs(self.model, hidden, step.req_ids, step.rows,
                                                               step.start, step.num_scheduled, step.query_start_loc)
        # one logits row per sampling request, or with speculative decoding one per verified position
        rows = SampleRows(step.logits_index)
        if not len(rows.index):
            return out
        if not only_sampled_rows:  # else the model returned exactly the rows that sample
            hidden = hidden.index_select(0, torch.from_numpy(step.logits_rows).to(hidden.device))
        logits = self.model.compute_logits(hidden)
        for stage in self.stages:
            logits, rows = stage(logits, rows, step, so, out)
        if not len(rows.index):
            return out
        if step.num_draft is not None:
            self._verify(logits, rows, step, so, out)
        else:
            self._sample(logits, rows, step, out)
        return out

    def _verify(self, logits: torch.Tensor, rows: SampleRows, step: StepInputs, so: SchedulerOutput,
                out: ModelRunnerOutput) -> None:
        """Speculative decoding: the rejection sampler keeps each request's accepted drafts and adds one token."""
        b = self.batch
        # the requests, in order (each owns 1 + its drafts consecutive logits rows)
        index = rows.index[np.r_[True, rows.index[1:] != rows.index[:-1]]]
        req_ids = [step.req_ids[i] for i in index.tolist()]
        drafts = [so.scheduled_spec_decode_tokens.get(rid, []) for rid in req_ids]
        batch_rows = step.rows[index]
        tokens = self.sampler.verify(logits, batch_rows, req_ids, drafts, out)
        for i, row, toks, d in zip(index.tolist(), batch_rows.tolist(), tokens, drafts):
            n = int(b.num_tokens[row])
            b.token_ids[row, n:n + len(toks)] = toks
            b.num_tokens[row] = n + len(toks)
            # positions of the rejected drafts are computed again next step
            b.num_computed[row] -= len(d) - (len(toks) - 1)
            out.sampled_token_ids[i].extend(toks)

    def _sample(self, logits: torch.Tensor, rows: SampleRows, step: StepInputs, out: ModelRunnerOutput) -> None:
        b = self.batch
        batch_rows = step.rows[rows.index]
        tokens = self.sampler.sample(logits, batch_rows, rows.req_ids(step), out)
        # The runner keeps its own copy of each request's tokens for the next step's inputs.
        b.token_ids[batch_rows, b.num_tokens[batch_rows]] = tokens
        b.num_tokens[batch_rows] += 1
        for i, tok in zip(rows.index.tolist(), tokens.tolist()):
            out.sampled_token_ids[i].append(tok)


class PoolingHead:
    """The pooler over each request whose prompt is all computed; float32 results on the host."""

    def __init__(self, model: Any, batch: InputBatch) -> None:
        self.model = model
        self.batch = batch

    def __call__(self, hidden: torch.Tensor, step: StepInputs, so: SchedulerOutput,
                 only_sampled_rows: bool) -> ModelRunnerOutput:
        pooled: list[torch.Tensor | None] = [None] * len(step.req_ids)
        out = ModelRunnerOutput.empty(step.req_ids)
        out.pooler_output = pooled
        idx = step.sample_index
        if not len(idx):
            return out
        if (step.start[idx] != 0).any():
            # chunked prefill and prefix caching are off for pooling models: a prompt is one step
            raise RuntimeError("a pooling request reached the pooler without its whole prompt in the step")
        b = self.batch
        params = [b.rows[step.req_ids[i]].pooling_params for i in idx.tolist()]
        tokens = None
        if any(p.requires_token_ids for p in params):
            tokens = [torch.from_numpy(b.token_ids[step.rows[i], : step.num_scheduled[i]].copy()) for i in idx.tolist()]
        md = PoolingMetadata(starts=step.query_start_loc[idx].tolist(), lengths=step.num_scheduled[idx].tolist(),
                             pooling_params=params, prompt_token_ids=tokens)
        for i, result in zip(idx.tolist(), self.model.pooler(hidden, md)):
            pooled[i] = result.detach().to("cpu", torch.float32)
        return out
