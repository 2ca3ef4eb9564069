"""Engine logprobs -> the completions format (tokens / token_logprobs / top_logprobs / text_offset) and the chat format."""

from __future__ import annotations

from typing import Any

from pagoda.entrypoints.openai.serving_common import safe_logprob


class TokenText:
    """Token id -> the text clients see for it (cached: the same ids recur across requests)."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, decoded: str | None = None) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        if decoded is not None:
            return decoded
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < 65536:
                self._cache[token_id] = text
        return text


def _top(entry: dict[int, Any], num: int) -> list[tuple[int, Any]]:
    ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
    return [(t, lp) for t, lp in ranked if lp.rank is None or lp.rank <= num][:num]


class CompletionLogprobs:
    """Accumulates the completions-API logprobs object of one choice; ``text_offset`` continues across chunks."""

    def __init__(self, token_text: TokenText, num: int, offset: int = 0) -> None:
        self.token_text = token_text
        self.num = num
        self.offset = offset

    def build(self, token_ids: list[int], entries: list[dict[int, Any] | None] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, tid in enumerate(token_ids):
            entry = entries[i] if entries is not None and i < len(entries) else None
            chosen = entry.get(tid) if entry else None
            text = self.token_text(tid, getattr(chosen, "decoded_token", None))
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(safe_logprob(chosen.logprob) if chosen is not None else None)
            top: dict[str, float] = {}
            ranked = _top(entry, self.num)
            if chosen is not None and all(t != tid for t, _ in ranked):
                # as OpenAI's and vLLM's completions: the sampled token too, when outside the top k (k + 1 entries)
                ranked.append((tid, chosen))
            for t, lp in ranked:
                top.setdefault(self.token_text(t, lp.decoded_token), safe_logprob(lp.logprob))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(token_text: TokenText, token_ids: list[int], entries: list[dict[int, Any]] | None,
                  num: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    for i, tid in enumerate(token_ids):
        entry = entries[i] if entries is not None and i < len(entries) else {}
        chosen = entry.get(tid)
        text = token_text(tid, getattr(chosen, "decoded_token", None))
        content.append({
            "token": text,
            "logprob": safe_logprob(chosen.logprob) if chosen is not None else -9999.0,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (s := token_text(t, lp.decoded_token)), "logprob": safe_logprob(lp.logprob),
                 "bytes": list(s.encode("utf-8"))}
                for t, lp in _top(entry, num)
            ],
        })
    return {"content": content}


def prompt_logprobs_json(token_text: TokenText, entries: list[dict[int, Any] | None] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None if entry is None else {
            str(t): {"logprob": safe_logprob(lp.logprob), "rank": lp.rank,
                     "decoded_token": token_text(t, lp.decoded_token)}
            for t, lp in entry.items()
        }
        for entry in entries
    ]
