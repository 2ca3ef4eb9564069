"""The scheduler's view of the runner's encoder-output cache, and the per-step encoder budget (vLLM v1's
``EncoderCacheManager`` and ``max_num_encoder_input_tokens``).

An item's encoder output (an image's ``length`` embeddings) is computed once and kept in the runner under
the item's content hash until evicted, so a prompt prefilled in several chunks, a preempted request that
comes back, and another request with the same image all reuse it. This class decides what the runner
holds: it counts each entry's size in placeholder tokens against ``cache_size``, tracks which requests
reference it, and evicts only unreferenced entries (least recently released first), telling the runner
through ``SchedulerOutput.free_encoder_mm_hashes``. A request releases an item's entry once a step computes
past its placeholders, and all of them when it finishes, is aborted or is preempted (``release``); entries
stay until space is needed. The runner applies evictions before the next step's encoder runs, after the
step that read them, so an entry is never dropped under a step that uses it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.scheduler.request import Request


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_used = 0
        # identifier -> its size (placeholder tokens), every entry the runner holds or will hold after this step
        self._sizes: dict[str, int] = {}
        # identifier -> ids of the live requests that reference it
        self._refs: dict[str, set[str]] = {}
        # unreferenced entries, evicted oldest first
        self._freeable: OrderedDict[str, int] = OrderedDict()
        self._to_free: list[str] = []

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._sizes

    def reference(self, request: Request, identifier: str) -> None:
        """``request`` reads the cached entry ``identifier`` (it must not be evicted while it does)."""
        self._refs.setdefault(identifier, set()).add(request.request_id)
        self._freeable.pop(identifier, None)

    def can_allocate(self, size: int) -> bool:
        """Room for a new entry of ``size``, counting what evicting unreferenced entries frees; an empty cache
        takes any item (one larger than the whole cache still runs, alone)."""
        free = self.cache_size - self.num_used + sum(self._freeable.values())
        return size <= free or (self.num_used - sum(self._freeable.values()) == 0)

    def allocate(self, request: Request, identifier: str, size: int) -> None:
        """A new entry the runner computes this step, evicting unreferenced ones to make room."""
        while self.num_used + size > self.cache_size and self._freeable:
            old, old_size = self._freeable.popitem(last=False)
            self._drop(old, old_size)
        self._sizes[identifier] = size
        self.num_used += size
        self.reference(request, identifier)

    def discard(self, identifier: str) -> None:
        """Forget an entry allocated this step whose encoding was withdrawn (never computed)."""
        size = self._sizes.pop(identifier, None)
        if size is not None:
            self.num_used -= size
            self._refs.pop(identifier, None)
            self._freeable.pop(identifier, None)

    def release(self, request: Request, up_to: int | None = None) -> None:
        """``request`` no longer reads its entries (finished, aborted or preempted): they become evictable.
        ``up_to``: only the entries of items whose placeholders all lie before that position (computed:
        the request never reads them again unless it is preempted and recomputes)."""
        for feature in request.mm_features:
            if up_to is not None and feature.placeholder.end > up_to:
                continue
            refs = self._refs.get(feature.identifier)
            if refs is None:
                continue
            refs.discard(request.request_id)
            if not refs and feature.identifier in self._sizes:
                del self._refs[feature.identifier]
                self._freeable[feature.identifier] = self._sizes[feature.identifier]

    def num_references(self, identifier: str) -> int:
        return len(self._refs.get(identifier, ()))

    def take_freed(self) -> list[str]:
        """The entries evicted since the last step (the runner drops them before encoding)."""
        freed, self._to_free = self._to_free, []
        return freed

    def _drop(self, identifier: str, size: int) -> None:
        del self._sizes[identifier]
        self._refs.pop(identifier, None)
        self.num_used -= size
        self._to_free.append(identifier)
