"""`pagoda run-batch`: the batch envelope, its edge cases, the engine behind it, and the command itself."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from pagoda.config import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.cli.main import app
from pagoda.entrypoints.openai.run_batch import (
    BatchFileError,
    check_files,
    output_line,
    parse_line,
    run_batch,
)
from pagoda.entrypoints.openai.serving_common import ServingContext
from pagoda.sampling_params import RequestOutputKind, SamplingParams


def _line(custom_id: str, url: str = "/v1/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


# -- the envelope -------------------------------------------------------------------------------------


def test_parse_line_accepts_the_openai_envelope() -> None:
    seen: dict[str, int] = {}
    line = parse_line(_line("a", prompt=[1, 2]), 1, seen)
    assert line.error is None
    assert (line.custom_id, line.url, line.body) == ("a", "/v1/completions", {"prompt": [1, 2]})
    assert seen == {"a": 1}


@pytest.mark.parametrize(("raw", "status", "param", "custom_id", "fragment"), [
    (b"{not json", 400, None, None, "not valid JSON"),
    (b"\xff\xfe", 400, None, None, "not valid JSON"),
    (b"[1, 2]", 400, None, None, "must be a JSON object"),
    (b'{"method": "POST", "url": "/v1/completions", "body": {}}', 400, "custom_id", None, "custom_id"),
    (b'{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}', 400, "custom_id", None, "custom_id"),
    (b'{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}', 405, "method", "x", "POST"),
    (b'{"custom_id": "x", "method": "POST", "url": 3, "body": {}}', 400, "url", "x", "url"),
    (b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": "hi"}', 400, "body", "x", "body"),
    (b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}', 400, "extra", "x",
     "unknown field"),
])
def test_parse_line_refuses_a_bad_envelope(raw: bytes, status: int, param: str | None, custom_id: str | None,
                                           fragment: str) -> None:
    line = parse_line(raw, 3, {})
    assert line.error is not None
    assert (line.error.status, line.error.param, line.custom_id) == (status, param, custom_id)
    assert fragment in line.error.message


def test_a_repeated_custom_id_is_an_error_naming_the_first_line() -> None:
    seen: dict[str, int] = {}
    assert parse_line(_line("dup", prompt="a"), 2, seen).error is None
    again = parse_line(_line("dup", prompt="b"), 5, seen)
    assert again.error is not None and "line 2" in again.error.message and again.custom_id == "dup"
    assert seen == {"dup": 2}


def test_output_line_shape() -> None:
    ok = output_line("c1", 200, {"id": "cmpl-1", "choices": []}, None)
    assert set(ok) == {"id", "custom_id", "response", "error"}
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "cmpl-1", "body": {"id": "cmpl-1", "choices": []}}
    assert output_line("c1", 200, None, None)["id"] != ok["id"]


def test_check_files(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", prompt="x") + "\n")
    check_files(str(src), str(tmp_path / "out.jsonl"))
    for inp, out, fragment in [
        ("https://example.com/in.jsonl", str(tmp_path / "o"), "never downloads"),
        (str(src), "s3://bucket/out.jsonl", "never downloads"),
        ("-", str(tmp_path / "o"), "stdin"),
        (str(src), "-", "stdin"),
        (str(tmp_path / "missing.jsonl"), str(tmp_path / "o"), "does not exist"),
        (str(src), str(src), "destroy the input"),
        (str(src), str(tmp_path), "is a directory"),
        (str(src), str(tmp_path / "no" / "such" / "dir.jsonl"), "does not exist"),
    ]:
        with pytest.raises(BatchFileError, match=fragment):
            check_files(inp, out)


def test_cli_refuses_bad_files_before_loading_a_model(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", prompt="x") + "\n")
    runner = CliRunner()
    result = runner.invoke(app, ["run-batch", "-i", "http://host/in.jsonl", "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 1 and "never downloads" in result.output
    result = runner.invoke(app, ["run-batch", "-i", str(src), "-o", str(src)])
    assert result.exit_code == 1 and "destroy the input" in result.output
    result = runner.invoke(app, ["run-batch", "-i", str(src)])
    assert result.exit_code == 2 and "--output-file" in result.output
    result = runner.invoke(app, ["run-batch", "-i", str(src), "-o", str(tmp_path / "o.jsonl"),
                                 "--tool-call-parser", "nope"])
    assert result.exit_code == 1 and "tool call parser 'nope' is not registered" in result.output
    assert not (tmp_path / "o.jsonl").exists()


# -- through the serving handlers on a real engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Any) -> Any:
    path, model = tiny_model_dir("llama")
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=128,
                                                  max_num_seqs=4))
    ctx = ServingContext(engine=engine, served_model_names=["tiny"], max_model_len=engine.max_model_len,
                         max_logprobs=engine.model_config.max_logprobs, max_n=8)
    yield ctx, model
    engine.shutdown()


def _run(ctx: ServingContext, lines: list[str], max_in_flight: int) -> tuple[Any, list[dict[str, Any]]]:
    written: list[dict[str, Any]] = []
    summary = asyncio.run(run_batch(ctx, [ln.encode() for ln in lines], written.append, max_in_flight))
    return summary, written


def _greedy_ids(out: dict[str, Any]) -> list[int]:
    tokens = out["response"]["body"]["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


async def _direct_greedy(engine: AsyncLLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    outs = [o async for o in engine.generate({"prompt_token_ids": prompt}, params, f"direct-{prompt}")]
    return list(outs[-1].outputs[0].token_ids)


def test_batch_runs_concurrently_keeps_input_order_and_answers_what_the_engine_answers(tiny: Any) -> None:
    ctx, _ = tiny
    prompts = [[1 + i, 7, 3 * i % 50 + 2] for i in range(10)]
    lines = [_line(f"req-{i}", prompt=p, max_tokens=5, temperature=0, ignore_eos=True, logprobs=0,
                   return_tokens_as_token_ids=True, model="tiny") for i, p in enumerate(prompts)]
    summary, written = _run(ctx, lines, max_in_flight=3)
    assert (summary.total, summary.succeeded, summary.failed) == (10, 10, 0)
    assert [o["custom_id"] for o in written] == [f"req-{i}" for i in range(10)]

    async def direct() -> list[list[int]]:
        return [await _direct_greedy(ctx.engine, p, 5) for p in prompts]

    expected = asyncio.run(direct())
    for out, ids in zip(written, expected):
        assert out["error"] is None and out["response"]["status_code"] == 200
        body = out["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert _greedy_ids(out) == ids
    assert len({tuple(ids) for ids in expected}) > 1  # different prompts, different answers: no mix-up hides


def test_bad_lines_get_error_lines_and_never_stop_the_batch(tiny: Any) -> None:
    ctx, _ = tiny
    good: dict[str, Any] = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    lines = [
        _line("ok-1", **good),
        "this is not json",
        "",  # blank lines are skipped, not answered
        _line("chat", "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
        _line("emb", "/v1/embeddings", input="hi"),
        _line("nowhere", "/v1/responses", input="hi"),
        _line("stream", **good, stream=True),
        # an unknown field is ignored (as vLLM); a known one of the wrong shape is refused by name
        _line("prediction", prompt=[1], prediction={"type": "content"}),
        _line("model", prompt=[1], model="gpt-4"),
        _line("long", prompt=list(range(1, 130))),
        _line("oov", prompt=[10**6]),
        _line("ok-1", **good),
        _line("ok-2", **good),
    ]
    summary, written = _run(ctx, lines, max_in_flight=2)
    by_id = {o["custom_id"]: o for o in written if o["custom_id"] not in (None, "ok-1")}
    assert len(written) == 12 and summary.total == 12
    assert (summary.succeeded, summary.failed) == (2, 10)
    assert summary.failed_lines == [2, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert [o["custom_id"] for o in written] == [
        "ok-1", None, "chat", "emb", "nowhere", "stream", "prediction", "model", "long", "oov", "ok-1", "ok-2"]

    def status(o: dict[str, Any]) -> tuple[int, str]:
        assert o["error"] is not None and o["response"]["body"]["error"]["message"] == o["error"]["message"]
        return o["response"]["status_code"], o["error"]["message"]

    assert status(written[1])[0] == 400 and "not valid JSON" in status(written[1])[1]
    assert status(by_id["chat"])[0] == 400 and "tokenizer" in status(by_id["chat"])[1]
    assert status(by_id["emb"])[0] == 404 and "pooling model" in status(by_id["emb"])[1]
    assert by_id["emb"]["error"]["code"] == "model_not_supported"
    assert status(by_id["nowhere"])[0] == 404 and "/v1/chat/completions" in status(by_id["nowhere"])[1]
    assert status(by_id["stream"])[0] == 400 and "cannot stream" in status(by_id["stream"])[1]
    assert status(by_id["prediction"])[0] == 400 and "prediction" in status(by_id["prediction"])[1]
    assert status(by_id["model"])[0] == 404 and "gpt-4" in status(by_id["model"])[1]
    assert status(by_id["long"])[0] == 400 and "maximum context length" in status(by_id["long"])[1]
    assert status(by_id["oov"])[0] == 400
    assert status(written[10])[0] == 400 and "already used on line 1" in status(written[10])[1]
    assert written[0]["response"]["status_code"] == 200 and written[11]["response"]["status_code"] == 200
    assert written[0]["response"]["body"]["choices"][0]["finish_reason"] == "length"


def test_a_byte_order_mark_and_crlf_line_ends_are_accepted(tiny: Any) -> None:
    ctx, _ = tiny
    a, b = _line("a", prompt=[1, 2], max_tokens=2), _line("b", prompt=[3, 4], max_tokens=2)
    as_read: list[bytes] = [b"\xef\xbb\xbf" + a.encode() + b"\r\n", b.encode() + b"\r\n", b"\r\n"]
    as_text: list[str] = ["\ufeff" + a + "\r\n", b + "\r\n", "\r\n"]
    raws: list[list[bytes] | list[str]] = [as_read, as_text]
    for raw in raws:
        written: list[dict[str, Any]] = []
        summary = asyncio.run(run_batch(ctx, raw, written.append, 4))
        assert (summary.total, summary.succeeded) == (2, 2)
        assert [o["custom_id"] for o in written] == ["a", "b"]


def test_max_in_flight_must_be_positive(tiny: Any) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        _run(tiny[0], [], max_in_flight=0)


# -- the command, against the HTTP server on the same model ------------------------------------------------


def test_run_batch_command_answers_what_the_http_server_answers(default_model_server: Any, tmp_path: Path) -> None:
    chat: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 10, "temperature": 0}
    cmpl: dict[str, Any] = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        _line("chat", "/v1/chat/completions", **chat),
        _line("cmpl", **cmpl),
        _line("emb", "/v1/embeddings", input="hi"),
    ]) + "\n")
    dst = tmp_path / "out.jsonl"
    # the server fixture runs with this context length; the batch must see the same model
    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli.main", "run-batch", "-i", str(src), "-o", str(dst),
         "--max-model-len", "512", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "3 request(s): 2 succeeded, 1 failed (input lines 3)" in proc.stderr
    out = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "cmpl", "emb"]
    over_http = {
        "chat": httpx.post(default_model_server.url + "/v1/chat/completions", json=chat, timeout=120).json(),
        "cmpl": httpx.post(default_model_server.url + "/v1/completions", json=cmpl, timeout=120).json(),
    }
    for o in out[:2]:
        body, expected = o["response"]["body"], over_http[o["custom_id"]]
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == body["id"]
        assert body["object"] == expected["object"] and body["model"] == expected["model"]
        assert body["choices"] == expected["choices"] and body["usage"] == expected["usage"]
    assert out[1]["response"]["body"]["choices"][0]["text"]
    assert out[2]["response"]["status_code"] == 404 and out[2]["error"]["code"] == "model_not_supported"
