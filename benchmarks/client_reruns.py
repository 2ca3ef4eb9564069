"""Real clients against a running ``pagoda serve``: what works and what does not (docs/server.md, tested clients).

    pagoda serve --host 127.0.0.1 --port 8000 --enable-auto-tool-choice --tool-call-parser hermes &
    python -m benchmarks.client_reruns --base-url http://127.0.0.1:8000 --tokenizer DIR

Each client is used as its documentation shows (chat, completions, streaming, tools, structured
outputs where it has them); a client that is not installed is reported as such. ``--tokenizer`` is a
HF directory with the served model's tokenizer (lm-eval and guidellm count tokens with it). Prints
one Markdown row per check: client, version, check, ok / FAIL and a short note.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
Check = Callable[[], str]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def openai_checks(base: str, model: str) -> dict[str, Check]:
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Name a colour."}]

    def chat() -> str:
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        return repr(r.choices[0].message.content)

    def completions() -> str:
        r = client.completions.create(model=model, prompt="The sky is", max_tokens=8, temperature=0, logprobs=2)
        return f"{r.choices[0].text!r}, {len(r.choices[0].logprobs.tokens)} logprob tokens"

    def stream() -> str:
        parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=msgs, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}) if c.choices]
        return f"{len(parts)} chunks: {''.join(parts)!r}"

    def tools_named() -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
        call = r.choices[0].message.tool_calls[0]
        return f"{call.function.name}({call.function.arguments})"

    def tools_auto() -> str:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
            tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=60, temperature=0)
        m = r.choices[0].message
        return f"tool_calls={[c.function.name for c in m.tool_calls or []]}, content={m.content!r:.60}"

    def parse() -> str:
        r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "A person as JSON."}],
                                          response_format=Person, max_tokens=80, temperature=0)
        return repr(r.choices[0].message.parsed)

    return {"chat": chat, "completions + logprobs": completions, "chat streaming": stream,
            "tools (named tool_choice)": tools_named, "tools (auto, hermes parser)": tools_auto,
            "structured outputs (parse, pydantic)": parse}


def langchain_checks(base: str, model: str) -> dict[str, Check]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI, OpenAI

    chat_model = ChatOpenAI(model=model, base_url=base + "/v1", api_key="unused", max_tokens=40, temperature=0,
                            max_retries=0)

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return "sunny"

    def invoke() -> str:
        return repr(chat_model.invoke("Name a colour.").content)

    def stream() -> str:
        parts = [c.content for c in chat_model.stream("Name a colour.")]
        return f"{len(parts)} chunks"

    def completions() -> str:
        return repr(OpenAI(model=model, base_url=base + "/v1", api_key="unused", max_tokens=8, temperature=0,
                           max_retries=0).invoke("The sky is"))

    def tools() -> str:
        m = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
        return repr(m.tool_calls)

    def structured(method: str) -> Check:
        def run() -> str:
            # json_mode constrains to any JSON object, so the prompt names the fields and the budget is larger
            bound = chat_model.bind(max_tokens=120).with_structured_output(Person, method=method)
            return repr(bound.invoke("A person as JSON with the keys name (string) and age (integer)."))
        return run

    return {"ChatOpenAI.invoke": invoke, "ChatOpenAI.stream": stream, "OpenAI (completions)": completions,
            "bind_tools (named tool_choice)": tools,
            "with_structured_output (json_schema)": structured("json_schema"),
            "with_structured_output (function_calling)": structured("function_calling"),
            "with_structured_output (json_mode)": structured("json_mode")}


def litellm_checks(base: str, model: str) -> dict[str, Check]:
    import litellm

    common: dict[str, Any] = {"model": f"hosted_vllm/{model}", "api_base": base + "/v1", "api_key": "unused",
                              "max_tokens": 40, "temperature": 0}
    msgs = [{"role": "user", "content": "Name a colour."}]

    def chat() -> str:
        return repr(litellm.completion(messages=msgs, **common).choices[0].message.content)

    def stream() -> str:
        parts = [c.choices[0].delta.content or "" for c in litellm.completion(messages=msgs, stream=True, **common)]
        return f"{len(parts)} chunks"

    def text() -> str:
        r = litellm.text_completion(prompt="The sky is", **common)
        return repr(r.choices[0].text)

    def tools() -> str:
        r = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **common)
        call = r.choices[0].message.tool_calls[0]
        return f"{call.function.name}({call.function.arguments})"

    def structured() -> str:
        r = litellm.completion(messages=[{"role": "user", "content": "A person as JSON."}], response_format=Person,
                               **{**common, "max_tokens": 80})
        return repr(Person.model_validate_json(r.choices[0].message.content))

    return {"completion (chat)": chat, "completion stream": stream, "text_completion": text,
            "tools (named tool_choice)": tools, "response_format (pydantic)": structured}


def outlines_checks(base: str, model: str) -> dict[str, Check]:
    import openai
    import outlines
    from outlines.types import CFG, Regex

    m = outlines.from_vllm(openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0), model)
    return {
        "pydantic": lambda: repr(Person.model_validate_json(m("A person as JSON.", Person, max_tokens=80))),
        "regex": lambda: repr(m("A year:", Regex(r"(19|20)[0-9]{2}"), max_tokens=8)),
        "choice (Literal)": lambda: repr(m("Yes or no?", __import__("typing").Literal["yes", "no"], max_tokens=4)),
        "CFG (Lark)": lambda: repr(m("Is it?", CFG("?start: \"yes\" | \"no\""), max_tokens=4)),
        "stream": lambda: f"{len(list(m.stream('Say hi.', max_tokens=8)))} chunks",
    }


def _cli(args: list[str], timeout: float = 600, cwd: Path | None = None) -> str:
    run = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if run.returncode != 0:
        raise RuntimeError((run.stderr or run.stdout).strip().splitlines()[-1][:300])
    return run.stdout


def lm_eval_checks(base: str, model: str, tokenizer: str) -> dict[str, Check]:
    tasks = Path(__file__).resolve().parents[1] / "tests" / "vllm_compat" / "lm_eval_tasks"

    def run(kind: str, endpoint: str, task: str) -> Check:
        def check() -> str:
            out = tempfile.mkdtemp()
            args = [sys.executable, "-m", "lm_eval", "--model", kind, "--tasks", task, "--include_path", str(tasks),
                    "--output_path", out, "--model_args",
                    f"model={model},base_url={base}{endpoint},tokenizer_backend=huggingface,tokenizer={tokenizer},"
                    "num_concurrent=1,max_retries=1,tokenized_requests=False"]
            if kind == "local-chat-completions":
                args.append("--apply_chat_template")
            # the tasks' data_files are relative to their folder
            text = _cli(args, timeout=900, cwd=tasks)
            rows = [line for line in text.splitlines() if task in line and "|" in line]
            return re.sub(r"\s+", " ", rows[0]) if rows else text.strip().splitlines()[-1]
        return check

    return {"local-completions, multiple choice (loglikelihood)": run("local-completions", "/v1/completions",
                                                                      "pagoda_capitals_mc"),
            "local-completions, generate_until": run("local-completions", "/v1/completions", "pagoda_capitals_gen"),
            "local-chat-completions, generate_until": run("local-chat-completions", "/v1/chat/completions",
                                                          "pagoda_capitals_gen")}


def guidellm_checks(base: str, model: str, tokenizer: str) -> dict[str, Check]:
    def bench() -> str:
        out = Path(tempfile.mkdtemp()) / "guidellm.json"
        # the console script of the environment running this harness; guidellm 0.8's `run` takes kind=... specs
        _cli([str(Path(sys.executable).parent / "guidellm"), "run",
              "--backend", f"kind=openai_http,target={base},model={model}", "--profile", "kind=synchronous",
              "--constraint", "kind=max_requests,count=4", "--tokenizer", f"kind=hf_auto,model={tokenizer}",
              "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
              "--output", f"kind=json,path={out}", "--disable-progress"], timeout=600)
        report = json.loads(out.read_text())
        return f"json report, {len(report.get('benchmarks', []))} benchmark(s)"
    return {"run, synchronous profile, synthetic data (openai_http)": bench}


# client -> its distribution (for the version)
CLIENTS: dict[str, str] = {
    "openai SDK": "openai",
    "LangChain (langchain-openai)": "langchain-openai",
    "LiteLLM": "litellm",
    "Outlines (from_vllm, server)": "outlines",
    "lm-evaluation-harness": "lm-eval",
    "guidellm": "guidellm",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--tokenizer", required=True, help="HF directory with the served model's tokenizer")
    parser.add_argument("--only", nargs="*", help="client names (substrings) to run")
    args = parser.parse_args()
    import httpx

    model = httpx.get(args.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    builders: dict[str, Callable[[], dict[str, Check]]] = {
        "openai SDK": lambda: openai_checks(args.base_url, model),
        "LangChain (langchain-openai)": lambda: langchain_checks(args.base_url, model),
        "LiteLLM": lambda: litellm_checks(args.base_url, model),
        "Outlines (from_vllm, server)": lambda: outlines_checks(args.base_url, model),
        "lm-evaluation-harness": lambda: lm_eval_checks(args.base_url, model, args.tokenizer),
        "guidellm": lambda: guidellm_checks(args.base_url, model, args.tokenizer),
    }
    print("| client | version | check | result | note |\n|---|---|---|---|---|")
    for name, dist in CLIENTS.items():
        if args.only and not any(o.lower() in name.lower() for o in args.only):
            continue
        version = _version(dist)
        if not version:
            print(f"| {name} | not installed | | | |", flush=True)
            continue
        try:
            checks = builders[name]()
        except Exception as exc:  # an import error of the client itself
            print(f"| {name} | {version} | import | FAIL | {type(exc).__name__}: {str(exc)[:200]} |", flush=True)
            continue
        for check, fn in checks.items():
            try:
                note, status = fn(), "ok"
            except Exception as exc:
                note, status = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}", "FAIL"
                if os.environ.get("CLIENT_RERUNS_TRACEBACK"):
                    traceback.print_exc()
            note = note.replace("|", "\\|").replace("\n", " ")[:240]
            print(f"| {name} | {version} | {check} | {status} | {note} |", flush=True)


if __name__ == "__main__":
    main()
