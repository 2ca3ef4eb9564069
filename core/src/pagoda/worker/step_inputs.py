"""One step's flat batch, computed from the persistent rows in bulk (numpy index math, no per-request loop)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda.attention import AttentionMetadata
from pagoda.scheduler.output import SchedulerOutput
from pagoda.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    """The scheduled requests of a step, in batch order, and their tokens laid out flat."""

    req_ids: list[str]
    rows: np.ndarray  # [R] the requests' rows in the persistent batch
    num_scheduled: np.ndarray  # [R] tokens each computes this step
    start: np.ndarray  # [R] tokens each had computed before the step
    query_start_loc: np.ndarray  # [R + 1] cumulative num_scheduled
    token_rows: np.ndarray  # [T] each token's row
    positions: np.ndarray  # [T]
    input_ids: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T] where each token's K/V goes in the paged cache
    seq_lens: np.ndarray  # [R] start + num_scheduled
    block_tables: np.ndarray  # [R, blocks of the longest sequence]
    # [R] the requests whose known tokens are all computed after this step: they sample
    samples: np.ndarray
    wants_prompt_logprobs: bool
    # [R] speculative decoding: the drafts each request verifies (its last num_draft tokens); None: none
    num_draft: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def sample_index(self) -> np.ndarray:
        """Positions in the batch of the requests that sample."""
        return np.nonzero(self.samples)[0]

    @property
    def last_token_rows(self) -> np.ndarray:
        """Each sampling request's last token, as a row of the step's flat hidden states."""
        return self.query_start_loc[1:][self.samples] - 1

    @property
    def logits_counts(self) -> np.ndarray:
        """Logits rows per sampling request: 1, or 1 + its drafts where it verifies some."""
        if self.num_draft is None:
            return np.ones(int(self.samples.sum()), dtype=np.int64)
        return self.num_draft[self.samples] + 1

    @property
    def logits_rows(self) -> np.ndarray:
        """The rows of the flat hidden states whose logits are computed: each sampling request's last token,
        and before it the positions of its drafts (a verify step reads the target's logits at each)."""
        if self.num_draft is None:
            return self.last_token_rows
        counts = self.logits_counts
        ends = self.query_start_loc[1:][self.samples]
        starts = np.repeat(ends - counts, counts)
        return starts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)

    @property
    def logits_index(self) -> np.ndarray:
        """For each logits row, its request's position in the batch."""
        index = self.sample_index
        return index if self.num_draft is None else np.repeat(index, self.logits_counts)

    def attention_metadata(self, device: torch.device) -> AttentionMetadata:
        """The eager forward's metadata (a graph replay builds its own over static buffers)."""
        qsl_cpu = torch.from_numpy(self.query_start_loc.astype(np.int32))
        seq_cpu = torch.from_numpy(self.seq_lens.astype(np.int32))
        return AttentionMetadata(
            num_seqs=len(self.rows), num_tokens=self.num_tokens,
            query_start_loc=qsl_cpu.to(device, non_blocking=True),
            seq_lens=seq_cpu.to(device, non_blocking=True),
            block_tables=torch.from_numpy(np.ascontiguousarray(self.block_tables)).to(device, non_blocking=True),
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device, non_blocking=True),
            max_query_len=int(self.num_scheduled.max()), max_seq_len=int(self.seq_lens.max()),
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_cpu,
            is_all_decode=bool((self.num_scheduled == 1).all()),
        )


def prepare_step_inputs(batch: InputBatch, so: SchedulerOutput, block_size: int) -> StepInputs:
    req_ids = list(so.num_scheduled_tokens)
    n = len(req_ids)
    rows = np.fromiter((batch.rows[r].row for r in req_ids), dtype=np.int64, count=n)
    nsched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=n)
    start = batch.num_computed[rows]
    cu = np.empty(n + 1, dtype=np.int64)
    cu[0] = 0
    np.cumsum(nsched, out=cu[1:])
    total = int(cu[-1])
    positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - start, nsched)
    token_rows = rows[np.repeat(np.arange(n), nsched)]
    slots = (batch.block_table[token_rows, positions // block_size].astype(np.int64) * block_size
             + positions % block_size)
    seq_lens = start + nsched
    max_blocks = int((seq_lens.max() + block_size - 1) // block_size)
    num_draft = None
    if so.scheduled_spec_decode_tokens:
        spec = so.scheduled_spec_decode_tokens
        num_draft = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=n)
    return StepInputs(
        req_ids=req_ids, rows=rows, num_scheduled=nsched, start=start, query_start_loc=cu,
        token_rows=token_rows, positions=positions, input_ids=batch.token_ids[token_rows, positions],
        slot_mapping=slots, seq_lens=seq_lens, block_tables=batch.block_table[rows, :max_blocks],
        samples=seq_lens >= batch.num_tokens[rows],
        wants_prompt_logprobs=bool(batch.num_prompt_logprobs[rows].max() >= 0),
        num_draft=num_draft,
    )
