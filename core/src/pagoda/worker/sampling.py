"""Bridges the runner's persistent rows and the batched sampler."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagoda.sample import Sampler, SamplingBatch, gather_logprobs, to_sample_logprobs
from pagoda.sample.rejection import rejection_sample
from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.worker.input_batch import InputBatch, RowState

# Prompt logprobs need logits at every prompt position: computed this many rows at
# a time so a long chunk never holds [chunk, vocab] float32 logits at once.
_PROMPT_LOGITS_ROWS = 256


class DraftPrefixes(Sequence[list[int]]):
    """The ``extra_output`` of a verify step: logits row ``i`` verifies draft ``j`` of request ``r`` and sees
    the output extended by ``drafts[r][:j]``. Indexed on demand: only penalised or constrained rows read it,
    so an unconstrained batch builds no per-position lists."""

    def __init__(self, drafts: list[list[int]], num_draft: np.ndarray) -> None:
        self._drafts = drafts
        self._num_draft = num_draft
        per_request = num_draft + 1
        self._request = np.repeat(np.arange(len(drafts)), per_request)
        starts = np.cumsum(per_request) - per_request
        self._position = np.arange(self._request.size) - np.repeat(starts, per_request)

    def __len__(self) -> int:
        return int(self._request.size)

    def __getitem__(self, i: int) -> list[int]:  # type: ignore[override]
        return self._drafts[int(self._request[i])][: int(self._position[i])]

    def draft_ids(self) -> np.ndarray:
        """Row ``i``'s draft (the token it verifies), -1 on each request's last row (the bonus position)."""
        ids = np.full(self._request.size, -1, dtype=np.int64)
        flat = np.fromiter(itertools.chain.from_iterable(self._drafts), dtype=np.int64, count=int(self._num_draft.sum()))
        ids[self._position < self._num_draft[self._request]] = flat
        return ids


def _record_logprobs(out: ModelRunnerOutput, tensors: Any, num_logprobs: list[int | None], req_ids: list[str],
                     first_rows: np.ndarray, num_tokens: np.ndarray) -> None:
    """Request ``req_ids[i]``'s sampled-token logprobs: ``num_tokens[i]`` records from logits row
    ``first_rows[i]`` on (one for a plain step; the accepted drafts and the bonus token for a verify)."""
    tensors = tensors.to_cpu()
    per_row = to_sample_logprobs(tensors, num_logprobs)
    sampled = tensors.logprobs[:, 0].tolist()
    out.logprobs = {}
    out.sampled_logprobs = {}
    for rid, first, n in zip(req_ids, first_rows.tolist(), num_tokens.tolist()):
        records = per_row[first:first + n]
        if records and records[0] is not None:
            out.logprobs[rid] = records  # type: ignore[assignment]
            out.sampled_logprobs[rid] = sampled[first:first + n]


class RunnerSampler:
    def __init__(self, config: Any, text_config: Any, batch: InputBatch, device: torch.device) -> None:
        self.batch = batch
        vocab = int(text_config.vocab_size)
        self.state = SamplingBatch(batch.max_num_reqs, vocab, device)
        self.sampler = Sampler(logprobs_mode=config.model.logprobs_mode)
        self.logprobs_mode = config.model.logprobs_mode

    def add(self, state: RowState) -> None:
        prompt = self.batch.token_ids[state.row, : state.num_prompt_tokens]
        self.state.add_request(state.row, state.sampling_params, prompt.tolist(), state.output_token_ids)

    def remove(self, state: RowState) -> None:
        self.state.remove(state.row)

    def sample(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], out: ModelRunnerOutput) -> torch.Tensor:
        metadata = self.state.metadata(rows)
        result = self.sampler(logits, metadata)
        if result.logprobs_tensors is not None:
            _record_logprobs(out, result.logprobs_tensors, metadata.num_logprobs, req_ids,
                             np.arange(len(req_ids)), np.ones(len(req_ids), dtype=np.int64))
        return result.sampled_token_ids.to("cpu")

    def verify(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], drafts: list[list[int]],
               out: ModelRunnerOutput) -> list[list[int]]:
        """Speculative decoding: per request (batch row ``rows[i]``, its ``drafts[i]``), the accepted drafts and
        the target's next token; ``logits`` holds ``len(drafts[i]) + 1`` rows for each, in order."""
        num_draft = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        prefixes = DraftPrefixes(drafts, num_draft)
        metadata = self.state.metadata(np.repeat(rows, num_draft + 1), prefixes)
        draft_ids = prefixes.draft_ids()
        result = rejection_sample(self.sampler, logits, metadata, torch.from_numpy(draft_ids).to(logits.device),
                                  num_draft)
        if result.logprobs_tensors is not None:
            _record_logprobs(out, result.logprobs_tensors, metadata.num_logprobs, req_ids, result.first_rows,
                             np.fromiter(map(len, result.token_ids), dtype=np.int64, count=len(req_ids)))
        return result.token_ids

    def prompt_logprobs(
        self, model: Any, hidden: torch.Tensor, req_ids: list[str], rows: np.ndarray,
        start: np.ndarray, nsched: np.ndarray, cu: np.ndarray,
    ) -> dict[str, tuple[int, list[dict[int, Any] | None]]]:
        """Logprobs of the prompt tokens this step's positions predict, for the rows that ask.

        Position p predicts prompt token p + 1, so a chunk [s, e) covers prompt tokens
        [s + 1, min(e + 1, P)); the first chunk also yields None for token 0.
        """
        b = self.batch
        num_prompt = b.num_prompt_tokens[rows]
        last = np.minimum(start + nsched, num_prompt - 1)
        wants = b.num_prompt_logprobs[rows] >= 0
        out: dict[str, tuple[int, list[dict[int, Any] | None]]] = {}
        for i in np.nonzero(wants & ((start < last) | (start == 0)))[0].tolist():
            s, e, row = int(start[i]), int(last[i]), int(rows[i])
            k = int(b.num_prompt_logprobs[row])
            entries: list[dict[int, Any] | None] = [None] if s == 0 else []
            for lo in range(s, e, _PROMPT_LOGITS_ROWS):
                hi = min(lo + _PROMPT_LOGITS_ROWS, e)
                hidden_rows = torch.arange(int(cu[i]) + lo - s, int(cu[i]) + hi - s, device=hidden.device)
                logits = model.compute_logits(hidden.index_select(0, hidden_rows)).to(torch.float32)
                values = logits if self.logprobs_mode in ("raw_logits", "processed_logits") else logits.log_softmax(dim=-1)
                targets = torch.from_numpy(b.token_ids[row, lo + 1 : hi + 1].copy()).to(hidden.device)
                tensors = gather_logprobs(values, k, targets).to_cpu()
                entries.extend(to_sample_logprobs(tensors, [k] * (hi - lo)))
            out[req_ids[i]] = (0 if s == 0 else s + 1, entries)
        return out

    def beam_candidates(
        self, logits: torch.Tensor, req_ids: list[str], rows: np.ndarray
    ) -> dict[str, tuple[list[int], list[float]]]:
        """Each beam row's top next tokens by log_softmax(logits / temperature), best first."""
        logits = logits.to(torch.float32)
        temps = np.array([self.batch.rows[r].beam.temperature for r in req_ids], dtype=np.float32)
        if (temps > 0).any():
            scale = torch.from_numpy(np.where(temps > 0, temps, 1.0).astype(np.float32)).to(logits.device)
            logits = logits / scale.unsqueeze(1)
        counts = self.batch.num_beam_candidates[rows]
        values, ids = logits.log_softmax(dim=-1).topk(int(counts.max()), dim=-1)
        values_l, ids_l = values.cpu().tolist(), ids.cpu().tolist()
        return {rid: (ids_l[j][: int(counts[j])], values_l[j][: int(counts[j])]) for j, rid in enumerate(req_ids)}
