"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank).

As vLLM: a cross-encoder (a model with the ``score`` task) reads each
(text_1, text_2) pair as one input, the tokenizer's pair encoding with its
token type ids, and its pooled output is the score; an embedding model embeds
every text and the score is the cosine similarity of the two embeddings.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from fastapi import Request

from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.protocol_pooling import RerankRequest, ScoreRequest
from pagoda.entrypoints.openai.serving_common import ServingContext, new_id
from pagoda.entrypoints.openai.serving_pooling import (
    check_pooling_length,
    engine_prompt,
    input_prompts,
    pooled_data,
    pooling_params,
    pooling_usage,
    require_task,
    run_pooling,
    truncation_length,
)


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """1:1, 1:N or N:N, as vLLM pairs them."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise APIError("text_1 must hold at least one text", 400, "text_1")
    if not second:
        raise APIError("text_2 must hold at least one text", 400, "text_2")
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise APIError(f"Input lengths must be either 1:1, 1:N or N:N; got {len(first)} text_1 and {len(second)} "
                       "text_2", 400, "text_2")
    return list(zip(first, second))


def _pair_prompt(ctx: ServingContext, first: str, second: str, truncate: int | None, param: str) -> dict[str, Any]:
    tok = ctx.need_tokenizer()
    if truncate is None:
        enc = tok(first, text_pair=second, add_special_tokens=True)
    else:
        enc = tok(first, text_pair=second, add_special_tokens=True, truncation=True, max_length=truncate)
    ids = list(enc["input_ids"])
    check_pooling_length(ctx, len(ids), param)
    extra: dict[str, Any] = {}
    token_type_ids = enc.get("token_type_ids")
    if token_type_ids is not None:
        extra["token_type_ids"] = list(token_type_ids)
    return engine_prompt(None, ids, **extra)


async def compute_scores(ctx: ServingContext, raw_request: Request, pairs: list[tuple[str, str]],
                         truncate_prompt_tokens: int | None, use_activation: bool | None, request_id: str,
                         priority: int, path: str, param: str) -> tuple[list[float], dict[str, int]]:
    """One score per pair, and the usage of the request."""
    task = require_task(ctx, path, "score", "embed")
    if task == "score":
        truncate = truncation_length(ctx, truncate_prompt_tokens)
        # tokenizing every pair: off the event loop
        prompts = await ctx.engine.run_prep(lambda: [_pair_prompt(ctx, a, b, truncate, param) for a, b in pairs])
        params = pooling_params(task="score", use_activation=use_activation)
        outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, priority, param)
        scores = []
        for out in outputs:
            values = pooled_data(out).flatten()
            if values.numel() != 1:
                raise APIError(f"the model's score output has {values.numel()} values, not one", 500)
            scores.append(float(values[0]))
        return scores, pooling_usage(outputs)
    if use_activation is not None:
        raise APIError("use_activation applies to cross-encoder scores; this model scores by the cosine similarity "
                       "of embeddings", 400, "use_activation")
    # an embedding model: embed each distinct text once, then the cosine of each pair
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    prompts = await ctx.engine.run_prep(input_prompts, ctx, texts, True, truncate_prompt_tokens, param)
    params = pooling_params(task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
    outputs = await run_pooling(ctx, raw_request, prompts, params, request_id, priority, param)
    by_text = {t: pooled_data(o).flatten() for t, o in zip(texts, outputs)}
    scores = [float(torch.nn.functional.cosine_similarity(by_text[a], by_text[b], dim=0)) for a, b in pairs]
    tokens = {t: len(o.prompt_token_ids) for t, o in zip(texts, outputs)}
    used = sum(tokens[a] + tokens[b] for a, b in pairs)
    return scores, {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}


async def create_score(ctx: ServingContext, req: ScoreRequest, raw_request: Request) -> dict[str, Any]:
    ctx.check_model(req.model)
    pairs = score_pairs(req.text_1, req.text_2)
    request_id = req.request_id or new_id("score")
    scores, usage = await compute_scores(ctx, raw_request, pairs, req.truncate_prompt_tokens, req.use_activation,
                                         request_id, req.priority, raw_request.url.path, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.model_name,
            "data": data, "usage": usage}


async def create_rerank(ctx: ServingContext, req: RerankRequest, raw_request: Request) -> dict[str, Any]:
    ctx.check_model(req.model)
    documents = req.document_texts()
    request_id = req.request_id or new_id("rerank")
    scores, usage = await compute_scores(ctx, raw_request, [(req.query, d) for d in documents],
                                         req.truncate_prompt_tokens, req.use_activation, request_id, req.priority,
                                         raw_request.url.path, "documents")
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": request_id, "model": ctx.model_name, "usage": {"total_tokens": usage["total_tokens"]},
            "results": results}
