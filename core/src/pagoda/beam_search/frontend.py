"""The front end's side of beam search: build a group for the core, and turn its result into an output.

A beam search reaches the engine core as one ``BeamGroup`` plus its root beam
(through the core client, like any request); the core answers once, when the
group is done, with an ``EngineCoreOutput`` carrying ``beam_sequences``.
"""

from __future__ import annotations

import time
from typing import Any

from pagoda.beam_search.group import BeamGroup, EarlyStopping, beam_request_params
from pagoda.beam_search.outputs import beams_to_request_output
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import BeamSearchParams
from pagoda.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.lora.request import LoRARequest


class BeamSearchFrontend:
    """Beam searches in flight on one front end: id -> (prompt text, prompt ids)."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.in_flight: dict[str, tuple[str | None, list[int]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def __len__(self) -> int:
        return len(self.in_flight)

    def start(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        params: BeamSearchParams,
        eos_token_id: int | None,
        early_stopping: EarlyStopping,
        arrival_time: float | None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[BeamGroup, EngineCoreRequest]:
        """The group and its root beam (the prompt) to hand to the core."""
        if request_id in self.in_flight:
            raise ValueError(f"request id {request_id!r} is already in use")
        group = BeamGroup(
            group_id=request_id, prompt_token_ids=prompt_token_ids, beam_width=params.beam_width,
            max_tokens=params.max_tokens, eos_token_id=None if params.ignore_eos else eos_token_id,
            length_penalty=params.length_penalty, early_stopping=early_stopping,
            temperature=params.temperature, max_model_len=self.max_model_len,
        )
        root = EngineCoreRequest(group.new_beam_id(), prompt_token_ids, beam_request_params(), None,
                                 time.time() if arrival_time is None else arrival_time, cache_salt=cache_salt,
                                 lora_request=lora_request)
        self.in_flight[request_id] = (prompt, prompt_token_ids)
        return group, root

    def forget(self, request_id: str) -> bool:
        """Drop a search (aborted); False if ``request_id`` is not one."""
        return self.in_flight.pop(request_id, None) is not None

    def split(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[RequestOutput]]:
        """-> (the outputs of ordinary requests, the RequestOutputs of finished searches)."""
        if not self.in_flight:
            return outputs, []
        rest: list[EngineCoreOutput] = []
        done: list[RequestOutput] = []
        for out in outputs:
            if out.beam_sequences is None:
                rest.append(out)
                continue
            entry = self.in_flight.pop(out.req_id, None)
            if entry is not None:
                done.append(beams_to_request_output(out.req_id, entry[0], entry[1], out.beam_sequences, self.tokenizer))
        return rest, done
