"""A small OpenAI-API client for `pagoda chat` / `pagoda complete` (standard library only).

The core does not depend on the `openai` package, so this speaks the wire
format itself: JSON requests, Server-Sent Events replies, OpenAI error bodies.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Generator
from typing import Any

# A generation may sit in the server's queue for a while before its first token;
# this bounds each socket read, not the whole reply.
READ_TIMEOUT_S = 600.0


class ClientError(Exception):
    """Anything that stops a request: the server is unreachable, answered an error, or sent garbage."""


class ServerUnreachable(ClientError):
    pass


class ServerAnswered(ClientError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"the server answered {status}: {message}")
        self.status = status
        self.message = message


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI error body, or the raw text when it is not one."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return raw.decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in data:
            return str(data["detail"])
    return json.dumps(data)


class APIClient:
    """``base_url`` ends with the API version, as vLLM's ``--url`` does: ``http://localhost:8000/v1``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = READ_TIMEOUT_S) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ClientError(f"--url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _open(self, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        url = self.base_url + path
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)  # noqa: S310 - the user names the server
        except urllib.error.HTTPError as exc:
            with exc:
                raise ServerAnswered(exc.code, _error_message(exc.read())) from None
        except urllib.error.URLError as exc:
            raise ServerUnreachable(
                f"cannot reach the server at {self.base_url} ({exc.reason}); start one with `pagoda serve` "
                "or point --url at it"
            ) from None
        except (TimeoutError, ConnectionError) as exc:
            raise ServerUnreachable(f"lost the connection to {self.base_url}: {exc}") from None

    def models(self) -> list[str]:
        with self._open("/models", None) as resp:
            try:
                data = json.load(resp)
                return [str(m["id"]) for m in data["data"]]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ClientError(f"{self.base_url}/models did not answer an OpenAI model list: {exc}") from None

    def stream(self, path: str, body: dict[str, Any]) -> Generator[dict[str, Any], None, None]:
        """POST ``body`` with ``stream: true``; yield each event's JSON until ``[DONE]``."""
        with self._open(path, {**body, "stream": True}) as resp:
            try:
                for raw in resp:
                    line = raw.decode("utf-8").rstrip("\r\n")
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, other SSE fields
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if isinstance(event, dict) and "error" in event:
                        err = event["error"]
                        message = err.get("message", err) if isinstance(err, dict) else err
                        code = err.get("code", 500) if isinstance(err, dict) else 500
                        raise ServerAnswered(code if isinstance(code, int) else 500, str(message))
                    yield event
            except (TimeoutError, ConnectionError, http.client.HTTPException) as exc:
                raise ServerUnreachable(f"lost the connection to {self.base_url}: {exc!r}") from None
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ClientError(f"the server sent an event that is not JSON: {exc}") from None
        raise ServerUnreachable(f"the stream from {self.base_url}{path} ended without [DONE]")
