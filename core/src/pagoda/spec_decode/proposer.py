"""The proposer interface: what a speculative decoding proposer sees of a request and what it returns.

A proposer runs in the engine core, after each step's tokens are appended: it drafts up to
``DraftRequest.max_num_tokens`` tokens per request from the request's token ids. The scheduler schedules
them with the request's next decode (their positions count against the step's token budget and take KV
slots), the runner verifies them in one forward and the rejection sampler accepts a prefix.

State across steps. ``token_ids`` is the request's live list (prompt + outputs, read-only): a proposer
that indexes it (a suffix tree) compares its length with what it has seen and reads only the new tail.
Rejected drafts never enter ``token_ids``; ``observe`` tells the proposer how many of its last drafts
were accepted. ``on_preempted`` (its KV or any device state is gone; its tokens are kept) and
``on_finished`` (forget it) follow the request's life.

A per-request proposer (e.g. one built from a request's own prediction) is a ``Proposer`` too: the
scheduler asks ``Request.spec_proposer`` instead of the engine's where a request carries one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from pagoda.spec_decode.config import SpeculativeConfig


@dataclass(slots=True)
class DraftRequest:
    """One request a proposer drafts for this step."""

    req_id: str
    token_ids: Sequence[int]  # prompt + outputs so far (the request's live list: do not modify)
    num_prompt_tokens: int
    max_num_tokens: int  # the most tokens it may propose (>= 1)


class Proposer(ABC):
    """Drafts tokens for a batch of requests. Subclasses are registered by plugins
    (hook ``pagoda_register_spec_proposers``) and built once per engine with its ``SpeculativeConfig``."""

    # the method name ``speculative_config={"method": ...}`` takes
    name: ClassVar[str]

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """-> for each request, its draft tokens (at most ``max_num_tokens``; empty: nothing to propose)."""

    def observe(self, req_id: str, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """How many of the request's last ``num_draft_tokens`` drafts the target accepted."""

    def on_preempted(self, req_id: str) -> None:
        """The request was preempted (its KV freed; it is recomputed later, with its tokens)."""

    def on_finished(self, req_id: str) -> None:
        """The request finished or was aborted: drop what is kept for it."""
