"""`pagoda chat` and `pagoda complete`: interactive clients of a running server (vLLM's `vllm chat` / `vllm complete`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import closing
from typing import Any

import typer

from pagoda.entrypoints.cli.api_client import APIClient, ClientError, ServerAnswered

DEFAULT_URL = "http://localhost:8000/v1"

_URL_HELP = "URL of the running OpenAI-compatible server, with the /v1 suffix."
_MODEL_HELP = "Model to ask; default: the first model the server lists."
_KEY_HELP = "API key sent as 'Authorization: Bearer KEY' (default: PAGODA_API_KEY, then OPENAI_API_KEY)."


def _connect(url: str, api_key: str | None, model_name: str | None) -> tuple[APIClient, str]:
    """A client and the model to ask; checks the server is there before the first prompt."""
    client = APIClient(url, api_key)
    try:
        names = client.models()
    except ServerAnswered as exc:
        if exc.status == 404 and not client.base_url.endswith("/v1"):
            raise ClientError(f"{exc}; --url names the API root, e.g. {client.base_url}/v1") from None
        raise
    if model_name is None:
        if not names:
            raise ClientError(f"{url}/models lists no model")
        return client, names[0]
    if model_name not in names:
        raise ClientError(f"the server does not serve {model_name!r}; it serves {', '.join(names)}")
    return client, model_name


def _stream_text(client: APIClient, path: str, body: dict[str, Any], text_of: Callable[[dict[str, Any]], str]) -> str:
    """Print the reply as it streams; -> the whole text. Leaving early (Ctrl-C) closes the connection,
    which makes the server abort the request."""
    parts: list[str] = []
    with closing(client.stream(path, body)) as events:
        for event in events:
            for choice in event.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                text = text_of(choice)
                if text:
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    parts.append(text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(parts)


def _chat_delta(choice: dict[str, Any]) -> str:
    return str((choice.get("delta") or {}).get("content") or "")


def _completion_text(choice: dict[str, Any]) -> str:
    return str(choice.get("text") or "")


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401 - importing it gives input() history and editing
    except ImportError:  # not on every platform; input() still works
        pass


def _repl(banner: str, turn: Callable[[str], None]) -> None:
    """Read a line, answer it, repeat; Ctrl-D or Ctrl-C at the prompt leaves, Ctrl-C during a reply stops it."""
    _enable_line_editing()
    typer.echo(banner)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            typer.echo()  # the shell prompt starts on its own line
            return
        if not line.strip():
            continue
        try:
            turn(line)
        except KeyboardInterrupt:
            typer.echo("\n(interrupted)")
        except ClientError as exc:
            typer.echo(f"error: {exc}", err=True)


def _fail(exc: ClientError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(1)


def _connect_or_exit(url: str, api_key: str | None, model_name: str | None) -> tuple[APIClient, str]:
    try:
        return _connect(url, api_key, model_name)
    except ClientError as exc:
        raise _fail(exc) from None


def _session(quick: str | None, banner: str, turn: Callable[[str], None]) -> None:
    """One turn and exit (-q), or the interactive loop."""
    if quick is None:
        _repl(banner, turn)
        return
    try:
        turn(quick)
    except ClientError as exc:
        raise _fail(exc) from None


def chat(
    url: str = typer.Option(DEFAULT_URL, "--url", help=_URL_HELP),
    model_name: str | None = typer.Option(None, "--model-name", help=_MODEL_HELP),
    api_key: str | None = typer.Option(None, "--api-key", envvar=["PAGODA_API_KEY", "OPENAI_API_KEY"],
                                       show_envvar=False, help=_KEY_HELP),
    system_prompt: str | None = typer.Option(None, "--system-prompt", help="System message that opens the conversation."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1,
                                          help="Most tokens per reply; default: the server's (the rest of the context)."),
    quick: str | None = typer.Option(None, "-q", "--quick", metavar="MESSAGE",
                                     help="Send MESSAGE, print the reply, exit."),
) -> None:
    """Chat with a running server; the conversation is kept until you leave (Ctrl-D)."""
    client, model = _connect_or_exit(url, api_key, model_name)
    messages: list[dict[str, str]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {"model": model, "messages": messages}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        try:
            reply = _stream_text(client, "/chat/completions", body, _chat_delta)
        except BaseException:
            messages.pop()  # an unanswered question does not stay in the conversation
            raise
        messages.append({"role": "assistant", "content": reply})

    _session(quick, f"Using model: {model}\nPlease enter a message for the chat model (Ctrl-D to quit):", turn)


def complete(
    url: str = typer.Option(DEFAULT_URL, "--url", help=_URL_HELP),
    model_name: str | None = typer.Option(None, "--model-name", help=_MODEL_HELP),
    api_key: str | None = typer.Option(None, "--api-key", envvar=["PAGODA_API_KEY", "OPENAI_API_KEY"],
                                       show_envvar=False, help=_KEY_HELP),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1,
                                          help="Most tokens per completion; default: the server's (16)."),
    quick: str | None = typer.Option(None, "-q", "--quick", metavar="PROMPT",
                                     help="Complete PROMPT, print the completion, exit."),
) -> None:
    """Complete prompts with a running server; each prompt stands alone."""
    client, model = _connect_or_exit(url, api_key, model_name)

    def turn(prompt: str) -> None:
        body: dict[str, Any] = {"model": model, "prompt": prompt}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        _stream_text(client, "/completions", body, _completion_text)

    _session(quick, f"Using model: {model}\nPlease enter prompt to complete (Ctrl-D to quit):", turn)


def register(app: typer.Typer) -> None:
    app.command("chat")(chat)
    app.command("complete")(complete)
