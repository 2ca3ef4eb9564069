"""Compiles StructuredOutputsParams with xgrammar; one GrammarMatcher per request."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
import xgrammar as xgr

from pagoda.structured_output import (
    JSON_MAX_WHITESPACE,
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputError,
    StructuredOutputMatcher,
    StructuredOutputsParams,
    ebnf_of,
)

# xgrammar's messages start with "[hh:mm:ss] /project/cpp/file.cc:123: "; the caller needs only the rest.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")


def _message(exc: Exception) -> str:
    return _LOG_PREFIX.sub("", str(exc).strip())


def structural_tag_args(spec: str) -> tuple[Any, ...]:
    """xgrammar's arguments for a structural tag: vLLM's (OpenAI-style) ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}``, or xgrammar's own ``{"type": "structural_tag", "format": {...}}`` as it is."""
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise StructuredOutputError(f"invalid structured_outputs.structural_tag: not JSON ({exc})") from exc
    if isinstance(tag, dict) and "structures" in tag:
        try:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return items, list(tag["triggers"])
        except (KeyError, TypeError) as exc:
            raise StructuredOutputError("invalid structured_outputs.structural_tag: each structure needs begin, "
                                        f"schema and end, and triggers a list ({type(exc).__name__}: {exc})") from exc
    return (spec,)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = params.kind
    any_whitespace = not params.disable_any_whitespace
    # bounded runs of whitespace (core's JSON_MAX_WHITESPACE); none with disable_any_whitespace
    bound = JSON_MAX_WHITESPACE if any_whitespace else None
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=any_whitespace, max_whitespace_cnt=bound)
        if kind == "json_object":
            # an object schema rather than the builtin JSON grammar, whose whitespace has no bound
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                max_whitespace_cnt=bound)
        if kind == "regex":
            assert params.regex is not None
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            assert params.choice is not None
            return compiler.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            assert params.grammar is not None
            return compiler.compile_grammar(ebnf_of(params.grammar))
        assert params.structural_tag is not None
        return compiler.compile_structural_tag(*structural_tag_args(params.structural_tag))
    except StructuredOutputError:
        raise
    except MemoryError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        if "bad_alloc" in str(exc):
            raise MemoryError(str(exc)) from exc
        raise StructuredOutputError(f"invalid structured_outputs.{kind}: {_message(exc)}") from exc


class XgrammarMatcher(StructuredOutputMatcher):
    supports_rollback = True

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)  # keeps unlimited rollback history

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for i, token in enumerate(token_ids):
            if not self._matcher.accept_token(token):
                # leave the matcher where it was before this call
                if i:
                    self._matcher.rollback(i)
                return False
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XgrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> StructuredOutputMatcher:
        return XgrammarMatcher(self.compiled)

    def memory_size_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        # The model's vocabulary may be wider than the tokenizer's (padding rows): xgrammar masks those off.
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return XgrammarGrammar(_compile(self._compiler, params))

    # Tried first in core's compile worker, which can be stopped (a compiled grammar's JSON form is too big to
    # send back: 99 MB and 22 s to write for 400 properties, whose grammar holds 3 MB), so the worker only proves
    # that the compile ends within the budget.

    def compile_worker_state(self) -> Any | None:
        return self._info.serialize_json()

    @classmethod
    def worker_compiler(cls, state: Any) -> Any:
        return xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(state), cache_enabled=False)

    @classmethod
    def worker_compile(cls, compiler: Any, params: StructuredOutputsParams) -> None:
        _compile(compiler, params)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        # Parsing into a Grammar finds a bad schema, regex or EBNF; only compiling needs the vocabulary.
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                xgr.Grammar.from_json_schema(schema)
            elif kind == "regex":
                assert params.regex is not None
                xgr.Grammar.from_regex(params.regex)
            elif kind == "choice":
                assert params.choice is not None
                xgr.Grammar.from_ebnf(choice_grammar(params.choice))
            elif kind == "grammar":
                assert params.grammar is not None
                # a Lark grammar (Outlines', vLLM users') as EBNF, as vLLM's xgrammar backend converts it
                xgr.Grammar.from_ebnf(ebnf_of(params.grammar))
            elif kind == "structural_tag":
                assert params.structural_tag is not None
                xgr.Grammar.from_structural_tag(*structural_tag_args(params.structural_tag))
        except StructuredOutputError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"invalid structured_outputs.{kind}: {_message(exc)}") from exc

    # apply_token_bitmask: core's torch version. xgrammar's own CPU kernel (apply_token_bitmask_inplace) measured
    # 12.4 ms for [64, 49152] float32 logits beside core's 3.1 ms (2 threads, docs/benchmarks.md, session 6).

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)
