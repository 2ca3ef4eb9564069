"""`pagoda bench throughput|latency|serve|startup` (vLLM's `vllm bench`)."""

from __future__ import annotations

from typing import Any

import typer

from pagoda.config import EngineArgs
from pagoda.entrypoints.cli.engine_options import with_engine_options

app = typer.Typer(help="Benchmarks: offline throughput, batch latency, online serving, start-up.", no_args_is_help=True)


def _dataset(name: str, path: str | None, num_prompts: int, input_len: int, output_len: int,
             vocab_size: int, seed: int, tokenizer: Any, prefix_len: int = 0) -> list[Any]:
    from pagoda.benchmarks.datasets import grounded_requests, random_requests, sharegpt_requests

    if name == "random":
        return random_requests(num_prompts, input_len, output_len, vocab_size, seed, prefix_len=prefix_len)
    if name == "grounded":
        # --input-len is the passage's length; the instruction around it adds a few dozen tokens
        if prefix_len:
            raise typer.BadParameter("--prefix-len applies to --dataset-name random")
        if tokenizer is None:
            raise typer.BadParameter("the grounded dataset needs a tokenizer (--tokenizer, or a model with one)")
        return grounded_requests(num_prompts, input_len, output_len, tokenizer, seed)
    if name == "sharegpt":
        if not path:
            raise typer.BadParameter("--dataset-path is required with --dataset-name sharegpt")
        if tokenizer is None:
            raise typer.BadParameter("the sharegpt dataset needs a tokenizer")
        return sharegpt_requests(path, num_prompts, tokenizer, seed)
    raise typer.BadParameter(f"--dataset-name must be 'random', 'grounded' or 'sharegpt', got {name!r}")


def _finish(title: str, result: dict[str, Any], output_json: str | None) -> None:
    from pagoda.benchmarks.report import print_table, write_json

    # per-round results (bench serve --burst) are printed as their own table
    flat = {k: (v["p50"] if isinstance(v, dict) and "p50" in v else v) for k, v in result.items() if k != "rounds"}
    print_table(title, flat)
    write_json(output_json, result)


def _print_rounds(rounds: list[dict[str, Any]]) -> None:
    print(f"{'round':>5} {'done':>5} {'failed':>6} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9}")
    for i, r in enumerate(rounds):
        print(f"{i:>5} {r['completed']:>5} {r['failed']:>6} {r['output_tokens_per_s']:>10.1f} "
              f"{r['ttft_s']['p50']:>9.3f} {r['ttft_s']['p99']:>9.3f} {r['tpot_s']['p50']:>9.4f}")


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
    """Offline throughput of LLM.generate (greedy, ignore_eos). --dataset-name grounded: prompts that repeat,
    summarise or edit a passage of --input-len tokens (with --speculative-config, where drafts pay)."""
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
    dataset_name: str = typer.Option("random", "--dataset-name", help="random, or grounded (repeat / summarise / "
                                     "edit a passage of --input-len tokens: where speculative decoding pays)."),
    input_len: int = typer.Option(128, "--input-len"),
    output_len: int = typer.Option(128, "--output-len"),
    num_iters: int = typer.Option(3, "--num-iters"),
    num_iters_warmup: int = typer.Option(1, "--num-iters-warmup"),
    output_json: str = typer.Option(None, "--output-json"),
    *,
    engine_args: EngineArgs,
) -> None:
    """Latency of one batch: TTFT and per-token decode time."""
    from pagoda.benchmarks.latency import run_latency
    from pagoda.entrypoints.llm import LLM

    if dataset_name not in ("random", "grounded"):
        raise typer.BadParameter(f"bench latency's --dataset-name must be 'random' or 'grounded', got {dataset_name!r}")
    llm = LLM(**engine_args.model_dump())
    reqs = _dataset(dataset_name, None, batch_size, input_len, output_len, llm.llm_engine.vocab_size, 0,
                    llm.get_tokenizer() if dataset_name == "grounded" else None)
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
    num_prompts: int = typer.Option(None, "--num-prompts", help="Default 128; with --burst, burst x --num-rounds."),
    max_concurrency: int = typer.Option(None, "--max-concurrency"),
    request_rate: float = typer.Option(float("inf"), "--request-rate"),
    burstiness: float = typer.Option(
        1.0, "--burstiness", help="Gamma shape of the arrival gaps at --request-rate (1.0: Poisson; lower: burstier)."
    ),
    burst: int = typer.Option(
        None, "--burst", help="pagoda-only: rounds of this many simultaneous requests, each after the last finished."
    ),
    num_rounds: int = typer.Option(None, "--num-rounds", help="pagoda-only: rounds in --burst mode (default 4)."),
    api_key: str = typer.Option(None, "--api-key", envvar="PAGODA_API_KEY"),
    seed: int = typer.Option(0, "--seed"),
    output_json: str = typer.Option(None, "--output-json"),
) -> None:
    """Benchmark a running OpenAI-compatible server (streaming /v1/completions).

    Continuous by default (vLLM's `vllm bench serve` flags); `--burst N` runs rounds of N
    simultaneous requests instead and reports each round (pagoda-only).
    """
    import json
    import urllib.request

    from pagoda.benchmarks.serve import run_serve, run_serve_bursts

    if burst is None:
        if num_rounds is not None:
            raise typer.BadParameter("--num-rounds needs --burst")
        num_prompts = 128 if num_prompts is None else num_prompts
    else:
        if burst < 1:
            raise typer.BadParameter(f"--burst must be at least 1, got {burst}")
        if max_concurrency is not None or request_rate != float("inf") or burstiness != 1.0:
            raise typer.BadParameter(
                "--burst sends each round at once: --max-concurrency, --request-rate and --burstiness do not apply"
            )
        if num_rounds is None:
            num_rounds = 4 if num_prompts is None else max(1, num_prompts // burst)
        if num_rounds < 1:
            raise typer.BadParameter(f"--num-rounds must be at least 1, got {num_rounds}")
        if num_prompts is not None and num_prompts != burst * num_rounds:
            raise typer.BadParameter(
                f"--num-prompts {num_prompts} is not --burst {burst} x --num-rounds {num_rounds}; give one of them"
            )
        num_prompts = burst * num_rounds

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
    try:
        if burst is None:
            result = run_serve(base_url, model, reqs, max_concurrency, request_rate, api_key, seed, burstiness)
        else:
            result = run_serve_bursts(base_url, model, reqs, burst, api_key)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if burst is not None:
        _print_rounds(result["rounds"])
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
