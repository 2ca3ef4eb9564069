"""ASGI middleware: the API key, the allowed Host headers, and a cap on request body size."""

from __future__ import annotations

import json
import secrets
from typing import Any

from pagoda.entrypoints.anthropic.errors import anthropic_error_body, is_anthropic_path
from pagoda.entrypoints.openai.errors import error_body

Scope = dict[str, Any]
ASGIApp = Any


async def _send_error(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None,
                      path: str = "") -> None:
    # the Anthropic routes answer in Anthropic's error shape, even before their handler runs
    shape = anthropic_error_body if is_anthropic_path(path) else error_body
    body = json.dumps(shape(message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


# Paths answered without the API key: liveness probes and scrapers, which carry no key; nothing on them
# reads a prompt or runs the model. Every other path (/v1/*, /tokenize, /detokenize, /pooling, /score,
# /rerank, /v2/rerank, /classify, /tokenizer_info, /docs, ...) needs it.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's header, which its SDK
    sends) on every path but ``OPEN_PATHS`` (vLLM guards /v1/* only, which left /tokenize, /pooling, /score
    and /rerank open to anyone who can reach the port)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        # both compared whatever the first gives, so the answer takes as long either way
        bearer = secrets.compare_digest(headers.get(b"authorization", b""), self.expected)
        x_api_key = secrets.compare_digest(headers.get(b"x-api-key", b""), self.expected_x_api_key)
        if not (bearer or x_api_key):
            await _send_error(send, 401, "invalid or missing API key: send 'Authorization: Bearer <key>' or "
                              "'x-api-key: <key>'", [(b"www-authenticate", b"Bearer")], scope["path"])
            return
        await self.app(scope, receive, send)


class AllowedHostsMiddleware:
    """400 for a Host header outside ``allowed_hosts`` (names, ``*.domain`` suffixes, ``*`` for any): a
    guard against DNS rebinding, where a web page's script reaches a server on localhost by a name it controls."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]) -> None:
        self.app = app
        self.exact = {h.lower() for h in allowed_hosts if not h.startswith("*.")}
        self.suffixes = tuple(h[1:].lower() for h in allowed_hosts if h.startswith("*."))

    def allows(self, host: str) -> bool:
        name = host.lower()
        if name.startswith("["):  # [::1]:8000
            name = name[: name.find("]") + 1]
        else:
            name = name.rsplit(":", 1)[0]
        return name in self.exact or name.endswith(self.suffixes)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if not self.allows(host):
            await _send_error(send, 400, f"the Host header {host!r} is not one of this server's --allowed-hosts")
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over ``max_bytes``, by Content-Length up front or by counting a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"the request body is larger than the server's limit of {self.max_bytes} bytes"
        if length is not None:
            try:
                if int(length) > self.max_bytes:
                    await _send_error(send, 413, too_big, path=scope["path"])
                    return
            except ValueError:
                await _send_error(send, 400, "the Content-Length header is not a number")
                return
        received = 0
        response_started = False

        async def counting_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            if not response_started:
                await _send_error(send, 413, too_big, path=scope["path"])


class _BodyTooLarge(Exception):
    pass
