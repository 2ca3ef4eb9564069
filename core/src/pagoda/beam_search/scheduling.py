"""Beam search as the scheduler sees it: one component called at a few named points.

The scheduler stays a plain token-budget loop and calls its ``beam_search``
component at these points only:

* intake: ``add`` / ``abort`` (a group's id is not a scheduler request id);
* admission: ``reserved_rows`` (rows held back so an admitted group can grow to
  its width), ``admissible`` (a new group needs ``W`` rows at once; a beam of an
  admitted group may pass a blocked queue head) and ``on_admitted``;
* block shortage at admission: ``preempt_idle`` frees a beam that only waits
  for its siblings;
* new rows: ``runner_fields`` (a beam row reports candidates instead of sampling);
* after a step: ``report`` for each beam row's candidates, then ``advance``
  (selection, forks, drops, and the finished groups' outputs).

Until the first beam search arrives the scheduler holds ``NO_BEAM_SEARCH``,
whose hooks are constant answers, so plain requests pay one attribute call per
admission and per step, never per running request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagoda.beam_search.group import BeamGroup
from pagoda.engine.messages import EngineCoreOutput
from pagoda.scheduler.output import BeamCandidates
from pagoda.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagoda.scheduler.scheduler import Scheduler


class NoBeamSearch:
    """The scheduler's component while no beam search has arrived: every hook is a constant."""

    def abort(self, group_ids: Iterable[str]) -> list[str]:
        return list(group_ids)

    def reserved_rows(self) -> int:
        return 0

    def admissible(self, head: Request, free_rows: int, waiting: Iterable[Request]) -> Request | None:
        return head if free_rows >= 1 else None

    def on_admitted(self, req: Request) -> None:
        return None

    def preempt_idle(self) -> bool:
        return False

    def runner_fields(self, req: Request) -> BeamCandidates | None:
        return None

    def report(self, req: Request, candidates: dict[str, tuple[list[int], list[float]]] | None) -> None:
        raise AssertionError(f"{req.request_id!r} is not a beam but was reported as one")

    def advance(self) -> list[EngineCoreOutput]:
        return []


NO_BEAM_SEARCH = NoBeamSearch()


class BeamSearchScheduling:
    """Runs every beam search group of one scheduler: live beams are its ordinary requests."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.groups: dict[str, BeamGroup] = {}
        # groups whose every live beam reported candidates in the step being applied
        self._ready: dict[str, BeamGroup] = {}

    # -- intake ---------------------------------------------------------------------
    def add(self, group: BeamGroup, root: Request) -> None:
        """Start a beam search: ``root`` (the prompt) is its first beam; the group forks it as it goes."""
        s = self.scheduler
        if group.group_id in self.groups or group.group_id in s.requests:
            raise ValueError(f"request id {group.group_id!r} is already in use")
        if group.beam_width > s.max_num_seqs:
            raise ValueError(
                f"beam_width={group.beam_width} exceeds max_num_seqs={s.max_num_seqs}: all beams of a prompt run together"
            )
        root.beam_group = group
        group.add_beam(root.request_id)
        self.groups[group.group_id] = group
        s.add_request(root)

    def abort(self, ids: Iterable[str]) -> list[str]:
        """Abort the groups among ``ids``; returns the ids that are not groups."""
        rest: list[str] = []
        for gid in ids:
            group = self.groups.pop(gid, None)
            if group is None:
                rest.append(gid)
                continue
            self._ready.pop(gid, None)
            self.scheduler.finish_requests(list(group.beam_ids), RequestStatus.FINISHED_ABORTED)
        return rest

    # -- admission ----------------------------------------------------------------
    def reserved_rows(self) -> int:
        """Rows held back for every admitted group to grow to its width."""
        reserved = 0
        requests = self.scheduler.requests
        for group in self.groups.values():
            if group.admitted:
                running = sum(1 for b in group.beam_ids if requests[b].status == RequestStatus.RUNNING)
                reserved += group.beam_width - running
        return reserved

    def admissible(self, head: Request, free_rows: int, waiting: Iterable[Request]) -> Request | None:
        """The request to admit next: the queue head if it fits, else a beam of an admitted group.

        A new group needs all its rows at once; beams of admitted groups use
        rows already reserved for them, so they pass a blocked head and let
        their groups finish.
        """
        group = head.beam_group
        needed = 1 if group is None else (0 if group.admitted else group.beam_width)
        if free_rows >= needed:
            return head
        return next((r for r in waiting if r.beam_group is not None and r.beam_group.admitted), None)

    def on_admitted(self, req: Request) -> None:
        if req.beam_group is not None:
            req.beam_group.admitted = True

    def preempt_idle(self) -> bool:
        """Free the blocks of a beam that only waits for its siblings' candidates.

        Otherwise beams holding blocks while they wait could starve the sibling
        that would let them go on. Its candidates stay valid (its tokens do not
        change); it goes to the back of the queue and is recomputed later.
        """
        s = self.scheduler
        for req in reversed(s.running):
            if req.beam_group is not None and req.num_computed_tokens >= req.num_tokens:
                s.preempt_to_back(req)
                return True
        return False

    def runner_fields(self, req: Request) -> BeamCandidates | None:
        """What the runner returns for a beam row instead of sampling; None for a sampling row."""
        group = req.beam_group
        return BeamCandidates(group.num_candidates, group.temperature) if group is not None else None

    # -- results --------------------------------------------------------------------
    def report(self, req: Request, candidates: dict[str, tuple[list[int], list[float]]] | None) -> None:
        """Record a beam row's candidates (none: a prefill chunk short of the prompt end)."""
        rid = req.request_id
        if candidates is None or rid not in candidates:
            return
        group = req.beam_group
        group.candidates[rid] = candidates[rid]
        if group.ready():
            self._ready[group.group_id] = group

    def advance(self) -> list[EngineCoreOutput]:
        """Apply the selection of every group whose beams all reported; returns the finished groups."""
        if not self._ready:
            return []
        ready, self._ready = self._ready, {}
        finished: list[EngineCoreOutput] = []
        for group in ready.values():
            out = self._advance(group)
            if out is not None:
                finished.append(out)
        return finished

    def _advance(self, group: BeamGroup) -> EngineCoreOutput | None:
        """Apply one selection: fork beams chosen more than once, drop the unchosen, append tokens."""
        s = self.scheduler
        beams = {bid: s.requests[bid] for bid in group.beam_ids}
        selection = group.select({bid: r.output_token_ids for bid, r in beams.items()})
        if selection.done:
            self.abort([group.group_id])
            best = group.result()
            reason = best[0].finish_reason if best else "length"
            return EngineCoreOutput(req_id=group.group_id, new_token_ids=[], finish_reason=reason, beam_sequences=best)
        # Forks first: a child copies its parent's tokens before the parent takes its own next token.
        used: set[str] = set()
        assignments: list[tuple[Request, int, float]] = []
        for c in selection.running:
            parent = beams[c.beam_id]
            if c.beam_id not in used:
                used.add(c.beam_id)
                assignments.append((parent, c.token_id, c.logprob))
                continue
            child = s.fork_request(parent, group.new_beam_id())
            group.add_beam(child.request_id, parent.request_id)
            assignments.append((child, c.token_id, c.logprob))
        for bid in [b for b in beams if b not in used]:
            group.drop_beam(bid)
            s.finish_requests([bid], RequestStatus.FINISHED_ABORTED)
        order = {r.request_id: k for k, (r, _, _) in enumerate(assignments)}
        for beam, token, logprob in assignments:
            group.cum_logprobs[beam.request_id] += logprob
            group.token_logprobs[beam.request_id].append(logprob)
            s.append_external_token(beam, token)
        group.beam_ids.sort(key=order.__getitem__)
        return None

