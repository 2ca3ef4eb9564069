"""``speculative_config`` (vLLM's ``SpeculativeConfig``): which proposer drafts tokens and how many.

Built from the dict ``LLM(..., speculative_config={...})`` and ``--speculative-config '<json>'`` take. A key
vLLM accepts that pagoda does not implement is refused by name, as is a method whose proposer is not written
yet: neither is ever accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Methods vLLM knows whose proposers pagoda has not implemented (they need a second model or the target's
# hidden states in the runner; the proposer interface here sees token ids only).
_NOT_IMPLEMENTED_METHODS = {
    "draft_model": "a draft model proposer",
    "eagle": "an EAGLE head proposer",
    "eagle3": "an EAGLE-3 head proposer",
    "mlp_speculator": "an MLP speculator proposer",
    "medusa": "a Medusa head proposer",
}
# vLLM SpeculativeConfig keys pagoda does not implement: refused by name.
_NOT_IMPLEMENTED_KEYS = (
    "quantization", "max_model_len", "revision", "code_revision", "speculative_token_tree",
    "disable_padded_drafter_batch", "draft_load_config", "target_model_config", "target_parallel_config",
    "draft_model_config", "draft_parallel_config", "parallel_drafting", "enforce_eager",
)


class SpeculativeConfig(BaseModel):
    """vLLM's ``SpeculativeConfig`` keys that pagoda runs."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    method: str | None = Field(None, description="The proposer: a pagoda.spec_proposers plugin's name (ngram, "
                               "suffix). Inferred from 'model' when only that is given, as vLLM does.")
    num_speculative_tokens: int | None = Field(None, ge=1, description="Most draft tokens proposed per request "
                                               "and step (verified together in one forward).")
    model: str | None = Field(None, description="The draft model (method draft_model / eagle): not implemented yet.")
    draft_tensor_parallel_size: int | None = Field(None, ge=1, description="The draft model's tensor parallel size "
                                                   "(a draft model proposer only).")
    prompt_lookup_min: int | None = Field(None, ge=1, description="ngram: shortest n-gram matched.")
    prompt_lookup_max: int | None = Field(None, ge=1, description="ngram: longest n-gram matched (tried first).")
    disable_by_batch_size: int | None = Field(None, ge=2, description="Propose nothing in a step when more than "
                                              "this many requests are running (speculation pays at small batches).")
    suffix_decoding_max_tree_depth: int = Field(24, ge=1, description="suffix: longest suffix (and draft) kept.")
    suffix_decoding_max_cached_requests: int = Field(10000, ge=0, description="suffix: finished requests whose "
                                                     "outputs the global tree keeps (0: the request's own tokens only).")
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0, description="suffix: draft at most this many tokens "
                                                   "per token of the matched suffix.")
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1, description="suffix: stop a draft at a token "
                                                  "whose frequency in the tree is below this.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        given = [key for key in _NOT_IMPLEMENTED_KEYS if data.get(key) is not None]
        if given:
            raise ValueError(f"speculative_config key(s) {given} are not implemented by pagoda")
        unknown = sorted(set(data) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: {sorted(cls.model_fields)}")
        return data

    @model_validator(mode="after")
    def _resolve(self) -> SpeculativeConfig:
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config needs 'method' (ngram, suffix, ...) or a draft 'model'")
            name = self.model.lower()
            method = "ngram" if name in ("ngram", "[ngram]") else "eagle3" if "eagle3" in name else \
                "eagle" if "eagle" in name else "draft_model"
            object.__setattr__(self, "method", method)
        if method in _NOT_IMPLEMENTED_METHODS:
            raise ValueError(f"speculative_config method {method!r} ({_NOT_IMPLEMENTED_METHODS[method]}) is not "
                             "implemented by pagoda yet; use method 'ngram' or 'suffix'")
        if self.model is not None and method != "draft_model":
            if self.model.lower() not in ("ngram", "[ngram]"):
                raise ValueError(f"speculative_config 'model' is for a draft model; method {method!r} takes none")
        if self.draft_tensor_parallel_size is not None:
            raise ValueError("speculative_config 'draft_tensor_parallel_size' applies to a draft model, "
                             f"which method {method!r} has none of")
        if method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: both 5 when neither is given, else the one given for both
            lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
            assert lo is not None and hi is not None
            if lo > hi:
                raise ValueError(f"prompt_lookup_min={lo} is larger than prompt_lookup_max={hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            if self.num_speculative_tokens is None:
                raise ValueError("speculative_config method 'ngram' needs num_speculative_tokens")
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError(f"prompt_lookup_min / prompt_lookup_max apply to method 'ngram', not {method!r}")
        if method == "suffix" and self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth)
        if self.num_speculative_tokens is None:
            raise ValueError(f"speculative_config method {method!r} needs num_speculative_tokens")
        return self

    @property
    def k(self) -> int:
        assert self.num_speculative_tokens is not None  # set by _resolve
        return self.num_speculative_tokens
