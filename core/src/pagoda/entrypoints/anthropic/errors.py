"""Anthropic-style error bodies: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The anthropic SDK picks its exception class by the HTTP status and shows ``error.message``; the ``type``
strings are Anthropic's for each status.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from pagoda.entrypoints.openai.errors import APIError

# Anthropic's error type for each status this server sends (415 and 499 read as a bad request).
_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# The paths that answer in this shape (the auth and size middleware ask, to answer them alike).
PATH_PREFIX = "/v1/messages"


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(err.message, err.status), status_code=err.status)


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")
