"""Bridges the runner's persistent rows and the batched sampler."""

from __future__ import annotations

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

    def verify(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], drafts: list[list[int]],
               out: ModelRunnerOutput) -> list[list[int]]:
        """Speculative decoding: per request (batch row ``rows[i]``, its ``drafts[i]``), the accepted drafts and
        the target's next token; ``logits`` holds ``len(drafts[i]) + 1`` rows for each, in order."""
        num_draft = np.fromiter(map(len, drafts), dtype=np.int64, count=len(drafts))
        logit_rows = np.repeat(rows, num_draft + 1)
        # the row verifying draft j sees the output extended by drafts 0..j-1
        extra = [d[:j] for d in drafts for j in range(len(d) + 1)]
        draft_ids = [t for d in drafts for t in (*d, -1)]
        metadata = self.state.metadata(logit_rows, extra)
        result = rejection_sample(self.sampler, logits, metadata,
                                  torch.tensor(draft_ids, dtype=torch.int64, device=logits.device), num_draft)
        if result.logprobs_tensors is not None:
            tensors = result.logprobs_tensors.to_cpu()
            per_row = to_sample_logprobs(tensors, metadata.num_logprobs)
            sampled_lp = tensors.logprobs[:, 0].tolist()
            out.logprobs = {}
            out.sampled_logprobs = {}
            for rid, first, toks in zip(req_ids, result.first_rows.tolist(), result.token_ids):
                records = per_row[first:first + len(toks)]
                if records and records[0] is not None:
                    out.logprobs[rid] = records  # type: ignore[assignment]
                    out.sampled_logprobs[rid] = sampled_lp[first:first + len(toks)]
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
