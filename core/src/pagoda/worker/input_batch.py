"""The runner's persistent per-request state, one row per running request.

Rows live in preallocated numpy arrays updated from the scheduler's diffs, so
building a step's flat batch is bulk index math rather than per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.scheduler.output import BeamCandidates, NewRequestData
from pagoda.scheduler.request import TypedParams


@dataclass(slots=True)
class RowState(TypedParams):
    req_id: str
    row: int
    params: SamplingParams | PoolingParams
    num_prompt_tokens: int
    output_token_ids: list[int]
    # a beam search row reports candidates instead of sampling
    beam: BeamCandidates | None = None
    lora_request: LoRARequest | None = None
    # multimodal items (processed tensors, placeholder ranges); empty: text only
    mm_features: list[MultiModalFeature] = field(default_factory=list)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 with_token_type_ids: bool = False) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # -1: the row wants no prompt logprobs; else how many top alternatives per prompt token
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_beam_candidates = np.zeros(max_num_reqs, dtype=np.int64)
        # multi-LoRA: the adapter slot each row's tokens read (-1: the base model); the runner sets it
        self.lora_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        # BERT-style models: each prompt token's type id (0 where a request gives none)
        self.token_type_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64) if with_token_type_ids else None
        self.rows: dict[str, RowState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> RowState:
        if not self._free_rows:
            raise RuntimeError("input batch is full (more running requests than max_num_seqs)")
        row = self._free_rows.pop()
        n = len(new.token_ids)
        if n > self.max_model_len:
            raise ValueError(f"request {new.req_id} has {n} tokens, more than max_model_len={self.max_model_len}")
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        params = new.params
        prompt_logprobs = params.prompt_logprobs if isinstance(params, SamplingParams) else None
        self.num_prompt_logprobs[row] = -1 if prompt_logprobs is None else prompt_logprobs
        self.num_beam_candidates[row] = new.beam.num_candidates if new.beam is not None else 0
        if self.token_type_ids is not None:
            self.token_type_ids[row, :n] = new.token_type_ids if new.token_type_ids is not None else 0
        self.lora_slot[row] = -1
        state = RowState(new.req_id, row, params, new.num_prompt_tokens, new.output_token_ids, new.beam,
                         new.lora_request, list(new.mm_features or ()))
        self.rows[new.req_id] = state
        return state

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def replace_blocks(self, row: int, block_ids: list[int]) -> None:
        """Copy-on-write swapped entries of the table in place: take the whole table anew."""
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Tokens chosen outside the runner (beam search) join the row's inputs."""
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(f"row {row} would hold {end} tokens, more than max_model_len={self.max_model_len}")
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def remove(self, req_id: str) -> RowState | None:
        state = self.rows.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
        return state

    def __len__(self) -> int:
        return len(self.rows)
