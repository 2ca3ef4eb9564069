"""Lark grammars as EBNF (pagoda.structured_output.lark), checked by xgrammar's own EBNF parser where installed."""

from __future__ import annotations

import pytest

from pagoda.structured_output import ebnf_of, is_likely_lark, lark_to_ebnf


@pytest.mark.parametrize(("lark", "ebnf"), [
    ('?start: "yes" | "no"', 'root ::= "yes" | "no"'),
    ("start: 'it''s'", 'root ::= "it""s"'),
    ("start: 'say \"hi\"'", r'root ::= "say \"hi\""'),
    ("start: a\n    | b  // two\na: \"a\"  # comment\nb: \"#\"", 'root ::= a | b\na ::= "a"\nb ::= "#"'),
    ('start: "a" ["b"] "c" ~ 2 "d" ~ 1..3 -> name', 'root ::= "a" ("b")? "c" {2} "d" {1,3}'),
    ("start: NUMBER\nNUMBER.2: /[0-9]+/", "root ::= NUMBER\nNUMBER ::= ([0-9]+)"),
    ('start: item+\n!item: "x" start?', 'root ::= item+\nitem ::= "x" root?'),
])
def test_lark_to_ebnf(lark: str, ebnf: str) -> None:
    assert is_likely_lark(lark)
    assert lark_to_ebnf(lark) == ebnf
    xgr = pytest.importorskip("xgrammar")
    xgr.Grammar.from_ebnf(ebnf)


@pytest.mark.parametrize(("lark", "says"), [
    ("%import common.WS\nstart: WS", "%import"),
    ('start: "a"i', "case-insensitive"),
    ("start: /a/i", "regex flags"),
    ("start: <[12]>", "token references"),
    ('start: ["a"', "unbalanced"),
    ('expr: "a"', "no 'start' rule"),
    ('start: "a\nb"', "unterminated"),
])
def test_what_has_no_ebnf_form_is_named(lark: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        lark_to_ebnf(lark)


def test_ebnf_passes_unchanged() -> None:
    ebnf = 'root ::= "a" | b  # a comment: start\nb ::= "b"'
    assert not is_likely_lark(ebnf) and ebnf_of(ebnf) == ebnf
