"""`pagoda run-batch`: an OpenAI batch file through the server's own handlers, with no HTTP in between.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``; each
output line (in input order) is ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``. The body is exactly what
the HTTP server would answer, error bodies included, because the same
handlers produce it. A bad line becomes an error line; it never stops the
batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import Message

from pagoda.entrypoints.openai.errors import APIError, error_body, validation_error
from pagoda.entrypoints.openai.pooling_routes import POOLING_ROUTES
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagoda.entrypoints.openai.serving_chat import create_chat_completion
from pagoda.entrypoints.openai.serving_common import ServingContext
from pagoda.entrypoints.openai.serving_completion import create_completion
from pagoda.entrypoints.openai.serving_pooling import require_generate

logger = logging.getLogger(__name__)

Handler = Callable[[ServingContext, Any, Request], Awaitable[Any]]

ENDPOINTS: dict[str, tuple[type[BaseModel], Handler]] = {
    "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
    "/v1/completions": (CompletionRequest, create_completion),
}
# Served by the server's pooling handlers (a model without the task gets the server's 404).
POOLING_URLS = frozenset(POOLING_ROUTES)
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


class BatchFileError(ValueError):
    """The input or output file cannot be used (the batch does not start)."""


@dataclass
class BatchLine:
    """One input line, parsed; ``error`` is set when it cannot run."""

    line_no: int
    custom_id: str | None = None
    url: str | None = None
    body: dict[str, Any] | None = None
    error: APIError | None = None


@dataclass
class BatchSummary:
    total: int = 0
    succeeded: int = 0
    failed_lines: list[int] = field(default_factory=list)

    @property
    def failed(self) -> int:
        return len(self.failed_lines)


def parse_line(raw: bytes | str, line_no: int, seen: dict[str, int]) -> BatchLine:
    """Check one line's envelope (not its body: the endpoint's request model does that)."""
    line = BatchLine(line_no)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line.error = APIError(f"line {line_no} is not valid JSON: {exc}", 400, None)
        return line
    if not isinstance(data, dict):
        line.error = APIError(f"line {line_no} must be a JSON object, got {type(data).__name__}", 400, None)
        return line
    custom_id = data.get("custom_id")
    if isinstance(custom_id, str):
        line.custom_id = custom_id
    unknown = sorted(set(data) - _LINE_KEYS)
    if not isinstance(custom_id, str) or not custom_id:
        line.error = APIError(f"line {line_no}: custom_id must be a non-empty string", 400, "custom_id")
    elif custom_id in seen:
        line.error = APIError(f"line {line_no}: custom_id {custom_id!r} was already used on line {seen[custom_id]}; "
                              "each custom_id must be unique in a batch", 400, "custom_id")
    elif unknown:
        line.error = APIError(f"line {line_no}: unknown field(s) {', '.join(map(repr, unknown))}; a batch line has "
                              "custom_id, method, url and body", 400, unknown[0])
    elif data.get("method") != "POST":
        line.error = APIError(f"line {line_no}: method must be \"POST\", got {data.get('method')!r}", 405, "method")
    elif not isinstance(data.get("url"), str):
        line.error = APIError(f"line {line_no}: url must be a string such as \"/v1/chat/completions\"", 400, "url")
    elif not isinstance(data.get("body"), dict):
        line.error = APIError(f"line {line_no}: body must be a JSON object (the request)", 400, "body")
    else:
        line.url = data["url"]
        line.body = data["body"]
    if line.custom_id is not None and line.custom_id not in seen:
        seen[line.custom_id] = line_no
    return line


def output_line(custom_id: str | None, status: int, body: dict[str, Any] | None,
                error: APIError | None) -> dict[str, Any]:
    request_id = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else None
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"pagoda-batch-{uuid.uuid4().hex}",
                     "body": body},
        "error": None if error is None else {"code": str(error.code), "message": error.message},
    }


def _error_line(line: BatchLine, err: APIError) -> dict[str, Any]:
    return output_line(line.custom_id, err.status, error_body(err.message, err.status, err.param, err.code), err)


def _no_client_request(path: str) -> Request:
    """What the handlers take as the HTTP request: here there is no client that could go away."""

    async def receive() -> Message:
        await asyncio.get_running_loop().create_future()  # never resolves; cancelled when the handler is done
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}, receive)


async def run_line(ctx: ServingContext, line: BatchLine) -> dict[str, Any]:
    """One line's output: the handler's answer, or the error it (or the envelope) raised."""
    if line.error is not None:
        return _error_line(line, line.error)
    assert line.url is not None and line.body is not None
    if line.url in POOLING_URLS:
        return await _run_pooling_line(ctx, line)
    if line.url not in ENDPOINTS:
        return _error_line(line, APIError(
            f"url {line.url!r} is not an endpoint run-batch serves; use one of "
            f"{', '.join([*ENDPOINTS, *POOLING_ROUTES])}", 404, "url"))
    model, handler = ENDPOINTS[line.url]
    try:
        require_generate(ctx, line.url)
        try:
            req: Any = model.model_validate(line.body)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.stream:
            raise APIError("a batch request cannot stream: drop \"stream\" or set it to false", 400, "stream")
        response = await handler(ctx, req, _no_client_request(line.url))
    except APIError as err:
        return _error_line(line, err)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not stop the batch
        logger.exception("batch line %d (custom_id %r) failed", line.line_no, line.custom_id)
        return _error_line(line, APIError(f"internal error: {type(exc).__name__}: {exc}", 500, None))
    return output_line(line.custom_id, response.status_code, json.loads(response.body), None)


async def _run_pooling_line(ctx: ServingContext, line: BatchLine) -> dict[str, Any]:
    assert line.url is not None and line.body is not None
    pooling_route = POOLING_ROUTES[line.url]
    try:
        pooling_route.check(ctx, line.url)
        body = await pooling_route.handle(ctx, line.body, _no_client_request(line.url))
    except APIError as err:
        return _error_line(line, err)
    except Exception as exc:  # noqa: BLE001 - one line's failure must not stop the batch
        logger.exception("batch line %d (custom_id %r) failed", line.line_no, line.custom_id)
        return _error_line(line, APIError(f"internal error: {type(exc).__name__}: {exc}", 500, None))
    return output_line(line.custom_id, 200, body, None)


async def run_batch(ctx: ServingContext, lines: Iterable[bytes | str], write: Callable[[dict[str, Any]], None],
                    max_in_flight: int) -> BatchSummary:
    """Run every non-blank line, at most ``max_in_flight`` at once; ``write`` gets the outputs in input order."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
    summary = BatchSummary()
    ready: dict[int, dict[str, Any]] = {}
    next_out = 0
    slots = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task[None]] = set()
    seen: dict[str, int] = {}

    def deliver(index: int, line: BatchLine, out: dict[str, Any]) -> None:
        nonlocal next_out
        if out["response"]["status_code"] == 200:
            summary.succeeded += 1
        else:
            summary.failed_lines.append(line.line_no)
        ready[index] = out
        while next_out in ready:  # results finish out of order; the file keeps the input's order
            write(ready.pop(next_out))
            next_out += 1

    async def run(index: int, line: BatchLine) -> None:
        try:
            out = await run_line(ctx, line)
        finally:
            slots.release()
        deliver(index, line, out)

    for line_no, raw in enumerate(lines, start=1):
        if line_no == 1:  # editors on Windows start UTF-8 files with a byte-order mark
            raw = raw.removeprefix(b"\xef\xbb\xbf") if isinstance(raw, bytes) else raw.removeprefix("\ufeff")
        if not raw.strip():
            continue
        index = summary.total
        summary.total += 1
        line = parse_line(raw, line_no, seen)
        if line.error is not None:
            deliver(index, line, await run_line(ctx, line))
            continue
        await slots.acquire()
        task = asyncio.create_task(run(index, line))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    summary.failed_lines.sort()
    return summary


def check_files(input_file: str, output_file: str) -> None:
    """Refuse what cannot work before the model loads."""
    for flag, path in (("--input-file", input_file), ("--output-file", output_file)):
        if "://" in path:
            raise BatchFileError(f"{flag} {path!r} is a URL; pagoda never downloads or uploads: use a local file")
        if path == "-":
            raise BatchFileError(f"{flag} must be a file; '-' (stdin/stdout) is not supported, as in vllm run-batch")
    src = Path(input_file)
    if not src.is_file():
        raise BatchFileError(f"--input-file {input_file!r} does not exist or is not a file")
    if not os.access(src, os.R_OK):
        raise BatchFileError(f"--input-file {input_file!r} is not readable")
    dst = Path(output_file)
    if dst.is_dir():
        raise BatchFileError(f"--output-file {output_file!r} is a directory")
    if dst.exists() and dst.resolve() == src.resolve():
        raise BatchFileError("--output-file is the input file; writing it would destroy the input")
    parent = dst.parent if str(dst.parent) else Path(".")
    if not parent.is_dir():
        raise BatchFileError(f"the folder of --output-file {output_file!r} does not exist")
    if not os.access(parent, os.W_OK) or (dst.exists() and not os.access(dst, os.W_OK)):
        raise BatchFileError(f"--output-file {output_file!r} is not writable")


def _count_requests(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip())


def run_batch_file(ctx: ServingContext, input_file: str, output_file: str, max_in_flight: int,
                   progress: bool = True) -> BatchSummary:
    """Run ``input_file`` on ``ctx``'s engine, writing ``output_file`` line by line as results come in order."""
    from tqdm import tqdm

    started = time.perf_counter()
    with open(input_file, "rb") as src, open(output_file, "w", encoding="utf-8", buffering=1) as dst, \
            tqdm(total=_count_requests(input_file), unit="req", desc="run-batch", disable=not progress) as bar:

        def write(out: dict[str, Any]) -> None:
            dst.write(json.dumps(out, ensure_ascii=False) + "\n")
            bar.update()

        summary = asyncio.run(run_batch(ctx, src, write, max_in_flight))
    logger.info("run-batch: %d request(s), %d succeeded, %d failed, in %.1f s", summary.total, summary.succeeded,
                summary.failed, time.perf_counter() - started)
    return summary
