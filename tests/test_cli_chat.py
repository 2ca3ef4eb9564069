"""`pagoda chat` / `pagoda complete` against a real `pagoda serve`, driven through a pseudo-terminal as a user
would (typing lines, Ctrl-D), and in --quick mode as scripts do."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from typing import Any

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
KEY = "chat-test-key"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]")
PAGODA = [sys.executable, "-m", "pagoda.entrypoints.cli.main"]


def _controlling_terminal() -> None:
    # the pty becomes the child's terminal, so Ctrl-C / Ctrl-D mean what they mean in a shell
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A command on a pseudo-terminal: ``type`` keys, ``expect`` text on the screen."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                                     preexec_fn=_controlling_terminal, env={**os.environ, **(env or {})})
        os.close(slave)
        self.fd = master
        self.screen = ""  # everything shown so far, CRLF -> LF, escape sequences removed
        self.pos = 0

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 4096)
        except OSError:  # the child closed the terminal
            return False
        if not data:
            return False
        self.screen += _ANSI.sub("", data.decode("utf-8", "replace").replace("\r\n", "\n"))
        return True

    def expect(self, text: str, timeout: float = 120.0) -> str:
        """Wait for ``text`` after what was already consumed; -> the screen before it."""
        deadline = time.monotonic() + timeout
        while (at := self.screen.find(text, self.pos)) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or (not self._read(min(left, 0.5)) and self.proc.poll() is not None):
                raise AssertionError(f"{text!r} did not appear; the screen:\n{self.screen}")
        before = self.screen[self.pos:at]
        self.pos = at + len(text)
        return before

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.1)
        return self.proc.wait(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        os.close(self.fd)


def _prompt_tokens(server: Any) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pagoda:prompt_tokens_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("pagoda:prompt_tokens_total missing from /metrics")


def _count(server: Any, **body: Any) -> int:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PAGODA, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def terminal() -> Any:
    opened: list[Terminal] = []

    def open_terminal(*args: str, env: dict[str, str] | None = None) -> Terminal:
        term = Terminal([*PAGODA, *args], env)
        opened.append(term)
        return term

    yield open_terminal
    for term in opened:
        term.close()


def test_error_messages_are_read_from_openai_error_bodies() -> None:
    from pagoda.entrypoints.cli.api_client import APIClient, ClientError, _error_message

    assert _error_message(b'{"error": {"message": "bad n", "type": "BadRequestError", "code": 400}}') == "bad n"
    assert _error_message(b'{"detail": "Not Found"}') == "Not Found"
    assert _error_message(b"<html>proxy error</html>\n") == "<html>proxy error</html>"
    assert _error_message(b"") == "(empty body)"
    with pytest.raises(ClientError, match="must start with http"):
        APIClient("localhost:8000/v1")


# -- the default model, with its tokenizer and chat template ---------------------------------------------------


def test_chat_keeps_the_conversation_and_leaves_on_ctrl_d(default_model_server: Any, terminal: Any) -> None:
    server = default_model_server
    system = "You are a terse geography tutor."
    term = terminal("chat", "--url", server.url + "/v1", "--system-prompt", system, "--max-tokens", "8")
    term.expect(f"Using model: {MODEL}\n")
    term.expect("Ctrl-D to quit):\n> ")
    questions = ["What is the capital of France?", "And of Germany?"]
    conversation: list[dict[str, str]] = [{"role": "system", "content": system}]
    for question in questions:
        before = _prompt_tokens(server)
        term.type(question + "\n")
        term.expect(question + "\n")  # the terminal echoes the line
        reply = term.expect("\n> ")  # streamed, then the next prompt
        assert reply.strip(), term.screen
        conversation.append({"role": "user", "content": question})
        # the server saw the whole conversation so far, not just the last question
        assert _prompt_tokens(server) - before == _count(server, messages=conversation)
        conversation.append({"role": "assistant", "content": reply})
    assert len(conversation) == 5
    term.type("\x04")  # Ctrl-D
    assert term.wait() == 0
    assert "Traceback" not in term.screen


def test_complete_repl_sends_each_prompt_alone(default_model_server: Any, terminal: Any) -> None:
    server = default_model_server
    term = terminal("complete", "--url", server.url + "/v1", "--max-tokens", "4")
    term.expect("Please enter prompt to complete (Ctrl-D to quit):\n> ")
    term.type("\n")  # an empty line asks nothing
    term.expect("> ")
    for prompt in ["The capital of France is", "Once upon a time"]:
        before = _prompt_tokens(server)
        term.type(prompt + "\n")
        term.expect(prompt + "\n")
        assert term.expect("\n> ").strip()
        assert _prompt_tokens(server) - before == _count(server, prompt=prompt)
    term.type("\x04")
    assert term.wait() == 0


def test_quick_mode_prints_only_the_reply(default_model_server: Any) -> None:
    server = default_model_server
    before = _prompt_tokens(server)
    out = _run("complete", "--url", server.url + "/v1", "-q", "The capital of France is", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and out.stdout.strip() and "Using model" not in out.stdout
    assert _prompt_tokens(server) - before == _count(server, prompt="The capital of France is")
    out = _run("chat", "--url", server.url + "/v1", "--model-name", MODEL, "--quick", "Hi!", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "Using model" not in out.stdout


def test_a_model_the_server_does_not_serve_is_refused(default_model_server: Any) -> None:
    out = _run("chat", "--url", default_model_server.url + "/v1", "--model-name", "gpt-4", "-q", "hi")
    assert out.returncode == 1
    assert f"does not serve 'gpt-4'; it serves {MODEL}" in out.stderr and "Traceback" not in out.stderr


def test_a_url_without_the_api_root_gets_a_hint(default_model_server: Any) -> None:
    out = _run("complete", "--url", default_model_server.url, "-q", "hi")
    assert out.returncode == 1 and "404" in out.stderr
    assert f"--url names the API root, e.g. {default_model_server.url}/v1" in out.stderr


# -- errors a user meets ------------------------------------------------------------------------------------------


def test_unreachable_server_is_a_clear_error_not_a_traceback() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in ("chat", "complete"):
        out = _run(command, "--url", f"http://127.0.0.1:{port}/v1", "-q", "hi")
        assert out.returncode == 1
        assert f"cannot reach the server at http://127.0.0.1:{port}/v1" in out.stderr
        assert "pagoda serve" in out.stderr and "Traceback" not in out.stderr
    out = _run("chat", "--url", "localhost:8000/v1", "-q", "hi")
    assert out.returncode == 1 and "must start with http://" in out.stderr


@pytest.fixture(scope="module")
def keyed_tokenizerless_server(tiny_model_dir: Any, start_server: Any) -> Any:
    path, _ = tiny_model_dir("llama")
    return start_server([str(path), "--skip-tokenizer-init", "--served-model-name", "tiny", "--max-model-len", "128"],
                        env={"PAGODA_API_KEY": KEY})


def test_api_key_and_server_errors(keyed_tokenizerless_server: Any, terminal: Any) -> None:
    url = keyed_tokenizerless_server.url + "/v1"
    no_key = {"PAGODA_API_KEY": "", "OPENAI_API_KEY": ""}
    out = _run("chat", "--url", url, "-q", "hi", env=no_key)
    assert out.returncode == 1 and "401" in out.stderr and "Traceback" not in out.stderr
    # the key from --api-key, then from the environment; this server has no tokenizer, so text is refused (400)
    out = _run("chat", "--url", url, "--api-key", KEY, "-q", "hi", env=no_key)
    assert out.returncode == 1 and "400" in out.stderr and "tokenizer" in out.stderr
    out = _run("complete", "--url", url, "-q", "hi", env={"PAGODA_API_KEY": "", "OPENAI_API_KEY": KEY})
    assert out.returncode == 1 and "400" in out.stderr and "tokenizer" in out.stderr
    # in the REPL an error is shown and the session goes on
    term = terminal("chat", "--url", url, env={"PAGODA_API_KEY": KEY})
    term.expect("Using model: tiny\n")
    term.expect("> ")
    term.type("hello\n")
    assert "tokenizer" in term.expect("> ")
    term.type("\x04")
    assert term.wait() == 0
