"""Lark grammars (Outlines', vLLM users') as the EBNF that xgrammar compiles, as vLLM converts them.

A grammar with no ``::=`` rule is read as Lark. The conversion covers what such grammars are written with:
rules and terminals (``?`` / ``!`` modifiers and ``.N`` priorities dropped), ``|`` alternatives on
continuation lines, double- or single-quoted literals, ``/regex/`` terminals (kept as EBNF, whose character
classes and repetitions match Lark's regex ones), ``[x]`` (optional), ``x ~ n`` / ``x ~ n..m``, ``-> alias``
(dropped), ``//`` and ``#`` comments, and ``start`` as the root. Directives (``%import``, ``%ignore``, ...),
case-insensitive literals and regex flags have no EBNF form: they are refused with a ``ValueError`` naming them.
"""

from __future__ import annotations

import re

_RULE = re.compile(r"^[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.-?\d+)?\s*:(?!:)(.*)$")
_REPEAT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def is_likely_lark(grammar: str) -> bool:
    """vLLM's test: no line defines a rule with ``::=`` (comments aside)."""
    return not any("::=" in _strip_comment(line) for line in grammar.splitlines())


def _strip_comment(line: str) -> str:
    """``line`` up to a ``//`` or ``#`` comment outside literals and regexes."""
    quote: str | None = None
    i = 0
    while i < len(line):
        c = line[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "/" and line.startswith("//", i):
            return line[:i]
        elif c == "/":
            quote = "/"
        elif c == "#":
            return line[:i]
        i += 1
    return line


def _literal(body: str, quote: str) -> str:
    """A Lark literal's body as an EBNF double-quoted string."""
    if quote == '"':
        return f'"{body}"'
    # single-quoted: an escaped single quote is plain, a double quote needs escaping
    return '"' + body.replace("\\'", "'").replace('"', '\\"') + '"'


def _expression(rhs: str, line_no: int) -> str:
    out: list[str] = []
    optional_depth = 0
    i = 0
    while i < len(rhs):
        c = rhs[i]
        if c in "\"'":
            j = i + 1
            while j < len(rhs) and rhs[j] != c:
                j += 2 if rhs[j] == "\\" else 1
            if j >= len(rhs):
                raise ValueError(f"line {line_no}: unterminated literal {rhs[i:]!r}")
            if j + 1 < len(rhs) and rhs[j + 1] == "i":
                raise ValueError(f"line {line_no}: case-insensitive literal {rhs[i:j + 2]!r} has no EBNF form")
            out.append(_literal(rhs[i + 1:j], c))
            i = j + 1
        elif c == "/":
            j = i + 1
            while j < len(rhs) and rhs[j] != "/":
                j += 2 if rhs[j] == "\\" else 1
            if j >= len(rhs):
                raise ValueError(f"line {line_no}: unterminated regex {rhs[i:]!r}")
            flags = re.match(r"[imslux]+", rhs[j + 1:])
            if flags:
                raise ValueError(f"line {line_no}: regex flags /{flags.group(0)} have no EBNF form")
            out.append(f"({rhs[i + 1:j]})")
            i = j + 1
        elif c == "[":
            optional_depth += 1
            out.append("(")
            i += 1
        elif c == "]":
            if optional_depth == 0:
                raise ValueError(f"line {line_no}: unbalanced ']'")
            optional_depth -= 1
            out.append(")?")
            i += 1
        elif c == "~":
            m = _REPEAT.match(rhs, i)
            if m is None:
                raise ValueError(f"line {line_no}: '~' needs a count (x ~ 3 or x ~ 2..5)")
            low, high = m.groups()
            out.append(f"{{{low}}}" if high is None else f"{{{low},{high}}}")
            i = m.end()
        elif c == "<":
            raise ValueError(f"line {line_no}: token references ({rhs[i:i + 12]}...) are llguidance's, not EBNF")
        elif rhs.startswith("->", i):
            # an alias names the tree node; the language is the same without it
            m = re.match(r"->\s*[A-Za-z_][A-Za-z0-9_]*", rhs[i:])
            i += m.end() if m else 2
        else:
            out.append(c)
            i += 1
    if optional_depth:
        raise ValueError(f"line {line_no}: unbalanced '['")
    return "".join(out).strip()


def _rename_start(text: str) -> str:
    """``start`` -> ``root`` outside literals (the only words left in an expression are rule names)."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', text)
    return "".join(p if k % 2 else re.sub(r"\bstart\b", "root", p) for k, p in enumerate(parts))


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF (xgrammar's / GBNF) form of a Lark ``grammar``; ``ValueError`` naming what cannot be converted."""
    rules: list[tuple[str, list[str]]] = []
    for line_no, raw in enumerate(grammar.splitlines(), 1):
        line = _strip_comment(raw).strip()
        if not line:
            continue
        if line.startswith("%"):
            raise ValueError(f"line {line_no}: the Lark directive {line.split()[0]!r} has no EBNF form")
        match = _RULE.match(line)
        if match is not None:
            rules.append((match.group(1), [_expression(match.group(2), line_no)]))
        elif line.startswith("|") and rules:
            rules[-1][1].append(_expression(line[1:], line_no))
        else:
            raise ValueError(f"line {line_no}: {line!r} is neither a rule (name: ...) nor a '|' alternative")
    if not rules:
        raise ValueError("the grammar defines no rule")
    names = [name for name, _ in rules]
    if "root" in names and "start" in names:
        raise ValueError("the grammar defines both 'start' and 'root': EBNF's root is Lark's start")
    if "start" not in names and "root" not in names:
        raise ValueError("the grammar has no 'start' rule (Lark's entry point)")
    lines = []
    for name, alternatives in rules:
        body = " | ".join(a for a in alternatives if a)
        lines.append(f"{'root' if name == 'start' else name} ::= {_rename_start(body)}")
    return "\n".join(lines)


def ebnf_of(grammar: str) -> str:
    """``grammar`` as EBNF: converted when it is Lark, as it is otherwise (vLLM's xgrammar path)."""
    return lark_to_ebnf(grammar) if is_likely_lark(grammar) else grammar
