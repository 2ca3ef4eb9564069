"""Continuous batching under a token budget, with chunked prefill and preemption.

There are no separate prefill and decode phases: each request has
``num_computed_tokens`` and ``num_tokens`` and a step hands out tokens so the
first catches up with the second. Running requests go first (a decode takes one
token, an unfinished prefill a chunk); when blocks run out the lowest-priority
(then newest) running request is preempted by freeing its blocks so it is
recomputed later; waiting requests are admitted only in a step that preempted
nothing.

Beam search lives in one component (``pagoda.beam_search.scheduling``) that
this loop calls at named points: admission, idle-beam preemption, new rows and
after each update. Until a beam search arrives it is a no-op object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagoda.beam_search.group import BeamGroup
from pagoda.beam_search.scheduling import NO_BEAM_SEARCH, BeamSearchScheduling, NoBeamSearch
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.engine.messages import EngineCoreOutput
from pagoda.scheduler.encoder_cache import EncoderCacheManager
from pagoda.scheduler.output import (
    CachedRequestData,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagoda.scheduler.queue import FcfsQueue, PriorityQueue
from pagoda.scheduler.request import FINISH_REASONS, Request, RequestStatus
from pagoda.structured_output.backend import StructuredOutputError
from pagoda.spec_decode.prediction import PREDICTION_NUM_SPECULATIVE_TOKENS, PredictionProposer
from pagoda.spec_decode.scheduling import SpecDecoding
from pagoda.structured_output.manager import RequestStructuredOutput, StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _StepBuilder:
    """The step being scheduled: what is left of its token budget and what it holds so far."""

    budget: int
    max_reqs: int
    # multimodal: what is left of the step's encoder budget (placeholder tokens), and the items each request
    # encodes this step (indices into its mm_features)
    encoder_budget: int = 0
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    # speculative decoding: the drafts scheduled with each request's last token
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    def has_room(self) -> bool:
        return self.budget > 0 and len(self.num_scheduled) < self.max_reqs

    def take(self, rid: str, num_tokens: int) -> None:
        self.num_scheduled[rid] = num_tokens
        self.budget -= num_tokens


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        structured_output_manager: StructuredOutputManager | None = None,
        use_pp: bool = False,
        max_loras: int | None = None,
        spec_decoding: SpecDecoding | None = None,
        max_num_encoder_input_tokens: int | None = None,
        encoder_cache_size: int | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        # multimodal: the encoder budget of one step beside the token budget, and the runner's encoder cache
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens or max_num_batched_tokens
        self.encoder_cache = EncoderCacheManager(encoder_cache_size or self.max_num_encoder_input_tokens)
        # speculative decoding (None: off); its drafts are scheduled with each request's next decode
        self.spec = spec_decoding
        self.structured_output_manager = structured_output_manager
        # Outputs of requests finished outside a step (a constraint that failed to compile).
        self._pending_outputs: list[EngineCoreOutput] = []
        # Constrained requests whose grammar is still compiling: they join the queue once it is ready, so
        # they never hold up the requests behind them.
        self._compiling: list[Request] = []
        # Ids of the live constrained requests: the per-step bitmask pass is skipped while there are none.
        self._constrained: set[str] = set()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting: FcfsQueue | PriorityQueue = PriorityQueue() if policy == "priority" else FcfsQueue()
        self.running: list[Request] = []
        # ids the runner must forget at the next step
        self._finished_ids: set[str] = set()
        # requests the runner has state for
        self._in_runner: set[str] = set()
        self.num_preemptions = 0
        # Installed by the first beam search; its beams are ordinary requests in ``requests``.
        self.beam_search: NoBeamSearch | BeamSearchScheduling = NO_BEAM_SEARCH
        # Pipeline parallelism (vLLM's use_pp): only the last stage samples, so each step tells the
        # stages before it the output tokens it schedules (CachedRequestData.scheduled_output_token_ids).
        self.use_pp = use_pp
        # Batches scheduled whose output is not applied yet (several with a batch queue): request id ->
        # how many hold it. Such a request is not scheduled again: it waits for its sampled token, and a
        # preempted one must not come back before the stale results of its old run are dropped.
        self._in_flight: dict[str, int] = {}
        # How many batches the engine keeps in flight (its batch queue); above 1, a step takes at most
        # its share of the live requests, so a burst does not fill one batch and leave the others empty.
        self.num_micro_batches = 1
        # enable_lora: the most distinct adapters among the running requests (vLLM's max_loras rule)
        self.max_loras = max_loras

    # -- intake ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.spec_proposer is not None and self.spec is None:
            # a prediction without --speculative-config: the verify path runs for requests with their own
            # proposer only (prediction-only mode)
            if self.use_pp:
                raise ValueError("prediction (predicted outputs) needs speculative decoding, which does not run "
                                 "with pipeline parallelism")
            self.spec = SpecDecoding(None, None, self.max_model_len, k=PREDICTION_NUM_SPECULATIVE_TOKENS)
        params = request.sampling_params
        constraint = params.structured_outputs if params is not None else None
        if constraint is not None:
            if self.structured_output_manager is None:
                raise ValueError("this engine has no structured outputs manager; structured_outputs is not supported")
            # compiles in the background; the request waits in the queue until its grammar is ready
            request.structured_output = self.structured_output_manager.init_request(constraint,
                                                                                    request.prompt_token_ids)
            self._constrained.add(request.request_id)
        self.requests[request.request_id] = request
        if request.structured_output is not None and not request.structured_output.is_ready:
            self._compiling.append(request)
        else:
            self.waiting.add(request)

    def add_beam_search(self, group: BeamGroup, root: Request) -> None:
        """Start a beam search; ``root`` (the prompt) is its first beam."""
        if self.spec is not None and self.spec.proposer is not None:
            raise ValueError("beam search does not run with speculative decoding (speculative_config), as in vLLM")
        beams = self.beam_search
        if not isinstance(beams, BeamSearchScheduling):
            beams = self.beam_search = BeamSearchScheduling(self)
        beams.add(group, root)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests and beam search groups by id, wherever they are."""
        self.finish_requests(self.beam_search.abort(request_ids), RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests wherever they are; frees their blocks."""
        done: list[Request] = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req in self._compiling:
                self._compiling.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        if self.spec is not None:
            self.spec.on_finished(req)
        self.kv.free(req)
        self.encoder_cache.release(req)
        self.requests.pop(req.request_id, None)
        self._constrained.discard(req.request_id)
        if req.structured_output is not None and self.structured_output_manager is not None:
            # its grammar may leave the cache now; a compile nobody waits for is cancelled
            self.structured_output_manager.release(req.structured_output)
        if req.request_id in self._in_runner:
            self._finished_ids.add(req.request_id)
            self._in_runner.discard(req.request_id)

    # -- scheduling -----------------------------------------------------------
    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        self.encoder_cache.release(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        if self.spec is not None:
            self.spec.on_preempted(victim)
        if victim.request_id in self._in_runner:
            self._finished_ids.add(victim.request_id)
            self._in_runner.discard(victim.request_id)
        self.waiting.prepend(victim)

    def preempt_to_back(self, req: Request) -> None:
        """Preempt a running request to the back of the queue (not the front: it waits on others)."""
        self._preempt(req)
        self.waiting.remove(req)
        self.waiting.add(req)

    def fork_request(self, parent: Request, child_id: str) -> Request:
        """A new request holding ``parent``'s tokens and progress; it shares the parent's KV blocks.

        A running parent's child runs too and reaches the runner whole at its
        next schedule; a preempted parent's child waits to be recomputed.
        """
        child = parent.fork(child_id)
        self.requests[child_id] = child
        if parent.status == RequestStatus.RUNNING:
            self.kv.fork(parent.request_id, child_id)
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            self.waiting.prepend(child)
        return child

    def append_external_token(self, req: Request, token: int) -> None:
        """Append a token chosen outside the runner; a runner that holds the request is told next step."""
        req.append_output_token_ids([token])
        if req.request_id in self._in_runner:
            req.unsent_token_ids.append(token)

    def schedule(self) -> SchedulerOutput:
        """running requests first (preempting when blocks run out) -> waiting ones, if nothing was preempted
        -> copy-on-write -> the step's output; the scheduled requests' progress advances at once."""
        self._admit_compiled()
        step = _StepBuilder(self.max_num_batched_tokens, self._micro_batch_size(),
                            encoder_budget=self.max_num_encoder_input_tokens)
        preempted = self._schedule_running(step)
        if not preempted:
            self._schedule_waiting(step)
        copies, replaced = self.kv.take_copy_on_write()
        if replaced:
            # copy-on-write swapped table entries in place: send those tables whole
            for diff in step.cached:
                if diff.req_id in replaced:
                    diff.new_block_ids = self.kv.get_block_ids(diff.req_id)
                    diff.replace_block_ids = True
        out = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - step.budget,
            finished_req_ids=self._finished_ids,
            block_copies=copies,
            scheduled_spec_decode_tokens=step.spec_tokens,
            scheduled_encoder_inputs=step.encoder_inputs,
            free_encoder_mm_hashes=self.encoder_cache.take_freed(),
        )
        self._finished_ids = set()
        self._fill_grammar_bitmask(out)
        # Advance now: the next schedule() may run before this step's output is
        # applied (pipelined engines) and must not hand out the same tokens again.
        for rid, n in step.num_scheduled.items():
            req = self.requests[rid]
            req.num_computed_tokens += n
            self._in_flight[rid] = self._in_flight.get(rid, 0) + 1
            if req.mm_features:
                # items this step computes past are read for the last time by it
                self.encoder_cache.release(req, up_to=req.num_computed_tokens)
        return out

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is ready join the queue."""
        if self._compiling:
            ready = [r for r in self._compiling if r.structured_output.is_ready]
            for r in ready:
                self._compiling.remove(r)
                self.waiting.add(r)
            manager = self.structured_output_manager
            if manager is not None and manager.compile_timeout:
                now = time.monotonic()
                for r in [r for r in self._compiling if manager.timed_out(r.structured_output, now)]:
                    self._compiling.remove(r)
                    self.waiting.add(r)  # _fail_constraint takes it from there
                    self._fail_constraint(r, StructuredOutputError(
                        f"the structured output constraint did not compile within {manager.compile_timeout:g} s, "
                        "this server's limit (structured_outputs_config compile_timeout)"))

    def _schedule_running(self, step: _StepBuilder) -> bool:
        """A decode token or the next prefill chunk for each running request; -> whether any was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and step.has_room():
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
            encode: list[int] = []
            if req.mm_features and num_new > 0:
                num_new, encode = self._encoder_inputs(req, req.num_computed_tokens, num_new, step)
            if num_new <= 0 or req.request_id in self._in_flight:
                i += 1
                continue
            drafts = req.spec_token_ids
            if drafts:
                # drafts follow the request's last token only, and take what is left of the budget
                req.spec_token_ids = []
                drafts = drafts[: step.budget - num_new] if num_new == 1 else []
                num_new += len(drafts)
            new_blocks: list[int] | None = None
            while True:
                new_blocks = self.kv.allocate_slots(req, num_new)
                if new_blocks is not None:
                    break
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    # (priority policy) a request already scheduled this step: take its step back
                    i -= 1
                    self._unschedule(victim.request_id, step)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if new_blocks is None:
                # ``req`` itself was preempted; the list shifted under ``i``
                continue
            step.take(req.request_id, num_new)
            if req.mm_features:
                self._commit_encoder_inputs(req, req.num_computed_tokens, num_new, encode, step)
            if drafts:
                step.spec_tokens[req.request_id] = drafts
            if req.request_id not in self._in_runner:
                # forked since the last step: the runner gets it whole
                self._in_runner.add(req.request_id)
                req.unsent_token_ids = []
                step.new_reqs.append(self._new_request_data(req))
            else:
                diff = CachedRequestData(req.request_id, new_blocks, req.num_computed_tokens,
                                         new_token_ids=req.unsent_token_ids)
                req.unsent_token_ids = []
                if self.use_pp:
                    first = max(req.num_computed_tokens, req.num_prompt_tokens)
                    diff.scheduled_output_token_ids = req.all_token_ids[first:req.num_computed_tokens + num_new]
                step.cached.append(diff)
            i += 1
        return preempted

    def running_loras(self) -> set[int]:
        """The adapters (lora_int_id) of the running requests."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def lora_adapter_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(adapter name -> running requests, adapter name -> waiting requests): the lora_requests_info gauge."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for req in self.running:
            if req.lora_request is not None:
                running[req.lora_request.lora_name] = running.get(req.lora_request.lora_name, 0) + 1
        for req in [*self.waiting, *self._compiling]:
            if req.lora_request is not None:
                waiting[req.lora_request.lora_name] = waiting.get(req.lora_request.lora_name, 0) + 1
        return running, waiting

    def uses_lora(self, lora_int_id: int) -> bool:
        """Whether a live request (running or waiting) runs with this adapter."""
        return any(r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id
                   for r in self.requests.values())

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit waiting requests in policy order (after a prefix-cache lookup) while budget and rows allow;
        a request whose adapter would exceed ``max_loras`` distinct adapters waits, the ones behind it do not."""
        skipped: list[Request] = []
        try:
            self._admit_waiting(step, skipped)
        finally:
            for req in reversed(skipped):
                self.waiting.prepend(req)

    def _lora_blocked(self, req: Request, loras: set[int] | None) -> bool:
        return (loras is not None and req.lora_request is not None and self.max_loras is not None
                and req.lora_request.lora_int_id not in loras and len(loras) >= self.max_loras)

    def _admit_waiting(self, step: _StepBuilder, skipped: list[Request]) -> None:
        beams = self.beam_search
        now = time.time()
        loras = self.running_loras() if self.max_loras is not None else None
        while len(self.waiting) and step.has_room():
            free_rows = self.max_num_seqs - len(self.running) - beams.reserved_rows()
            admissible = beams.admissible(self.waiting.peek(), free_rows, self.waiting)
            if admissible is None or len(self.running) >= self.max_num_seqs:
                break
            if admissible.request_id in self._in_flight:
                break  # preempted (or its id reused) while a batch holding it runs: after that batch
            req = admissible
            if self._lora_blocked(req, loras):
                if req is not self.waiting.peek():
                    break  # (a beam the group picked) it waits for a slot as the queue's head would
                skipped.append(self.waiting.pop())
                continue
            grammar = req.structured_output
            if grammar is not None and grammar.error is not None:
                self._fail_constraint(req, grammar.error)
                continue
            computed_ids: list[int] = []
            num_computed = 0
            # cached tokens have no logits, so a request still owing prompt logprobs computes them all
            if req.num_computed_tokens == 0 and not req.wants_prompt_logprobs:
                computed_ids, num_computed = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_computed
            if num_new > step.budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = step.budget
            encode: list[int] = []
            if req.mm_features:
                wanted = num_new
                num_new, encode = self._encoder_inputs(req, num_computed, num_new, step)
                if num_new <= 0 or (num_new < wanted and not self.enable_chunked_prefill):
                    break  # its next image waits for encoder budget or cache space
            new_blocks = self.kv.allocate_slots(req, num_new, computed_ids, num_computed)
            if new_blocks is None:
                if not step.num_scheduled and beams.preempt_idle():
                    continue
                break
            if req is self.waiting.peek():
                self.waiting.pop()
            else:
                self.waiting.remove(req)
            beams.on_admitted(req)
            req.unsent_token_ids = []
            req.num_computed_tokens = num_computed
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if loras is not None and req.lora_request is not None:
                loras.add(req.lora_request.lora_int_id)
            self._in_runner.add(req.request_id)
            step.take(req.request_id, num_new)
            if req.mm_features:
                self._commit_encoder_inputs(req, num_computed, num_new, encode, step)
            step.new_reqs.append(self._new_request_data(req))

    def _micro_batch_size(self) -> int:
        """Most requests one step takes: all of them, or with several batches in flight an even share."""
        if self.num_micro_batches <= 1:
            return self.max_num_seqs
        live = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max(1, -(-live // self.num_micro_batches))

    def discard_batch(self, sched_out: SchedulerOutput) -> None:
        """A scheduled batch whose output will never be applied (its step failed): its requests are free again."""
        for rid in sched_out.num_scheduled_tokens:
            left = self._in_flight.get(rid, 0) - 1
            if left > 0:
                self._in_flight[rid] = left
            else:
                self._in_flight.pop(rid, None)

    def in_flight_request_ids(self) -> list[str]:
        """Live requests held by a batch whose output is not applied yet (running or preempted)."""
        return [rid for rid in self._in_flight if rid in self.requests]

    def _fill_grammar_bitmask(self, out: SchedulerOutput) -> None:
        """One bitmask for the constrained requests that sample this step (their prompt is done); a request
        verifying drafts has a row for each of its positions, consecutive."""
        manager = self.structured_output_manager
        if manager is None or not self._constrained:
            return
        ids: dict[str, int] = {}
        constrained: list[RequestStructuredOutput] = []
        drafts: list[list[int]] = []
        num_rows = 0
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            # still reasoning: its tokens are free until the reasoning parser sees the end of it
            if req.structured_output is None or req.beam_group is not None or not req.structured_output.reasoning_ended:
                continue
            if req.num_computed_tokens + n >= req.num_tokens:
                draft = out.scheduled_spec_decode_tokens.get(rid, [])
                ids[rid] = num_rows
                num_rows += 1 + len(draft)
                constrained.append(req.structured_output)
                drafts.append(draft)
        if constrained:
            bitmask = (manager.grammar_bitmask_with_drafts(constrained, drafts) if any(drafts)
                       else manager.grammar_bitmask(constrained))
            out.grammar = GrammarBitmask(ids, bitmask)

    def _fail_constraint(self, req: Request, error: BaseException) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._free(req)
        logger.warning("request %s: its structured output constraint did not compile: %s", req.request_id, error)
        self._pending_outputs.append(EngineCoreOutput(req_id=req.request_id, new_token_ids=[],
                                                      finish_reason=FINISH_REASONS[req.status],
                                                      stop_reason=str(error)))

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests finished outside a step (reported with the next step's)."""
        pending, self._pending_outputs = self._pending_outputs, []
        return pending

    def _advance_grammar(self, req: Request, token: int) -> bool:
        """Advance the request's matcher; True when that finishes the request (completed or rejected)."""
        matcher = req.structured_output.matcher
        if not matcher.accept_tokens([token]):
            # the bitmask allowed only tokens the matcher accepts: this is a backend bug, not the model's
            logger.error("request %s: the grammar rejected sampled token %d", req.request_id, token)
            req.status = RequestStatus.FINISHED_ERROR
            return True
        if matcher.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def _unschedule(self, rid: str, step: _StepBuilder) -> None:
        """Withdraw ``rid`` from the step being built; its tokens go back to the budget."""
        step.cached[:] = [diff for diff in step.cached if diff.req_id != rid]
        for j, new in enumerate(step.new_reqs):
            if new.req_id == rid:
                # the runner never saw it: nothing for it to forget
                del step.new_reqs[j]
                self._in_runner.discard(rid)
                break
        step.spec_tokens.pop(rid, None)
        step.budget += step.num_scheduled.pop(rid, 0)
        self._withdraw_encoder_inputs(rid, step)

    # -- multimodal encoder inputs -----------------------------------------------
    def _encoder_inputs(self, req: Request, start: int, num_new: int, step: _StepBuilder) -> tuple[int, list[int]]:
        """-> (the tokens ``req`` may compute from ``start``, the items it must encode for them).

        Every item whose placeholders overlap the chunk needs its encoder output: a cached one is read, the
        others are encoded this step, whole, if the encoder budget and the cache have room; otherwise the
        chunk stops before that item (0 tokens: the request waits). A chunk may end inside an item's
        placeholders: the rest is read from the encoder cache next step. One item larger than the whole
        budget runs alone in a step.
        """
        end = start + num_new
        budget = step.encoder_budget
        chosen: list[int] = []
        chosen_ids: set[str] = set()
        planned = 0
        for i, feature in enumerate(req.mm_features):
            offset, length = feature.placeholder.offset, feature.placeholder.length
            if offset >= end:
                break
            if offset + length <= start or feature.identifier in self.encoder_cache or feature.identifier in chosen_ids:
                continue
            alone = not step.encoder_inputs and not chosen
            # the budget and the cache count encoder outputs, not placeholder tokens (Idefics3's span holds text)
            size = feature.num_embeds
            if (size > budget and not alone) or not self.encoder_cache.can_allocate(planned + size):
                return max(offset - start, 0), chosen
            chosen.append(i)
            chosen_ids.add(feature.identifier)
            budget -= size
            planned += size
        return num_new, chosen

    def _commit_encoder_inputs(self, req: Request, start: int, num_new: int, encode: list[int],
                               step: _StepBuilder) -> None:
        """The step takes ``req``'s chunk: its new items go into the encoder cache, its cached ones are read."""
        end = start + num_new
        for i, feature in enumerate(req.mm_features):
            offset, length = feature.placeholder.offset, feature.placeholder.length
            if offset >= end:
                break
            if offset + length <= start:
                continue
            if i in encode:
                self.encoder_cache.allocate(req, feature.identifier, feature.num_embeds)
                step.encoder_budget -= feature.num_embeds
            else:
                self.encoder_cache.reference(req, feature.identifier)
        if encode:
            step.encoder_inputs[req.request_id] = encode

    def _withdraw_encoder_inputs(self, rid: str, step: _StepBuilder) -> None:
        """A request taken back out of the step: the items it was to encode are not computed. One that another
        request of the step reads is encoded for that request instead; the others leave the cache."""
        req = self.requests.get(rid)
        encode = step.encoder_inputs.pop(rid, [])
        if req is None:
            return
        for i in encode:
            feature = req.mm_features[i]
            taker = next(((other, j) for other in step.num_scheduled if other != rid
                          for j, f in enumerate(self.requests[other].mm_features)
                          if f.identifier == feature.identifier), None)
            if taker is None:
                step.encoder_budget += feature.num_embeds
                self.encoder_cache.discard(feature.identifier)
            else:
                step.encoder_inputs.setdefault(taker[0], []).append(taker[1])

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData.from_request(req, self.kv.get_block_ids(req.request_id),
                                           self.beam_search.runner_fields(req))

    # -- results ----------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        self.discard_batch(sched_out)  # its requests may be scheduled again from here on
        outputs: list[EngineCoreOutput] = self.take_pending_outputs()
        now = time.time()
        prompt_logprobs = runner_out.prompt_logprobs or {}
        pooled = runner_out.pooler_output
        for idx, rid in enumerate(runner_out.req_ids):
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if req.pooling_params is not None:
                if pooled is None or pooled[idx] is None:
                    continue  # (never with chunked prefill off) the prompt is not all computed yet
                # prefill only: done after this step, and its blocks go back to the pool now
                req.status = RequestStatus.FINISHED_STOPPED
                outputs.append(EngineCoreOutput(req_id=rid, new_token_ids=[], finish_reason="stop",
                                                num_cached_tokens=max(req.num_cached_tokens, 0),
                                                first_scheduled_time=req.first_scheduled_time,
                                                pooling_output=pooled[idx]))
                self.running.remove(req)
                self._free(req)
                continue
            if rid in prompt_logprobs:
                self._collect_prompt_logprobs(req, *prompt_logprobs[rid])
            if req.beam_group is not None:
                # the group picks its beams' tokens once all of them reported
                self.beam_search.report(req, runner_out.beam_candidates)
                continue
            new_ids = runner_out.sampled_token_ids[idx]
            if not new_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            drafts = sched_out.scheduled_spec_decode_tokens.get(rid)
            if drafts:
                # the rejected drafts' positions are computed again: their KV slots are overwritten
                # next step, and no block key ever covers them (keys are made of appended tokens only)
                num_accepted = len(new_ids) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                assert self.spec is not None
                self.spec.record(req, len(drafts), num_accepted)
            accepted: list[int] = []
            for tok in new_ids:
                accepted.append(tok)
                req.append_output_token_ids([tok])
                if self._check_stop(req, tok):
                    break
                if req.structured_output is not None:
                    if not req.structured_output.reasoning_ended:
                        # the token that ends the reasoning is not the answer's: the grammar starts after it
                        assert self.structured_output_manager is not None
                        self.structured_output_manager.reasoning_ends_with(req.structured_output, req.all_token_ids,
                                                                           [tok])
                    elif self._advance_grammar(req, tok):
                        break
            out = EngineCoreOutput(req_id=rid, new_token_ids=accepted, num_cached_tokens=max(req.num_cached_tokens, 0))
            if isinstance(req.spec_proposer, PredictionProposer):
                out.prediction = req.spec_proposer.counts(req.all_token_ids, req.num_prompt_tokens)
            if req.first_token_time is None:
                req.first_token_time = now
                out.first_scheduled_time = req.first_scheduled_time
            if runner_out.logprobs is not None and rid in runner_out.logprobs:
                out.new_logprobs = runner_out.logprobs[rid][: len(accepted)]
            if runner_out.sampled_logprobs is not None and rid in runner_out.sampled_logprobs:
                out.new_sampled_logprobs = runner_out.sampled_logprobs[rid][: len(accepted)]
            if req.pending_prompt_logprobs:
                out.new_prompt_logprobs, req.pending_prompt_logprobs = req.pending_prompt_logprobs, []
            if req.is_finished:
                out.finish_reason = FINISH_REASONS[req.status]
                out.stop_reason = req.stop_reason
                self.running.remove(req)
                self._free(req)
            outputs.append(out)
        outputs.extend(self.beam_search.advance())
        if self.spec is not None:
            self._propose_drafts()
        return outputs

    def _propose_drafts(self) -> None:
        """Drafts for the running requests whose next step is a decode (constrained ones decode plainly)."""
        assert self.spec is not None
        ready = [r for r in self.running
                 if r.num_computed_tokens == r.num_tokens - 1 and r.request_id not in self._in_flight
                 and r.beam_group is None and self._may_draft(r.structured_output)]
        if not ready:
            return
        self.spec.propose(ready, len(self.running))
        for r in ready:
            if r.structured_output is not None and r.spec_token_ids:
                # only drafts the grammar allows: each gets a bitmask row, and a rejected one would be wasted
                r.spec_token_ids = StructuredOutputManager.valid_draft_prefix(r.structured_output, r.spec_token_ids)

    @staticmethod
    def _may_draft(grammar: RequestStructuredOutput | None) -> bool:
        """A constrained request drafts once its answer is constrained (not while it reasons: the grammar's
        start would fall inside a run sampled unmasked), with a matcher that can undo its drafts."""
        return grammar is None or (grammar.reasoning_ended and grammar.is_ready and grammar.error is None
                                   and type(grammar.matcher).supports_rollback)

    def _collect_prompt_logprobs(self, req: Request, first_index: int, entries: list[Any]) -> None:
        """Keep the entries not delivered yet (a recomputed prompt repeats earlier ones)."""
        skip = req.num_prompt_logprobs_sent - first_index
        if skip < len(entries):
            req.pending_prompt_logprobs.extend(entries[max(skip, 0):])
            req.num_prompt_logprobs_sent = first_index + len(entries)

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        assert params is not None  # only sampled requests reach here: pooling ones finish with their pooler output
        if req.num_output_tokens >= params.min_tokens:
            if req.eos_token_id is not None and token == req.eos_token_id and not params.ignore_eos:
                req.status = RequestStatus.FINISHED_STOPPED
                return True
            stop_ids = params.stop_token_ids
            if stop_ids and token in stop_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return True
        if (req.max_tokens is not None and req.num_output_tokens >= req.max_tokens) or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # -- introspection ----------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_finished_ids_pending(self) -> bool:
        return bool(self._finished_ids)
