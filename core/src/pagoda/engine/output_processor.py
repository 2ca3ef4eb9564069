"""Turns the core's token outputs into RequestOutputs: detokenize, stop strings, output kinds.

Runs outside the core's step loop. A stop string found in the text finishes the
request here and reports its id so the core aborts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.messages import EngineCoreOutput, PredictionCounts
from pagoda.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    request_id: str
    parent_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    detokenizer: IncrementalDetokenizer | None
    wants_logprobs: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Any]] | None = None
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    sent_tokens: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    sent_prompt_logprobs: bool = False
    # DELTA: this sequence's finish was delivered; later outputs of its request leave it out, so a stream
    # carries one finish_reason per choice however long its siblings run (issue 39: a second one was sent)
    sent_finish: bool = False
    # a pooling request's result (the pooler's tensor)
    pooling_output: Any = None
    # predicted outputs: the latest counts the core sent
    prediction: PredictionCounts | None = None


@dataclass
class ParentState:
    """Groups the n (or best_of) sequences of one user request."""

    request_id: str
    n: int
    best_of: int
    children: list[RequestState]
    kind: RequestOutputKind
    rank_by_logprob: bool = False
    # the adapter the request ran with (RequestOutput.lora_request)
    lora_request: Any = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


def _find_stop(text: str, new_len: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Earliest stop string that overlaps the new text -> (stop, cut position)."""
    best: tuple[str, int] | None = None
    for stop in stops:
        if not stop:
            continue
        start = max(0, len(text) - new_len - len(stop) + 1)
        pos = text.find(stop, start)
        if pos >= 0:
            cut = pos + len(stop) if include else pos
            if best is None or pos < best[1] - (len(best[0]) if include else 0):
                best = (stop, cut)
    return best


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, RequestState] = {}
        self.parents: dict[str, ParentState] = {}

    def add_request(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.children[child.request_id] = child

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def abort(self, parent_id: str) -> list[str]:
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return []
        for c in parent.children:
            self.children.pop(c.request_id, None)
        return [c.request_id for c in parent.children]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[Any], list[str]]:
        """-> (request outputs to deliver, child request ids the core must abort)."""
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        for out in outputs:
            state = self.children.get(out.req_id)
            if state is None:
                continue  # late output of an aborted request
            self._apply(state, out)
            if state.finish_reason == "stop" and out.finish_reason is None:
                to_abort.append(state.request_id)  # a stop string ended it on our side
            touched[state.parent_id] = self.parents[state.parent_id]
        results: list[Any] = []
        for parent in touched.values():
            ro = self._make_output(parent)
            if ro is not None:
                results.append(ro)
            if parent.finished:
                self.abort(parent.request_id)
        return results, to_abort

    def _apply(self, st: RequestState, out: EngineCoreOutput) -> None:
        if st.finish_reason is not None:
            return
        st.num_cached_tokens = out.num_cached_tokens
        if out.prediction is not None:
            st.prediction = out.prediction
        if out.pooling_output is not None:
            st.pooling_output = out.pooling_output
        if out.new_prompt_logprobs is not None:
            if self.tokenizer is not None:
                for record in out.new_prompt_logprobs:
                    for tok, lp in (record or {}).items():
                        if lp.decoded_token is None:
                            lp.decoded_token = self.tokenizer.decode([tok])
            st.prompt_logprobs = (st.prompt_logprobs or []) + out.new_prompt_logprobs
        ids = out.new_token_ids
        st.token_ids.extend(ids)
        if out.new_logprobs is not None and st.wants_logprobs:
            if self.tokenizer is not None:
                for record in out.new_logprobs:
                    for tok, lp in record.items():
                        if lp.decoded_token is None:
                            lp.decoded_token = self.tokenizer.decode([tok])
            st.logprobs = (st.logprobs or []) + out.new_logprobs
        if out.new_sampled_logprobs is not None:
            st.cumulative_logprob += float(sum(out.new_sampled_logprobs))
        params = st.params
        if st.detokenizer is not None and ids:
            assert isinstance(params, SamplingParams)  # only generated text is detokenized
            # don't show the EOS / stop token as text
            shown = ids
            if out.finish_reason == "stop" and not params.include_stop_str_in_output:
                shown = ids[:-1] if ids and (out.stop_reason is None or isinstance(out.stop_reason, int)) else ids
            delta = st.detokenizer.add_tokens(shown)
            st.text += delta
            stops = params.stop or []
            if isinstance(stops, str):
                stops = [stops]
            if stops and delta:
                found = _find_stop(st.text, len(delta), stops, params.include_stop_str_in_output)
                if found is not None:
                    stop, cut = found
                    st.text = st.text[:cut]
                    st.finish_reason = "stop"
                    st.stop_reason = stop
                    return
        if out.finish_reason is not None:
            st.finish_reason = out.finish_reason
            st.stop_reason = out.stop_reason

    def _completion(self, st: RequestState, delta: bool) -> CompletionOutput:
        visible = st.text
        if st.finish_reason is None:
            # Hold back the tail that may be the start of a stop string, so a stop split
            # across steps never reaches the client (vLLM's output_text_buffer_length).
            hold = st.params.output_text_buffer_length if isinstance(st.params, SamplingParams) else 0
            if hold:
                visible = st.text[: max(len(st.text) - hold, st.sent_text)]
        if delta:
            text = visible[st.sent_text:]
            ids = st.token_ids[st.sent_tokens:]
            lps = st.logprobs[st.sent_logprobs:] if st.logprobs is not None else None
            st.sent_text, st.sent_tokens = len(visible), len(st.token_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        else:
            text, ids, lps = visible, list(st.token_ids), (list(st.logprobs) if st.logprobs is not None else None)
        want_lp = st.wants_logprobs
        return CompletionOutput(
            index=st.index, text=text, token_ids=ids,
            cumulative_logprob=st.cumulative_logprob if want_lp else None,
            logprobs=lps if want_lp else None,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason, prediction=st.prediction,
        )

    def _make_output(self, parent: ParentState) -> RequestOutput | PoolingRequestOutput | None:
        finished = parent.finished
        first = parent.children[0]
        if first.pooling_output is not None:
            return PoolingRequestOutput(parent.request_id, PoolingOutput(first.pooling_output), first.prompt_token_ids,
                                        first.num_cached_tokens, finished, first.prompt)
        if parent.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        children = parent.children
        if finished and parent.rank_by_logprob:
            children = sorted(children, key=lambda c: -c.cumulative_logprob)[: parent.n]
        delta = parent.kind == RequestOutputKind.DELTA
        if delta:
            children = [c for c in children if not c.sent_finish]
            for c in children:
                c.sent_finish = c.finish_reason is not None
        outs = [self._completion(c, delta) for c in children]
        if delta and not outs and not finished:
            return None
        if finished and parent.rank_by_logprob:
            for i, o in enumerate(outs):
                o.index = i
        prompt_logprobs = first.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # a delta stream carries the prompt's logprobs once, in the first output that has them
            prompt_logprobs = None if first.sent_prompt_logprobs else prompt_logprobs
            first.sent_prompt_logprobs = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outs,
            finished=finished,
            num_cached_tokens=first.num_cached_tokens,
            lora_request=parent.lora_request,
        )
