"""The Anthropic routes on the server's app, answering every failure with Anthropic's error body."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagoda.engine.errors import EngineDeadError
from pagoda.entrypoints.anthropic.errors import anthropic_error_response
from pagoda.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagoda.entrypoints.anthropic.serving import count_tokens, create_message
from pagoda.entrypoints.openai.errors import APIError, parse_json_body
from pagoda.entrypoints.openai.pooling_routes import validate_body
from pagoda.entrypoints.openai.serving_common import ServingContext, request_context
from pagoda.entrypoints.openai.serving_pooling import require_generate

logger = logging.getLogger(__name__)

Route = Callable[[str, type[Any]], Callable[..., Any]]


async def _answer(work: Callable[[], Awaitable[Any]]) -> Any:
    try:
        return await work()
    except APIError as exc:
        return anthropic_error_response(exc)
    except EngineDeadError as exc:
        return anthropic_error_response(APIError(f"the engine is dead: {exc}", 503))
    except Exception as exc:  # noqa: BLE001 - a bug still answers in the API's shape
        logger.exception("unhandled error while serving an Anthropic request")
        return anthropic_error_response(APIError(f"internal server error: {type(exc).__name__}", 500))


async def _context_and_body(raw_request: Request, model: type[Any]) -> tuple[ServingContext, Any]:
    """The context of the model the body names (``request_context``: on a many-model server, loaded first)
    and the validated body."""
    data = parse_json_body(await raw_request.body(), raw_request.headers.get("content-type"))
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}", 400)
    ctx = await request_context(raw_request, data)
    return ctx, validate_body(data, model)


def add_anthropic_routes(app: FastAPI, route: Route) -> None:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; ``route(path, body)`` registers a
    POST route with its body schema in the OpenAPI document (api_server's)."""

    @route("/v1/messages", MessagesRequest)
    async def messages(raw_request: Request) -> Any:
        async def work() -> Any:
            ctx, body = await _context_and_body(raw_request, MessagesRequest)
            require_generate(ctx, "/v1/messages")
            return await create_message(ctx, body, raw_request)
        return await _answer(work)

    @route("/v1/messages/count_tokens", CountTokensRequest)
    async def messages_count_tokens(raw_request: Request) -> Any:
        async def work() -> Any:
            ctx, body = await _context_and_body(raw_request, CountTokensRequest)
            return JSONResponse(await count_tokens(ctx, body))
        return await _answer(work)
