"""Compiles StructuredOutputsParams into llguidance grammars; one LLMatcher per request.

llguidance builds the token-level parser lazily (no per-schema vocabulary pass), so "compiling" is
parsing the grammar into its serialized form; masks are computed per step, for the batch in parallel
on llguidance's own thread pool (LLExecutor, native code without the GIL).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from pagoda.structured_output import (
    JSON_MAX_WHITESPACE,
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputMatcher,
    StructuredOutputsParams,
    is_likely_lark,
    lark_to_ebnf,
)


def _no_additional_properties(node: Any) -> None:
    """An object schema that does not say otherwise allows no properties beyond its own (as xgrammar's strict mode,
    so "auto" gives one answer whichever backend serves the request; vLLM's walk for disable_additional_properties)."""
    if isinstance(node, dict):
        for value in node.values():
            _no_additional_properties(value)
        if "additionalProperties" not in node and ("properties" in node or "patternProperties" in node):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for item in node:
            _no_additional_properties(item)


def _json_text(value: str | dict[str, Any]) -> str:
    try:
        schema = json.loads(value) if isinstance(value, str) else json.loads(json.dumps(value))
    except json.JSONDecodeError:
        return value if isinstance(value, str) else json.dumps(value)  # llguidance names the error
    _no_additional_properties(schema)
    return json.dumps(schema)


def structural_tag_grammar(spec: str) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) as a grammar."""
    try:
        tag = json.loads(spec)
        tags = [
            llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"])
            for s in tag["structures"]
            for trigger in tag["triggers"]
            if s["begin"].startswith(trigger)
        ]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise StructuredOutputError(
            'invalid structured_outputs.structural_tag: expected {"structures": [{"begin", "schema", "end"}, ...], '
            f'"triggers": [...]}} ({type(exc).__name__}: {exc})') from exc
    if not tags:
        raise StructuredOutputError("invalid structured_outputs.structural_tag: no structure's begin starts with "
                                    "one of the triggers")
    return str(llguidance.StructTag.to_grammar(tags))


def serialize_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for ``params``; the matcher reports errors in it."""
    kind = params.kind
    # vLLM's default: JSON may have whitespace where JSON allows it unless disable_any_whitespace
    defaults: JsonCompileOptions = {"whitespace_flexible": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        # bounded runs (core's JSON_MAX_WHITESPACE), as xgrammar's max_whitespace_cnt
        defaults["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{JSON_MAX_WHITESPACE}}}"
    try:
        if kind == "json":
            assert params.json is not None
            return str(llguidance.LLMatcher.grammar_from_json_schema(_json_text(params.json), defaults=defaults))
        if kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=defaults))
        if kind == "regex":
            assert params.regex is not None
            return str(llguidance.grammar_from("regex", params.regex))
        if kind == "choice":
            assert params.choice is not None
            return str(llguidance.grammar_from("choice", json.dumps(params.choice)))
        if kind == "grammar":
            assert params.grammar is not None
            return grammar_spec(params.grammar)
        assert params.structural_tag is not None
        return structural_tag_grammar(params.structural_tag)
    except StructuredOutputError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        raise StructuredOutputError(f"invalid structured_outputs.{kind}: {exc}") from exc


def grammar_spec(grammar: str) -> str:
    """A grammar in llguidance's form: GBNF as GBNF; Lark as Lark (so ``?start:`` is not misread as GBNF), or,
    when llguidance's Lark refuses it (single-quoted literals, as Outlines' users write them), as the EBNF vLLM
    converts Lark to. A grammar neither reading takes keeps llguidance's own error."""
    if not is_likely_lark(grammar):
        return str(llguidance.grammar_from("grammar", grammar))
    native = str(llguidance.grammar_from("lark", grammar))
    if not llguidance.LLMatcher.validate_grammar(native):
        return native
    try:
        converted = lark_to_ebnf(grammar)
    except ValueError:
        return native
    return str(llguidance.grammar_from("grammar", converted))


def _check(params: StructuredOutputsParams, grammar: str, tokenizer: Any = None) -> None:
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise StructuredOutputError(f"invalid structured_outputs.{params.kind}: {error}")


class GuidanceMatcher(StructuredOutputMatcher):
    supports_rollback = True

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise StructuredOutputError(f"llguidance: {self.matcher.get_error()}")
        self._stop_tokens = set(tokenizer.eos_tokens)
        # the tokens accepted, latest last (is_terminated reads the last; rollback restores it)
        self._accepted: list[int] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for i, token in enumerate(token_ids):
            if not self.matcher.consume_token(token):
                # leave the matcher where it was before this call
                if i:
                    self.matcher.rollback(i)
                return False
        self._accepted.extend(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)
            del self._accepted[-num_tokens:]

    def validate_tokens(self, token_ids: list[int]) -> int:
        # consuming a rejected token would stop the matcher for good: llguidance checks without consuming
        return int(self.matcher.validate_tokens(token_ids))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        # As xgrammar's: terminated once the stop token is accepted. llguidance stops as soon as the grammar is
        # complete, its mask then allowing only EOS; ending the request there would hide the last real token,
        # which the engine takes for the stop token and leaves out of the text.
        return bool(self.matcher.is_stopped()) and bool(self._accepted) and self._accepted[-1] in self._stop_tokens


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar

    def new_matcher(self) -> StructuredOutputMatcher:
        return GuidanceMatcher(self.tokenizer, self.grammar)


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        # The model's vocabulary may be wider than the tokenizer's (padding rows): n_vocab masks those off.
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self._executor = llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        grammar = serialize_grammar(params)
        # with the tokenizer: also finds grammars this vocabulary cannot produce
        _check(params, grammar, self.ll_tokenizer)
        return GuidanceGrammar(self.ll_tokenizer, grammar)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        _check(params, serialize_grammar(params))

    def fill_bitmasks(self, matchers: Sequence[StructuredOutputMatcher], rows: Sequence[int],
                      bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        pairs = [(m.matcher, row) for m, row in zip(matchers, rows) if isinstance(m, GuidanceMatcher)]
        llguidance.torch.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
