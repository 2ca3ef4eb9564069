"""Drop-in for vLLM's clients and deployments (issue 32), driven over a real `pagoda serve` socket.

A tiny random Llama with the default model's tokenizer serves the module, with a chat template that writes
``reasoning_effort`` / ``enable_thinking`` into the prompt so a test can see what reached the template.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

MODEL = "tiny-dropin"
USER = [{"role": "user", "content": "Hi"}]
# the prompt shows what the template was given: effort=<value or unset>, thinking=<value or unset>
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }}\n"
            "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tf

    from pagoda.model_loader import resolve_model_path
    from pagoda.model_loader.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path(None))
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-dropin")
    tf.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / "template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(start_server: Any, tiny_chat_model: Path) -> Any:
    return start_server([str(tiny_chat_model), "--served-model-name", MODEL, "--max-model-len", "256",
                         "--num-kv-blocks", "64", "--max-num-seqs", "4",
                         "--chat-template", str(tiny_chat_model / "template.jinja"),
                         "--enable-tokenizer-info-endpoint", "--vllm-metric-names"])


@pytest.fixture(scope="module")
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _prompt_text(body: dict[str, Any]) -> str:
    """The rendered prompt, read back from prompt_logprobs' decoded tokens."""
    return "".join(next(iter(e.values()))["decoded_token"] for e in body["prompt_logprobs"][1:])


def _chat(server: Any, **body: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": USER, "max_tokens": 2, "temperature": 0, **body}, timeout=60)


# -- 1: request fields pagoda does not know ----------------------------------------------------------


def test_fields_that_cannot_change_the_output_are_accepted_and_logged_once(client: openai.OpenAI,
                                                                            server: Any) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, temperature=0, metadata={"job": "a"}, store=False,
            service_tier="auto", user="u1", prompt_cache_key="k", safety_identifier="s",
            extra_body={"not_an_openai_field": 1})
        assert out.choices[0].message.content == plain.choices[0].message.content
    done = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                     extra_body={"metadata": {"job": "a"}, "store": True})
    assert done.choices[0].text is not None
    log = server.output()
    lines = [line for line in log.splitlines() if "ChatCompletionRequest: request fields ignored" in line]
    assert len(lines) == 1, log
    for name in ("metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                 "not_an_openai_field"):
        assert name in lines[0]
    assert "CompletionRequest: request fields ignored" in log


def test_null_fields_are_accepted(server: Any) -> None:
    r = _chat(server, audio=None, prediction=None, web_search_options=None, modalities=None, verbosity=None)
    assert r.status_code == 200, r.text
    assert _chat(server, modalities=["text"]).status_code == 200


@pytest.mark.parametrize(("field", "value", "says"), [
    ("modalities", ["text", "audio"], "generates text only"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio output"),
    ("web_search_options", {}, "web search"),
    ("verbosity", "low", "verbosity"),
])
def test_fields_pagoda_cannot_do_are_refused_by_name(client: openai.OpenAI, field: str, value: Any,
                                                     says: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, extra_body={field: value})
    err = exc.value.body
    assert err["param"] == field and says in err["message"], err


@pytest.mark.parametrize(("effort", "kwargs", "expected"), [
    (None, None, "effort=unset thinking=unset"),
    ("low", None, "effort=low thinking=True"),
    ("none", None, "effort=none thinking=False"),
    ("high", {"enable_thinking": False}, "effort=high thinking=False"),  # the request's own kwargs win
])
def test_reasoning_effort_reaches_the_chat_template(server: Any, effort: str | None, kwargs: dict[str, Any] | None,
                                                    expected: str) -> None:
    body: dict[str, Any] = {"prompt_logprobs": 0}
    if effort is not None:
        body["reasoning_effort"] = effort
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    r = _chat(server, **body)
    assert r.status_code == 200, r.text
    assert expected in _prompt_text(r.json())


def test_reasoning_effort_through_the_openai_sdk(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, reasoning_effort="low",
                                         extra_body={"prompt_logprobs": 0})
    assert "effort=low" in _prompt_text(out.model_dump())
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       extra_body={"reasoning_effort": "extreme"})
    assert exc.value.body["param"] == "reasoning_effort"


# -- 9: completions logprobs include the sampled token -----------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI, stream: bool) -> None:
    # a random model at temperature 1 samples outside the top 1 most steps
    kwargs: dict[str, Any] = dict(model=MODEL, prompt="Hi", max_tokens=16, temperature=1.0, seed=7, logprobs=1)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True))
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        tops = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
        logprobs = [x for c in chunks if c.choices and c.choices[0].logprobs
                    for x in c.choices[0].logprobs.token_logprobs]
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, tops, logprobs = lp.tokens, lp.top_logprobs, lp.token_logprobs
    assert len(tokens) == len(tops) == 16
    for tok, top, logprob in zip(tokens, tops, logprobs, strict=True):
        assert tok in top and top[tok] == pytest.approx(logprob) and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in tops), tops


def test_completion_logprobs_zero_is_the_sampled_token_alone(client: openai.OpenAI) -> None:
    lp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=1.0, seed=7,
                                   logprobs=0).choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[tok] for tok in lp.tokens]


# -- 4: /tokenizer_info, /ping, /v1/models/{id} ---------------------------------------------------------


def test_tokenizer_info(server: Any, tiny_chat_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_model)
    r = httpx.get(server.url + "/tokenizer_info", timeout=10)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
    assert info["chat_template"] == TEMPLATE  # the server's --chat-template, not the tokenizer's own
    assert info["added_tokens_decoder"][str(tok.eos_token_id)]["content"] == tok.eos_token
    assert str(tiny_chat_model) not in r.text  # nothing of the server's disk


def test_ping_answers_as_health(server: Any) -> None:
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.post(server.url + "/ping").status_code == 200


def test_retrieve_model(client: openai.OpenAI) -> None:
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("org/not-served")
    assert exc.value.body["code"] == "model_not_found"


# -- 5: vLLM's classic entrypoint ----------------------------------------------------------------------

API_SERVER = ("-m", "pagoda.entrypoints.openai.api_server")


def test_api_server_module_serves_with_model_flag(start_server: Any, tiny_chat_model: Path) -> None:
    server = start_server(["--model", str(tiny_chat_model), "--served-model-name", "classic", "--max-model-len", "128",
                           "--num-kv-blocks", "16", "--max-num-seqs", "2"], entrypoint=API_SERVER)
    r = httpx.post(server.url + "/v1/completions", json={"model": "classic", "prompt": "Hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    # vLLM serves /tokenizer_info only with --enable-tokenizer-info-endpoint
    assert httpx.get(server.url + "/tokenizer_info").status_code == 404
    # vLLM's metric names only with --vllm-metric-names
    metrics = httpx.get(server.url + "/metrics").text
    assert "pagoda:request_success_total" in metrics and "vllm:" not in metrics


def test_api_server_module_help_lists_every_serve_option() -> None:
    out = subprocess.run([sys.executable, *API_SERVER, "--help"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    for flag in ("--model", "--port", "--api-key", "--max-model-len", "--enable-tokenizer-info-endpoint"):
        assert flag in out.stdout


def test_model_given_twice_differently_is_an_error(tiny_chat_model: Path) -> None:
    out = subprocess.run([sys.executable, *API_SERVER, str(tiny_chat_model), "--model", "other/model"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "given twice" in out.stderr, out.stderr


# -- 6: vLLM's flags ----------------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pagoda:{name}{{"))


def test_vllm_flags_config_file_uds_sizes(tiny_chat_model: Path, tmp_path: Path) -> None:
    import time

    sock = tmp_path / "pagoda.sock"
    config = tmp_path / "config.yaml"
    # vLLM's file: dashes or underscores, `model:` for the positional; the command line wins over it
    config.write_text(f"model: {tiny_chat_model}\nserved-model-name: uds-model\nmax_model_len: 1k\n"
                      "num-kv-blocks: 32\nmax-num-seqs: 2\ndisable-log-stats: true\nswap-space: 4\n")
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--config", str(config),
                             "--uds", str(sock), "--max-model-len", "0.3k", "--disable-log-requests"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://pagoda", timeout=60)
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.seek(0) or log.read()
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "no answer on the socket"
            time.sleep(0.25)
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["max_model_len"]) for c in cards] == [("uds-model", 300)]
        r = client.post("/v1/completions", json={"model": "uds-model", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        # --disable-log-stats: the engine records nothing
        assert _metric(client.get("/metrics").text, "request_success_total") == 0.0
        log.seek(0)
        assert "--swap-space 4 has no effect" in log.read()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.mark.parametrize(("args", "says"), [
    (["--max-model-len", "1.5K"], "decimal multiplier"),
    (["--max-model-len", "2x"], "not a number"),
    (["--config", "missing.yaml"], "cannot read"),
])
def test_vllm_flag_errors_say_why(args: list[str], says: str) -> None:
    out = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", *args],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_config_file_names_unknown_options(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("max-model-len: 2k\nnot-an-option: 1\n")
    out = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 2 and "not-an-option" in out.stderr, out.stderr


def test_human_readable_int() -> None:
    from pagoda.entrypoints.cli.vllm_flags import human_readable_int

    assert [human_readable_int(t) for t in ("2048", "2k", "2K", "25.6k", "1M", "1g")] == [
        2048, 2000, 2048, 25600, 2**20, 10**9]
    for bad in ("1.5K", "0.0001k", "-1", "k"):
        with pytest.raises(ValueError):
            human_readable_int(bad)


# -- 7: help --------------------------------------------------------------------------------------------


def _serve_help(*args: str) -> subprocess.CompletedProcess[str]:
    # piped, at 80 columns: where rich's tables cut flag names ("--enable-prefix-ca…")
    return subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})


def test_serve_help_has_every_flag_in_full_at_80_columns() -> None:
    import typer

    from pagoda.entrypoints.cli.main import app

    flags = [o for p in typer.main.get_command(app).commands["serve"].params  # type: ignore[attr-defined]
             for o in [*p.opts, *p.secondary_opts] if o.startswith("--")]
    assert "--enable-prefix-caching" in flags and len(flags) > 60
    out = _serve_help("--help")
    assert out.returncode == 0, out.stderr
    words = set(out.stdout.replace(",", " ").replace("/", " ").split())
    assert [f for f in flags if f not in words] == []


def test_help_for_one_group_or_flag() -> None:
    groups = _serve_help("--help=listgroup").stdout.split()
    assert {"Frontend", "ModelConfig", "CacheConfig", "SchedulerConfig"} <= set(groups)
    cache = _serve_help("--help=CacheConfig").stdout
    assert "--enable-prefix-caching" in cache and "--port" not in cache and "--max-model-len" not in cache
    one = _serve_help("--help=max-model-len").stdout
    assert "--max-model-len" in one and "--port" not in one
    everything = _serve_help("--help=all").stdout
    assert "--port" in everything and "--enable-prefix-caching" in everything
    none = _serve_help("--help=no-such-flag")
    assert none.returncode == 2 and "Frontend" in none.stderr


# -- 10: vLLM's metric names ------------------------------------------------------------------------------


def test_vllm_metric_names_beside_pagodas(client: openai.OpenAI, server: Any) -> None:
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    samples = [line for line in httpx.get(server.url + "/metrics").text.splitlines() if not line.startswith("#")]
    ours = {line.split(":", 1)[1] for line in samples if line.startswith("pagoda:")}
    theirs = {line.split(":", 1)[1] for line in samples if line.startswith("vllm:")}
    assert ours == theirs and len(ours) > 20  # the same samples, the same values
    names = {sample.split("{", 1)[0].split(" ", 1)[0] for sample in theirs}
    for name in ("request_success_total", "prompt_tokens_total", "generation_tokens_total", "num_requests_running",
                 "kv_cache_usage_perc", "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_count"):
        assert name in names
    assert _metric("\n".join(samples), "generation_tokens_total") >= 3


# -- 8: logs --------------------------------------------------------------------------------------------


def test_unreachable_hub_fails_fast_with_one_clear_error(tmp_path: Path) -> None:
    # not offline by HF_HUB_OFFLINE: the hub is just unreachable (a closed local port stands for no network)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9", COLUMNS="200")
    out = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", "no-org/no-model",
                          "--port", "0"], capture_output=True, text=True, timeout=170, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log
    assert "cannot be reached" in log and "no-org/no-model" in log and "http://127.0.0.1:9" in log
    # huggingface_hub's retries (1 + 2 + 4 + 8 + 8 s of backoff, each logged) are what made it slow: none is made.
    # Not timed here: the start-up before the hub lookup alone takes 4-40 s on the shared 2-core test machine.
    assert "Retrying" not in log, log[-3000:]


def test_llm_logs_what_it_loaded_and_its_kv_cache(tiny_chat_model: Path) -> None:
    code = (f"from pagoda import LLM; LLM(model={str(tiny_chat_model)!r}, max_model_len=128, num_kv_blocks=16, "
            "max_num_seqs=2)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    assert "INFO" in out.stderr and "loaded LlamaForCausalLM" in out.stderr, out.stderr
    assert "KV cache" in out.stderr and "16 blocks" in out.stderr, out.stderr


def test_llm_leaves_an_applications_logging_alone(tiny_chat_model: Path) -> None:
    code = ("import logging; logging.basicConfig(level=logging.WARNING); from pagoda import LLM; "
            f"LLM(model={str(tiny_chat_model)!r}, max_model_len=128, num_kv_blocks=16, max_num_seqs=2)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr
    assert "INFO" not in out.stderr, out.stderr


# -- 2: Lark grammars -----------------------------------------------------------------------------------

YES_NO = [
    '?start: "yes" | "no"',
    "start: answer\nanswer: 'yes'\n      | 'no'   // Outlines' users write single quotes",
]


@pytest.mark.parametrize("grammar", YES_NO)
def test_lark_grammar_constrains_the_output(server: Any, grammar: str) -> None:
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "Is it?", "max_tokens": 5, "temperature": 1.0, "seed": 1, "n": 4,
        "structured_outputs": {"grammar": grammar}})
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}


def test_lark_through_outlines_cfg(server: Any) -> None:
    outlines = pytest.importorskip("outlines")
    from outlines.types import CFG

    model = outlines.from_vllm(openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), MODEL)
    arithmetic = '?start: expr\n?expr: NUMBER ("+" NUMBER)*\nNUMBER: /[1-9]/\n'
    for _ in range(3):
        text = model("1+2=", CFG(arithmetic), max_tokens=8, temperature=1.0)
        assert text and all(part in "123456789" and part for part in text.split("+")), text
    assert model("Is it?", CFG(YES_NO[1]), max_tokens=5) in ("yes", "no")


def test_lark_through_llguidance_with_the_real_tokenizer(tiny_chat_model: Path) -> None:
    pytest.importorskip("pagoda_structured_llguidance")
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagoda_structured_llguidance.backend import grammar_spec

    tok = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tiny_chat_model))
    for grammar in YES_NO:
        matcher = llguidance.LLMatcher(tok, grammar_spec(grammar))
        assert not matcher.is_error(), matcher.get_error()
        assert all(matcher.consume_token(t) for t in tok.tokenize_str("no")) and matcher.is_accepting()
