"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.errors import EngineDeadError, EngineSleepingError

logger = logging.getLogger(__name__)

# OpenAI's error type for each status the server sends.
_ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request the server refuses (4xx) or could not serve (5xx); carries the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code if code is not None else status


def _status_type(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "ClientError" if status < 500 else "InternalServerError"


def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status) or _status_type(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.code), status_code=err.status)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic names union branches ("str", "list[int]") in the location; they are not fields
    parts = [p for p in parts if not (p[:1].isalpha() and ("[" in p or p in ("str", "int", "float", "bool")))]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    if param is None:
        # a whole-body check names its field on the error it raises (protocol.FieldError)
        ctx: Any = first.get("ctx") or {}
        param = getattr(ctx.get("error") if isinstance(ctx, dict) else None, "param", None)
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "extra_forbidden":
        msg = f"unknown field {param!r}: it is not a parameter of this endpoint"
    elif param:
        msg = f"{param}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(msg, 400, param)


# Deeper bodies are refused before any handler walks them: json's C decoder, pydantic and the grammar
# compilers all recurse per level, and a deep enough body ends in RecursionError or a native stack overflow.
MAX_JSON_DEPTH = 128


def parse_json_body(raw: bytes, content_type: str | None) -> Any:
    """The body as JSON, or a 415/400 naming what is wrong with it."""
    media = (content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(
            f"unsupported content type {content_type or '(none)'!r}: send the body as application/json", 415, None
        )
    try:
        # strict UTF-8 (RFC 8259): json.loads(bytes) decodes with surrogatepass, so raw surrogate bytes
        # (ED A0 80) would become a str that no tokenizer or encoder takes
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise APIError(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}", 400, None) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(f"the request body is not valid JSON: {exc}", 400, None) from None
    except RecursionError:
        raise APIError(f"the request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", 400,
                       None) from None
    # counting brackets is C-speed; only a body with that many of them needs the walk
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and json_depth(data) > MAX_JSON_DEPTH:
        raise APIError(f"the request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)", 400, None)
    # json.loads accepts a lone surrogate escape ("\\ud800"), a string no tokenizer or UTF-8 encoder takes
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(data, "")
        if where is not None:
            raise APIError(f"the request body holds a lone UTF-16 surrogate escape at {where or 'the top level'}: "
                           "it is not a Unicode character", 400, where or None)
    return data


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string holding an unpaired surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(k, path) if isinstance(k, str) else None
            found = found if found is not None else _lone_surrogate(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        # the server is on its way out (api_server's engine watch): the client should retry elsewhere or later
        return error_response(APIError(f"the engine is dead: {exc}", 503))

    @app.exception_handler(EngineSleepingError)
    async def _engine_sleeping(_: Request, exc: EngineSleepingError) -> JSONResponse:
        # sleep mode (/sleep): the model frees its memory until POST /wake_up
        return error_response(APIError(f"the model is asleep: {exc}; POST /wake_up first", 503))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # a bug still answers in the API's shape (starlette's default is a plain-text body)
        logger.exception("unhandled error while serving a request")
        return error_response(APIError(f"internal server error: {type(exc).__name__}", 500))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
