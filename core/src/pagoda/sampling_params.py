"""Per-request sampling settings, with vLLM's field names, defaults and checks.

``SamplingParams`` and ``BeamSearchParams`` are ``msgspec.Struct``s declared as
vLLM declares them (``omit_defaults=True, dict=True``): libraries written for
vLLM walk ``__struct_fields__`` to copy a request's settings (Outlines rebuilds
one with a constraint added), so the shape is part of the public interface.
Structs pickle (the engine core may live in another process) and compare by
field. Everything is validated once in ``__post_init__`` (which msgspec also
runs after decoding) and a bad value raises ``ValueError`` naming the field and
its allowed range.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from pagoda.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

# Below this temperature a request is greedy (argmax), as in vLLM.
_SAMPLING_EPS = 1e-5
# OpenAI clamps logit bias to this range; vLLM does the same.
_MAX_LOGIT_BIAS = 100.0

# (output_ids, logits) -> logits  or  (prompt_ids, output_ids, logits) -> logits
LogitsProcessor = Callable[..., Any]


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    # Every output carries all tokens generated so far.
    CUMULATIVE = 0
    # Every output carries only the tokens new since the last one.
    DELTA = 1
    # Only the final output is returned.
    FINAL_ONLY = 2


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def _field_error(name: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {requirement}, got {value!r}.")


class SamplingParams(msgspec.Struct, omit_defaults=True, dict=True):
    """How to sample the completion of one prompt (vLLM semantics)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k (vLLM accepts both; stored as 0).
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None = as many as fit in the context window (the engine decides).
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Number of top logprobs to return per sampled token (0 = only the sampled one).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    # A constraint on the output (JSON schema, regex, choice, grammar...), compiled by a backend plugin.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name; mapped onto structured_outputs.
    guided_decoding: GuidedDecodingParams | None = None

    # Derived state, struct fields under vLLM's names so a copy made field by field keeps it
    # (``__post_init__`` recomputes what derives from the public fields).
    output_text_buffer_length: int = 0
    _all_stop_token_ids: set[int] = msgspec.field(default_factory=set)
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs cannot change an argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            self._verify_greedy_sampling()
        # A union, not a reset: a copy of params the engine already saw keeps the model's EOS ids.
        self._all_stop_token_ids = set(self._all_stop_token_ids or ()) | set(self.stop_token_ids or [])
        self.output_text_buffer_length = 0
        if self.stop and not self.include_stop_str_in_output:
            # The detokenizer holds back this many characters so a stop string
            # split across steps is never streamed before it is recognized.
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Build from keyword arguments where None means "use the default"."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def _normalize(self) -> None:
        if self.best_of is None:
            self.best_of = self.n if isinstance(self.n, int) else None
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self.bad_words = [] if self.bad_words is None else list(self.bad_words)
        if self.logit_bias is not None:
            try:
                # JSON clients send token ids as string keys.
                self.logit_bias = {
                    int(token): min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(bias)))
                    for token, bias in self.logit_bias.items()
                }
            except (TypeError, ValueError) as exc:
                raise ValueError(f"logit_bias must map token ids (int) to floats, got {self.logit_bias!r}.") from exc
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("set structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs = self.guided_decoding.to_structured_outputs()
            self.guided_decoding = None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)

    def _verify_args(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool):
            raise ValueError(f"n must be an int, got {type(self.n).__name__}.")
        if self.n < 1:
            raise _field_error("n", "at least 1", self.n)
        if not isinstance(self.best_of, int) or isinstance(self.best_of, bool):
            raise ValueError(f"best_of must be an int, got {type(self.best_of).__name__}.")
        if self.best_of < self.n:
            raise ValueError(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _field_error("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _field_error("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not self.repetition_penalty > 0.0:
            raise _field_error("repetition_penalty", "in (0, inf)", self.repetition_penalty)
        if not self.temperature >= 0.0:
            raise _field_error("temperature", "non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise _field_error("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an int, got {type(self.top_k).__name__}.")
        if self.top_k < 0:
            raise _field_error("top_k", "0 or -1 (disable), or at least 1", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise _field_error("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {type(self.seed).__name__}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _field_error("max_tokens", "at least 1", self.max_tokens)
        if self.min_tokens < 0:
            raise _field_error("min_tokens", "greater than or equal to 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < 0:
            raise _field_error("logprobs", "non-negative", self.logprobs)
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise _field_error("prompt_logprobs", "non-negative", self.prompt_logprobs)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise _field_error("truncate_prompt_tokens", "at least 1", self.truncate_prompt_tokens)
        if any(not s for s in self.stop or []):
            raise ValueError("stop cannot contain an empty string.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise ValueError("allowed_token_ids must not be empty.")
            if any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must be non-negative ints, got {self.allowed_token_ids!r}.")
        if self.logit_bias is not None and any(t < 0 for t in self.logit_bias):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {sorted(self.logit_bias)!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.logits_processors is not None and any(not callable(p) for p in self.logits_processors):
            raise ValueError("logits_processors must be callables.")

    def _verify_greedy_sampling(self) -> None:
        if self.n > 1:
            raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got {self.n}.")

    def update_from_generation_config(
        self, generation_config: dict[str, Any], model_eos_token_id: int | None = None
    ) -> None:
        """Fold the model's EOS ids in.

        The primary EOS (``model_eos_token_id``) joins only ``all_stop_token_ids``
        (so min_tokens can mask it); the engine stops on it unless ``ignore_eos``.
        Extra EOS ids from generation_config.json become stop tokens too.
        """
        if model_eos_token_id is not None:
            self._all_stop_token_ids.add(model_eos_token_id)
        eos_ids = generation_config.get("eos_token_id")
        if eos_ids is None:
            return
        extra = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
        extra.discard(model_eos_token_id)  # type: ignore[arg-type]
        if not extra:
            return
        self._all_stop_token_ids.update(extra)
        if not self.ignore_eos:
            self.stop_token_ids = sorted(set(self.stop_token_ids or []) | extra)

    def update_from_tokenizer(self, tokenizer: _Tokenizer, vocab_size: int | None = None) -> None:
        """Turn ``bad_words`` into token id sequences (with and without a leading space)."""
        if not self.bad_words:
            return
        variants = [variant for word in self.bad_words for variant in _bad_word_variants(word)]
        # one batch call: tokenizers encodes a batch in Rust with the GIL released
        encoded = _encode_batch(tokenizer, variants)
        sequences: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for ids in encoded:
            # A leading-space variant that tokenizes differently is a new sequence;
            # one that maps to the same ids is a duplicate (a set: 10,000 words were quadratic).
            key = tuple(ids)
            if ids and key not in seen:
                seen.add(key)
                sequences.append(list(ids))
        if vocab_size is not None:
            bad = [t for ids in sequences for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"bad_words produced token ids {bad} outside the vocabulary (size {vocab_size}).")
        self._bad_words_token_ids = sequences

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        """Deep copy, except logits processors, which may hold large state and are shared."""
        memo: dict[int, Any] = {}
        if self.logits_processors is not None:
            for proc in self.logits_processors:
                memo[id(proc)] = proc
        return copy.deepcopy(self, memo=memo)


def _encode_batch(tokenizer: _Tokenizer, texts: list[str]) -> list[list[int]]:
    # a transformers tokenizer (what the engine passes) encodes a list in one call
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _bad_word_variants(word: str) -> Iterable[str]:
    yield word
    if not word.startswith(" "):
        yield " " + word.lstrip()


class BeamSearchParams(msgspec.Struct, omit_defaults=True, dict=True):
    """Beam search settings (vLLM's ``BeamSearchParams``)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise _field_error("beam_width", "at least 1", self.beam_width)
        if self.max_tokens < 1:
            raise _field_error("max_tokens", "at least 1", self.max_tokens)
        if not self.temperature >= 0.0:
            raise _field_error("temperature", "non-negative", self.temperature)
