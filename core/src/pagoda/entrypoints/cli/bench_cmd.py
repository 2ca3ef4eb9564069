"""`pagoda bench throughput|latency|serve|startup` (vLLM's `vllm bench`)."""

from __future__ import annotations

from typing import Any

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.engine_options import with_engine_options

app = typer.Typer(help="Benchmarks: offline throughput, batch latency, online serving, start-up.", no_args_is_help=True)


def _dataset(name: str, path: str | None, num_prompts: int, input_len: int, output_len: int,
             vocab_size: int, seed: int, tokenizer: Any, prefix_len: int = 0) -> list[Any]:
    from pagoda.benchmarks.datasets import random_requests, sharegpt_requests

    if name == "random":
        return random_requests(num_prompts, input_len, output_len, vocab_size, seed, prefix_len=prefix_len)
    if name == "sharegpt":
        if not path:
            raise typer.BadParameter("--dataset-path is required with --dataset-name sharegpt")
        if tokenizer is None:
            raise typer.BadParameter("the sharegpt dataset needs a tokenizer")
        return sharegpt_requests(path, num_prompts, tokenizer, seed)
    raise typer.BadParameter(f"--dataset-name must be 'random' or 'sharegpt', got {name!r}")


def _finish(title: str, result: dict[str, Any], output_json: str | None) -> None:
    from pagoda.benchmarks.report import print_table, write_json

    flat = {k: (v["p50"] if isinstance(v, dict) and "p50" in v else v) for k, v in result.items()}
    print_table(title, flat)
    write_json(output_json, result)


@app.command("throughput")
@with_engine_options()
def throughput(
    dataset_name: str = typer.Option("random", "--dataset-name"),
    dataset_path: str = typer.Option(None, "--dataset-path"),
    input_len: int = typer.Option(128, "--input-len", "--random-input-len"),
    output_len: int = typer.Option(128, "--output-len", "--random-output-len"),
    prefix_len: int = typer.Option(0, "--prefix-len", "--random-prefix-len", help="Tokens shared by every prompt."),
    num_prompts: int = typer.Option(64, "--num-prompts"),
    bench_seed: int = typer.Option(0, "--dataset-seed"),
    output_json: str = typer.Option(None, "--output-json"),
    *,
    engine_args: EngineArgs,
) -> None:
    """Offline throughput of LLM.generate (greedy, ignore_eos)."""
    from pagoda.benchmarks.throughput import run_throughput
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_args.model_dump())
    vocab = llm.llm_engine.vocab_size
    reqs = _dataset(dataset_name, dataset_path, num_prompts, input_len, output_len, vocab, bench_seed,
                    llm.get_tokenizer(), prefix_len)
    result = run_throughput(llm, reqs)
    result["dtype"] = str(llm.llm_engine.config.resolved.dtype)
    _finish("throughput", result, output_json)


@app.command("latency")
@with_engine_options()
def latency(
    batch_size: int = typer.Option(1, "--batch-size"),
    input_len: int = typer.Option(128, "--input-len"),
    output_len: int = typer.Option(128, "--output-len"),
    num_iters: int = typer.Option(3, "--num-iters"),
    num_iters_warmup: int = typer.Option(1, "--num-iters-warmup"),
    output_json: str = typer.Option(None, "--output-json"),
    *,
    engine_args: EngineArgs,
) -> None:
    """Latency of one batch: TTFT and per-token decode time."""
    from pagoda.benchmarks.datasets import random_requests
    from pagoda.benchmarks.latency import run_latency
    from pagoda.entrypoints.llm import LLM

    llm = LLM(**engine_args.model_dump())
    reqs = random_requests(batch_size, input_len, output_len, llm.llm_engine.vocab_size)
    result = run_latency(llm, reqs, num_iters, num_iters_warmup)
    result["dtype"] = str(llm.llm_engine.config.resolved.dtype)
    _finish("latency", result, output_json)


@app.command("serve")
def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url"),
    model: str = typer.Option(None, "--model", help="Model name; default: the server's first model."),
    dataset_name: str = typer.Option("random", "--dataset-name"),
    dataset_path: str = typer.Option(None, "--dataset-path"),
    tokenizer: str = typer.Option(None, "--tokenizer", help="Tokenizer for sharegpt (path or .gguf)."),
    input_len: int = typer.Option(128, "--random-input-len", "--input-len"),
    output_len: int = typer.Option(64, "--random-output-len", "--output-len"),
    prefix_len: int = typer.Option(0, "--random-prefix-len", "--prefix-len"),
    vocab_size: int = typer.Option(32000, "--random-vocab-size", help="Random prompt ids are drawn below this."),
    num_prompts: int = typer.Option(128, "--num-prompts"),
    max_concurrency: int = typer.Option(None, "--max-concurrency"),
    request_rate: float = typer.Option(float("inf"), "--request-rate"),
    api_key: str = typer.Option(None, "--api-key", envvar="PAGODA_API_KEY"),
    seed: int = typer.Option(0, "--seed"),
    output_json: str = typer.Option(None, "--output-json"),
) -> None:
    """Benchmark a running OpenAI-compatible server (streaming /v1/completions)."""
    import json
    import urllib.request

    from pagoda.benchmarks.serve import run_serve

    if model is None:
        req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(req, timeout=30) as r:
            model = json.load(r)["data"][0]["id"]
    tok = None
    if tokenizer:
        from pagoda.model_loader import load_tokenizer, resolve_model_path

        tok = load_tokenizer(resolve_model_path(tokenizer))
    reqs = _dataset(dataset_name, dataset_path, num_prompts, input_len, output_len, vocab_size, seed, tok, prefix_len)
    result = run_serve(base_url, model, reqs, max_concurrency, request_rate, api_key, seed)
    _finish("serve", result, output_json)
    if result["failed"]:
        raise typer.Exit(1)


@app.command("startup", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def startup(
    ctx: typer.Context,
    timeout: float = typer.Option(300.0, "--timeout"),
    output_json: str = typer.Option(None, "--output-json"),
) -> None:
    """Seconds from launching `pagoda serve` (extra args passed through) to /health and to the first token."""
    from pagoda.benchmarks.startup import run_startup

    result = run_startup(list(ctx.args), timeout)
    _finish("startup", result, output_json)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="bench")
