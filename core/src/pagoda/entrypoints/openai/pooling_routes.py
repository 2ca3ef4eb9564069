"""The pooling endpoints as one table, shared by the HTTP server and `pagoda run-batch`.

Each route names the tasks a model needs for it (checked before the body is
read, so a model that cannot serve the endpoint answers 404 whatever the
body), the body model shown in the OpenAPI document, and the handler, which
picks the request model from the body's keys (``messages`` / ``data``) as vLLM does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from pagoda.entrypoints.openai.errors import validation_error
from pagoda.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    IOProcessorRequest,
    PoolingChatRequest,
    PoolingCompletionRequest,
    RerankRequest,
    ScoreRequest,
)
from pagoda.entrypoints.openai.serving_common import ServingContext
from pagoda.entrypoints.openai.serving_embedding import (
    create_classify,
    create_embedding,
    create_io_processor_pooling,
    create_pooling,
)
from pagoda.entrypoints.openai.serving_pooling import is_pooling_model, require_task
from pagoda.entrypoints.openai.serving_score import create_rerank, create_score

B = TypeVar("B", bound=BaseModel)
Handler = Callable[[ServingContext, dict[str, Any], Request], Awaitable[Any]]


def validate_body(data: dict[str, Any], model: type[B]) -> B:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


@dataclass(frozen=True)
class PoolingRoute:
    # the model needs one of these tasks; empty: any pooling task
    tasks: tuple[str, ...]
    body: type[BaseModel]
    handle: Handler

    def check(self, ctx: ServingContext, path: str) -> None:
        if self.tasks:
            require_task(ctx, path, *self.tasks)
        elif not is_pooling_model(ctx):
            require_task(ctx, path, "embed")  # the generative model's 404


async def _embeddings(ctx: ServingContext, data: dict[str, Any], raw_request: Request) -> Any:
    req: Any = validate_body(data, EmbeddingChatRequest if "messages" in data else EmbeddingCompletionRequest)
    return await create_embedding(ctx, req, raw_request)


async def _pooling(ctx: ServingContext, data: dict[str, Any], raw_request: Request) -> Any:
    if "data" in data:
        return await create_io_processor_pooling(ctx, validate_body(data, IOProcessorRequest), raw_request)
    req: Any = validate_body(data, PoolingChatRequest if "messages" in data else PoolingCompletionRequest)
    return await create_pooling(ctx, req, raw_request)


async def _classify(ctx: ServingContext, data: dict[str, Any], raw_request: Request) -> Any:
    return await create_classify(ctx, validate_body(data, ClassificationRequest), raw_request)


async def _score(ctx: ServingContext, data: dict[str, Any], raw_request: Request) -> Any:
    return await create_score(ctx, validate_body(data, ScoreRequest), raw_request)


async def _rerank(ctx: ServingContext, data: dict[str, Any], raw_request: Request) -> Any:
    return await create_rerank(ctx, validate_body(data, RerankRequest), raw_request)


_SCORE = PoolingRoute(("score", "embed"), ScoreRequest, _score)
_RERANK = PoolingRoute(("score", "embed"), RerankRequest, _rerank)

# vLLM serves score and rerank under several paths (Jina's and Cohere's among them).
POOLING_ROUTES: dict[str, PoolingRoute] = {
    "/v1/embeddings": PoolingRoute(("embed",), EmbeddingCompletionRequest, _embeddings),
    "/pooling": PoolingRoute((), PoolingCompletionRequest, _pooling),
    "/classify": PoolingRoute(("classify",), ClassificationRequest, _classify),
    "/score": _SCORE,
    "/v1/score": _SCORE,
    "/rerank": _RERANK,
    "/v1/rerank": _RERANK,
    "/v2/rerank": _RERANK,
}
