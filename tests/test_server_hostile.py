"""Issue 39: hostile input against a real `pagoda serve`, an ordinary request beside each probe.

The probes share the session's default-model server (SmolLM2-135M-Instruct, --max-model-len 512);
start-up options and a dying engine core use the tiny random model, whose servers start in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

JSON = {"Content-Type": "application/json"}
ORDINARY = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
# Seconds /health may take beside a probe: before, they stalled it 6.4-28 s; the slack is the shared
# machine's (timing targets are benchmarks', docs/benchmarks.md, not these tests')
STALL = 3.0


@pytest.fixture(scope="module")
def server(default_model_server: Any) -> Any:
    return default_model_server


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return dict(err)


class _Beside:
    """Polls /health every 0.1 s and times an ordinary request (a completion unless told) while a probe runs."""

    def __init__(self, url: str, path: str = "/v1/completions", body: dict[str, Any] = ORDINARY) -> None:
        self.url = url
        self.path, self.body = path, body
        self.worst_health = 0.0
        self.ordinary: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._health), threading.Thread(target=self._ordinary)]

    def _health(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    status = client.get(self.url + "/health").status_code
                except httpx.HTTPError as exc:  # a timeout is the worst stall of all: never lost with the thread
                    status = repr(exc)
                if status != 200:
                    self.failures.append(f"/health {status}")
                self.worst_health = max(self.worst_health, time.monotonic() - t)
                time.sleep(0.1)

    def _ordinary(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    r = client.post(self.url + self.path, json=self.body)
                except httpx.HTTPError as exc:
                    self.failures.append(f"{self.path}: {exc!r}")
                    continue
                if r.status_code != 200:
                    self.failures.append(r.text)
                self.ordinary.append(time.monotonic() - t)

    def __enter__(self) -> _Beside:
        for t in self._threads:
            t.start()
        time.sleep(0.3)
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(0.3)
        self._stop.set()
        for t in self._threads:
            t.join(120)
        assert not self.failures, self.failures[:3]


# -- 3. malformed bodies -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_deep_nesting_and_raw_surrogates_are_400s(server: Any, path: str) -> None:
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    err = _error(httpx.post(server.url + path, content=deep, headers=JSON))
    assert "nested too deeply" in err["message"] and "128" in err["message"], err
    # below json's recursion limit, still past ours
    deep = b'{"prompt": "x", "metadata": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert "nested too deeply" in _error(httpx.post(server.url + path, content=deep, headers=JSON))["message"]
    # ED A0 80 is U+D800 in CESU-8, not UTF-8; json.loads(bytes) took it as a lone surrogate
    err = _error(httpx.post(server.url + path, content=b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', headers=JSON))
    assert "UTF-8" in err["message"], err
    assert httpx.post(server.url + "/v1/completions", json=ORDINARY, timeout=60).status_code == 200


def test_deep_tool_call_arguments_are_a_400(server: Any) -> None:
    args = "[" * 5000 + "]" * 5000
    body = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": args}}]},
        {"role": "user", "content": "again"}]}
    err = _error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
    assert "nested too deeply" in err["message"], err


# -- 2. the event loop stays free ----------------------------------------------------------------------


def test_a_10mb_prompt_is_refused_fast_and_stalls_nobody(server: Any) -> None:
    prompt = "hello " * 1_750_000  # 10.5 MB
    with _Beside(server.url) as beside:
        for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2})):
            t = time.monotonic()
            err = _error(httpx.post(server.url + path, json=body, timeout=120))
            assert "maximum context length is 512" in err["message"], err
            assert time.monotonic() - t < 5, "the prompt was tokenized whole before its length was checked"
    # before: /health stalled 6.4 s (the whole prompt was tokenized on the loop first)
    assert beside.worst_health < STALL, beside.worst_health
    assert beside.ordinary  # served beside it (their latency is a benchmark's: benchmarks.hostile_input)


def test_tokenize_10mb_and_10000_bad_words_run_off_the_loop(server: Any) -> None:
    with _Beside(server.url) as beside:
        r = httpx.post(server.url + "/tokenize", json={"prompt": "hello " * 1_750_000}, timeout=300)
        # the count from the head of the body: parsing all 12 MB here would hold this process's GIL and
        # stall the /health poller beside it, which is what the test measures on the server
        assert r.status_code == 200 and r.content.startswith(b'{"count": 1750001,'), r.content[:100]
        r = httpx.post(server.url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": 2, "bad_words": [f"w{i} x{i}" for i in range(10_000)]}, timeout=300)
        assert r.status_code == 200, r.text
    # before: /health stalled 28 s and 6.5 s
    assert beside.worst_health < STALL, beside.worst_health


# -- 8. logit_bias --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [100.5, -150, 1e9])
def test_logit_bias_outside_100_is_refused(server: Any, bias: float) -> None:
    err = _error(httpx.post(server.url + "/v1/completions", json={**ORDINARY, "logit_bias": {"5": bias}}))
    assert err["param"] == "logit_bias" and "[-100, 100]" in err["message"], err
    r = httpx.post(server.url + "/v1/completions", json={**ORDINARY, "logit_bias": {"5": 100}}, timeout=60)
    assert r.status_code == 200


# -- 1. grammar budgets ---------------------------------------------------------------------------------


def _props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def test_a_10000_property_schema_is_a_400_naming_the_limit(server: Any) -> None:
    with _Beside(server.url) as beside:
        t = time.monotonic()
        err = _error(httpx.post(server.url + "/v1/completions", json={
            **ORDINARY, "structured_outputs": {"json": _props(10_000)}}, timeout=120))
        assert time.monotonic() - t < 5
        assert "max_schema_properties" in err["message"] and "400" in err["message"], err
        assert err["param"] == "structured_outputs", err
        # chat's response_format and tool_choice=required reach the same bound
        err = _error(httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _props(10_000)}}},
            timeout=120))
        assert "max_schema_properties" in err["message"], err
        err = _error(httpx.post(server.url + "/v1/completions", json={
            **ORDINARY, "structured_outputs": {"regex": "a" * 200_000}}, timeout=120))
        assert "max_constraint_chars" in err["message"], err
    assert beside.worst_health < STALL, beside.worst_health
    assert beside.ordinary
    # under the bound the schema still compiles and constrains
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": "JSON:", "max_tokens": 40, "temperature": 0,
        "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}},
                                        "required": ["a"], "additionalProperties": False},
                               "disable_any_whitespace": True}}, timeout=120)
    assert r.status_code == 200
    assert isinstance(json.loads(r.json()["choices"][0]["text"])["a"], int)


# -- 4. a dead engine ---------------------------------------------------------------------------------


def test_a_dead_engine_answers_503_and_the_server_exits(tiny_model_dir: Any, start_server: Any) -> None:
    path, _ = tiny_model_dir("llama")
    server = start_server([str(path), "--skip-tokenizer-init", "--max-model-len", "128"])
    core_pid = int(server.output().split("engine core 0 runs in process ", 1)[1].split()[0])
    os.kill(core_pid, signal.SIGKILL)
    statuses = []
    deadline = time.monotonic() + 30
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=5)
            statuses.append(r.status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert server.proc.poll() is not None, "the server outlived its engine"
    assert server.proc.returncode not in (0, None)
    assert 500 not in statuses and set(statuses) <= {200, 503}, statuses
    assert "the server exits so that its supervisor can restart it" in server.output()


# -- 5. start-up options -----------------------------------------------------------------------------


def _serve(args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_start_up_errors_are_one_line(tiny_model_dir: Any, tmp_path: Path) -> None:
    path, _ = tiny_model_dir("llama")  # max_position_embeddings 1024
    for length in ("2000", "100000000"):
        t = time.monotonic()
        done = _serve([str(path), "--skip-tokenizer-init", "--max-model-len", length])
        assert done.returncode == 1
        assert time.monotonic() - t < 60
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert f"error: max_model_len={length} is longer than this model's 1024 positions" in done.stderr
        assert "PAGODA_ALLOW_LONG_MAX_MODEL_LEN" in done.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    config = json.loads((path / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "hidden_size": "sixty-four"}))
    done = _serve([str(bad), "--skip-tokenizer-init"])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "error: Cannot read the model config" in done.stderr and "hidden_size" in done.stderr


def test_allowed_long_context_serves_and_sigterm_leaves_no_socket_dir(tiny_model_dir: Any, start_server: Any,
                                                                      tmp_path: Path) -> None:
    path, _ = tiny_model_dir("llama")
    server = start_server([str(path), "--skip-tokenizer-init", "--max-model-len", "2000"],
                          env={"PAGODA_ALLOW_LONG_MAX_MODEL_LEN": "1", "TMPDIR": str(tmp_path)})
    assert "PAGODA_ALLOW_LONG_MAX_MODEL_LEN" in server.output()
    # past the 1024 positions: RoPE's table grew with the context (before: IndexError, a 500)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * 1500, "max_tokens": 3, "ignore_eos": True},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("pagoda-core-")]
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(30)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("pagoda-core-")]


# -- 7. one final chunk per choice ---------------------------------------------------------------------


def test_many_concurrent_n_streams_send_one_finish_per_choice(server: Any) -> None:
    def stream(i: int) -> dict[int, int]:
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        # a stop string every sample meets at a different step
        body: dict[str, Any] = {"n": 3, "stream": True, "temperature": 1.0, "seed": i, "max_tokens": 8 + i % 13,
                                "stop": ["e"]}
        body.update({"prompt": f"Story {i}:"} if i % 2 else {"messages": [{"role": "user", "content": f"Story {i}"}]})
        finishes: dict[int, int] = {}
        with httpx.stream("POST", server.url + path, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
        return finishes

    from concurrent.futures import ThreadPoolExecutor

    # the choices of one request finish at different steps: before,
    # every later delta of the request repeated the finished choice's finish_reason
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(48)))
    for i, finishes in enumerate(results):
        assert finishes == {0: 1, 1: 1, 2: 1}, (i, finishes)


# -- 6. tool calls: the same answer streamed or not ----------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_required_tool_calls_cut_by_max_tokens_agree_streamed_or_not(server: Any) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Paris and in Rome?"}], "tools": WEATHER,
            "tool_choice": "required", "temperature": 0, "max_tokens": 60}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    plain = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    streamed: dict[int, list[str]] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                for call in choice["delta"].get("tool_calls") or []:
                    entry = streamed.setdefault(call["index"], ["", ""])
                    entry[0] += call.get("function", {}).get("name") or ""
                    entry[1] += call.get("function", {}).get("arguments") or ""
    assert plain, message  # before: tool_calls [] and the raw JSON as content when max_tokens cut it
    assert not message["content"]
    assert plain == [tuple(streamed[i]) for i in sorted(streamed)]


# -- 1b. a compile that passes the size bounds but is slow or big: stopped, bounded, cancelled ------------

# Size bounds off, so that the 10,000-property schema reaches the compiler (xgrammar 0.2.8: ~50 s and
# growing past 1 GB on the shared guest); the budgets below are what stops it.
_UNBOUNDED = {"max_schema_properties": 0, "max_schema_nodes": 0, "max_constraint_chars": 0}


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant (where an uninterruptible compile would burn)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / ticks
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        total += cpu.get(p, 0.0)
        stack.extend(c for c, parent in parents.items() if parent == p)
    return total


def _core_pid(server: Any) -> int:
    return int(server.output().split("engine core 0 runs in process ", 1)[1].split()[0])


def _quiet(pid: int, seconds: float = 3.0) -> float:
    """CPU seconds the engine core's process tree spends over ``seconds`` with no request in it."""
    before = _tree_cpu_seconds(pid)
    time.sleep(seconds)
    return _tree_cpu_seconds(pid) - before


@pytest.fixture(scope="module")
def budget_server(start_server: Any) -> Any:
    server = start_server(["--max-model-len", "512", "--structured-outputs-config",
                           json.dumps({**_UNBOUNDED, "compile_timeout": 5})])
    # the first constrained request starts the compile worker: not the budget's time
    r = httpx.post(server.url + "/v1/completions", json={**ORDINARY, "structured_outputs": {"json": _props(3)}},
                   timeout=300)
    assert r.status_code == 200, r.text
    return server


def test_a_slow_compile_is_killed_at_compile_timeout_and_is_a_400(budget_server: Any) -> None:
    server = budget_server
    with _Beside(server.url) as beside:
        t = time.monotonic()
        err = _error(httpx.post(server.url + "/v1/completions", json={
            **ORDINARY, "structured_outputs": {"json": _props(10_000)}}, timeout=300))
        waited = time.monotonic() - t
    assert "compile_timeout" in err["message"] and "5 s" in err["message"], err
    assert err["param"] == "structured_outputs", err
    assert waited < 60, waited  # before: a 200 with finish_reason "error" after 5 s, the compile still running
    assert beside.ordinary
    # the compile is gone, not left running in a thread of the engine core (before: ~50 s more of it)
    spent = _quiet(_core_pid(server))
    assert spent < 0.6, f"the engine core's process tree spent {spent:.2f} CPU s idle after the 400"


def test_a_compile_whose_client_left_is_killed(budget_server: Any) -> None:
    server = budget_server
    # a worker killed before is replaced on the next compile: start that one now, not inside the window
    r = httpx.post(server.url + "/v1/completions", json={**ORDINARY, "structured_outputs": {"json": _props(5)}},
                   timeout=300)
    assert r.status_code == 200, r.text
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json={
            **ORDINARY, "structured_outputs": {"json": _props(10_001)}}, timeout=1.5)
    time.sleep(0.5)  # the abort reaches the engine core
    spent = _quiet(_core_pid(server), 2.5)  # within compile_timeout (5 s): only the disconnect can stop it
    assert spent < 0.5, f"the engine core's process tree spent {spent:.2f} CPU s after the client left"
    # and the server still compiles and serves
    r = httpx.post(server.url + "/v1/completions", json={**ORDINARY, "structured_outputs": {"json": _props(4)}},
                   timeout=300)
    assert r.status_code == 200, r.text


def test_a_compile_over_its_memory_budget_is_a_400(start_server: Any) -> None:
    server = start_server(["--max-model-len", "512", "--structured-outputs-config",
                           json.dumps({**_UNBOUNDED, "compile_timeout": 300, "compile_memory_bytes": 150_000_000})])
    core = _core_pid(server)
    with _Beside(server.url) as beside:
        err = _error(httpx.post(server.url + "/v1/completions", json={
            **ORDINARY, "structured_outputs": {"json": _props(10_000)}}, timeout=300))
    assert "compile_memory_bytes" in err["message"] and "150000000" in err["message"], err
    assert beside.ordinary
    with open(f"/proc/{core}/status") as f:
        rss_kb = int(next(line for line in f if line.startswith("VmRSS")).split()[1])
    assert rss_kb < 2_000_000, rss_kb  # the compile's memory was the worker's, not the engine's
    r = httpx.post(server.url + "/v1/completions", json={**ORDINARY, "structured_outputs": {"json": _props(4)}},
                   timeout=300)
    assert r.status_code == 200, r.text
