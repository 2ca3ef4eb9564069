"""Same-run comparison with peers on the standard workloads (`nox -s bench_peers`).

    python -m benchmarks.peers --workloads W1,W2,W4,W5 --dtypes float32,bfloat16 \
        [--vllm-python /path/to/vllm-venv/bin/python] [--output-json results.json]

W1 offline 64x128->128 greedy ignore_eos; W2 single stream 1x128->128 (decode tok/s);
W3 32 concurrent streaming clients 128 in / 64 out, 128 requests (needs the server);
W3B the burst form of W3: 4 rounds of 32 simultaneous streaming requests, 128 in / 64 out (same server
start as W3 when both are asked for; pagoda's `--burst` client drives both servers);
W4 64 requests sharing a 1,024-token prefix + 32 distinct tokens, 32 out, prefix caching on vs off
(offline here; served with `pagoda bench serve --random-prefix-len 1024`); W5 `pagoda serve` start-up.
Every engine runs the same weights: the default model exported once as a HF directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pagoda import envs
from pagoda.benchmarks.datasets import random_requests


def _pagoda_offline(model_dir: str, dtype: str, n: int, in_len: int, out_len: int, prefix_len: int = 0,
                    **engine_kwargs: Any) -> dict[str, Any]:
    from pagoda.benchmarks.throughput import run_throughput
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, **engine_kwargs)
    reqs = random_requests(n, in_len, out_len, llm.llm_engine.vocab_size, prefix_len=prefix_len)
    result = run_throughput(llm, reqs, use_tqdm=False)
    del llm
    gc.collect()
    return result


def _pagoda_decode(model_dir: str, dtype: str) -> dict[str, Any]:
    from pagoda.benchmarks.latency import run_latency
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048)
    result = run_latency(llm, random_requests(1, 128, 128, llm.llm_engine.vocab_size), num_iters=3)
    del llm
    gc.collect()
    return {"decode_tokens_per_s": result["decode_tokens_per_s_per_sequence"], "ttft_s": result["ttft_s"]["p50"]}


def _hf_model(model_dir: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@torch.inference_mode()
def hf_generate(model_dir: str, dtype: str, requests: list[Any], out_len: int,
                device: str = "cpu") -> tuple[list[list[int]], float]:
    """transformers' batched greedy generate on equal-length prompts (no padding needed): (new ids per prompt, seconds)."""
    model = _hf_model(model_dir, dtype).to(device)
    ids = torch.tensor([r.prompt_token_ids for r in requests], device=device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, **kw)
    if device != "cpu":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len, min_new_tokens=out_len, **kw)
    if device != "cpu":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return out[:, ids.shape[1]:].tolist(), dt


def _hf_offline(model_dir: str, dtype: str, n: int, in_len: int, out_len: int) -> dict[str, Any]:
    vocab = int(json.loads(Path(model_dir, "config.json").read_text())["vocab_size"])
    new, dt = hf_generate(model_dir, dtype, random_requests(n, in_len, out_len, vocab), out_len)
    tokens = sum(map(len, new))
    return {"output_tokens": tokens, "elapsed_s": dt, "output_tokens_per_s": tokens / dt}


@torch.inference_mode()
def _hf_decode(model_dir: str, dtype: str) -> dict[str, Any]:
    model = _hf_model(model_dir, dtype)
    ids = torch.tensor([random_requests(1, 128, 128, model.config.vocab_size)[0].prompt_token_ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    model.generate(ids, max_new_tokens=4, **kw)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=128, min_new_tokens=128, **kw)
    total = time.perf_counter() - t
    return {"decode_tokens_per_s": 127 / max(total - ttft, 1e-9), "ttft_s": ttft}


def _vllm_offline(python: str, model_dir: str, dtype: str, n: int, in_len: int, out_len: int,
                  bind: str | None) -> dict[str, Any]:
    script = Path(__file__).with_name("peer_vllm.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    proc = subprocess.run([python, str(script), model_dir, dtype, str(n), str(in_len), str(out_len)],
                          capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line.removeprefix("PEER_RESULT "))
    return {"error": (proc.stderr or proc.stdout)[-1500:]}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=1.0).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout:.0f} s")


def _served(cmd: list[str], env: dict[str, str], model_name: str, vocab: int, startup_timeout: float,
            forms: tuple[str, ...] = ("W3",)) -> dict[str, Any]:
    """Start a server, run each asked form, stop it.

    W3: 128 streaming requests, 32 concurrent, 128 in / 64 out. W3B: 4 rounds of 32 simultaneous
    requests of the same shape. One result dict per form, keyed by the form.
    """
    from pagoda.benchmarks.serve import run_serve, run_serve_bursts
    from pagoda.benchmarks.startup import stop_process

    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="pagoda-peer-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=log, stderr=log)
    try:
        startup = _wait_healthy(base_url, proc, startup_timeout)
        warm = random_requests(2, 16, 4, vocab, seed=1)
        run_serve(base_url, model_name, warm, max_concurrency=2)
        results: dict[str, Any] = {}
        for form in forms:
            if form == "W3":
                result = run_serve(base_url, model_name, random_requests(128, 128, 64, vocab), max_concurrency=32)
            else:
                result = run_serve_bursts(base_url, model_name, random_requests(128, 128, 64, vocab, seed=2), burst=32)
            results[form] = result | {"startup_s": startup}
        return results
    except Exception as exc:
        log.flush()
        tail = Path(log.name).read_text(errors="replace")[-1500:]
        return {form: {"error": f"{type(exc).__name__}: {exc}", "server_log_tail": tail} for form in forms}
    finally:
        stop_process(proc)


def _pagoda_served(model_dir: str, dtype: str, vocab: int, forms: tuple[str, ...]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", model_dir, "--dtype", dtype,
           "--max-model-len", "2048", "--served-model-name", "bench"]
    return _served(cmd, dict(os.environ), "bench", vocab, startup_timeout=300, forms=forms)


def _vllm_served(python: str, model_dir: str, dtype: str, vocab: int, bind: str | None,
                 forms: tuple[str, ...]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_")}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    # `vllm serve` from the vllm-cpu distribution looks up metadata named "vllm" and exits;
    # the API server module is the same server.
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
           "--max-model-len", "2048", "--served-model-name", "bench", "--seed", "0"]
    return _served(cmd, env, "bench", vocab, startup_timeout=600, forms=forms)


def _llamacpp(python: str, gguf_path: str, n: int, in_len: int, out_len: int) -> dict[str, Any]:
    script = Path(__file__).with_name("peer_llamacpp.py")
    proc = subprocess.run([python, str(script), gguf_path, str(n), str(in_len), str(out_len),
                           str(torch.get_num_threads())], capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line.removeprefix("PEER_RESULT "))
    return {"error": (proc.stderr or proc.stdout)[-1500:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="W1,W2,W4,W5")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--export-dir", default=os.path.join(tempfile.gettempdir(), "pagoda-bench-model"))
    ap.add_argument("--vllm-python", default=envs.PAGODA_BENCH_VLLM_PYTHON)
    ap.add_argument("--vllm-binds", default="default,0-1", help="VLLM_CPU_OMP_THREADS_BIND settings to try")
    ap.add_argument("--llamacpp-python", default=envs.PAGODA_BENCH_LLAMACPP_PYTHON,
                    help="a python with llama-cpp-python installed (runs F32/BF16 GGUF rewrites of the same weights)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    from benchmarks.export import export_gguf, export_hf_dir

    model_dir = str(export_hf_dir(args.model, args.export_dir))
    vocab = int(json.loads(Path(model_dir, "config.json").read_text())["vocab_size"])

    def gguf_for(dtype: str) -> str:
        return str(export_gguf(args.model, f"{args.export_dir}-{dtype}.gguf", getattr(torch, dtype)))

    workloads = set(args.workloads.split(","))
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "model_dir": model_dir}
    for dtype in args.dtypes.split(","):
        if "W1" in workloads:
            results[f"W1/{dtype}/pagoda"] = _pagoda_offline(model_dir, dtype, 64, 128, 128)
            if not args.skip_transformers:
                results[f"W1/{dtype}/transformers"] = _hf_offline(model_dir, dtype, 64, 128, 128)
            if args.vllm_python:
                for bind in args.vllm_binds.split(","):
                    results[f"W1/{dtype}/vllm[bind={bind}]"] = _vllm_offline(
                        args.vllm_python, model_dir, dtype, 64, 128, 128, None if bind == "default" else bind)
            if args.llamacpp_python:
                results[f"W1/{dtype}/llama.cpp"] = _llamacpp(args.llamacpp_python, gguf_for(dtype), 64, 128, 128)
        if "W2" in workloads:
            results[f"W2/{dtype}/pagoda"] = _pagoda_decode(model_dir, dtype)
            if not args.skip_transformers:
                results[f"W2/{dtype}/transformers"] = _hf_decode(model_dir, dtype)
            if args.vllm_python:
                # one stream: output tok/s includes a 128-token prefill (tens of ms), so it
                # slightly understates vLLM's pure decode rate
                for bind in args.vllm_binds.split(","):
                    r = _vllm_offline(args.vllm_python, model_dir, dtype, 1, 128, 128, None if bind == "default" else bind)
                    if "output_tokens_per_s" in r:
                        r["decode_tokens_per_s"] = r.pop("output_tokens_per_s")
                    results[f"W2/{dtype}/vllm[bind={bind}]"] = r
            if args.llamacpp_python:
                r = _llamacpp(args.llamacpp_python, gguf_for(dtype), 1, 128, 128)
                if "output_tokens_per_s" in r:
                    r["decode_tokens_per_s"] = r.pop("output_tokens_per_s")
                results[f"W2/{dtype}/llama.cpp"] = r
        forms = tuple(form for form in ("W3", "W3B") if form in workloads)
        if forms:
            for form, r in _pagoda_served(model_dir, dtype, vocab, forms).items():
                results[f"{form}/{dtype}/pagoda"] = r
            if args.vllm_python:
                for bind in args.vllm_binds.split(","):
                    served = _vllm_served(args.vllm_python, model_dir, dtype, vocab,
                                          None if bind == "default" else bind, forms)
                    for form, r in served.items():
                        results[f"{form}/{dtype}/vllm[bind={bind}]"] = r
        if "W4" in workloads:
            on = _pagoda_offline(model_dir, dtype, 64, 32, 32, prefix_len=1024)
            off = _pagoda_offline(model_dir, dtype, 64, 32, 32, prefix_len=1024, enable_prefix_caching=False)
            results[f"W4/{dtype}/pagoda[prefix_caching]"] = on
            results[f"W4/{dtype}/pagoda[no_prefix_caching]"] = off
    if "W5" in workloads:
        from pagoda.benchmarks.startup import run_startup

        results["W5/pagoda"] = run_startup([])
    _print(results)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2, default=str))
    return 0


def _print(results: dict[str, Any]) -> None:
    print("| workload | engine | output tok/s | decode tok/s | other |")
    print("|---|---|---|---|---|")
    for key, r in results.items():
        if not isinstance(r, dict) or "/" not in key:
            continue
        w, _, engine = key.partition("/")
        other = {k: v for k, v in r.items() if k not in ("output_tokens_per_s", "decode_tokens_per_s")}
        ot = r.get("output_tokens_per_s")
        dt = r.get("decode_tokens_per_s")
        print(f"| {w} | {engine} | {'' if ot is None else f'{ot:.1f}'} | {'' if dt is None else f'{dt:.1f}'} | "
              f"{json.dumps(other, default=str)[:160]} |")
    groups: dict[str, dict[str, float]] = {}
    for key, r in results.items():
        if isinstance(r, dict) and "/" in key:
            w, dtype_engine = key.split("/", 1)[0], key.split("/", 1)[1]
            dtype, _, engine = dtype_engine.partition("/")
            value = r.get("output_tokens_per_s") or r.get("decode_tokens_per_s")
            if value:
                groups.setdefault(f"{w}/{dtype}", {})[engine] = value
    for group, engines in groups.items():
        base = engines.get("pagoda") or engines.get("pagoda[prefix_caching]")
        if not base:
            continue
        for engine, value in engines.items():
            if not engine.startswith("pagoda") or engine == "pagoda[no_prefix_caching]":
                print(f"ratio {group}: pagoda / {engine} = {base / value:.2f}")


if __name__ == "__main__":
    sys.exit(main())
