"""The engine-level GPU measurements of the GPU-platform issue, in one command.

    python -m benchmarks.gpu_checks --output-json gpu.json

1. ``greedy``: SmolLM2-135M-Instruct (the embedded default, exported once as a HF directory)
   in float32 on the device: pagoda's greedy tokens against transformers' ``generate`` on the
   same weights (8 prompts of 16 random token ids, 32 new tokens each).
2. ``throughput``: a 1B-class Llama (TinyLlama-1.1B's shape) built from its config with random
   weights, in bf16: 256 prompts x 512 tokens -> 256 new tokens, greedy, ignore_eos; pagoda with
   CUDA graphs (the default) and with ``enforce_eager=True``, then transformers' batched
   ``generate`` on the same weights and prompts, in the same run.

Kernel correctness at real sizes and decode attention's bandwidth against a device-to-device
copy are ``kernels/bench/bench_kernels.py``. ``--tiny`` shrinks everything (a 2-layer model,
a few short prompts) so the script itself runs, and is tested, on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from pagoda.benchmarks.datasets import BenchRequest, random_requests

# TinyLlama-1.1B's layout (1.1 B parameters with this vocabulary); the vocabulary is SmolLM2's,
# whose tokenizer the directory borrows.
ONE_B_CONFIG: dict[str, Any] = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
)
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_random_llama(out_dir: Path, tokenizer_dir: Path, config_kwargs: dict[str, Any], dtype: torch.dtype) -> Path:
    """A Llama directory with random weights (std 0.02, built on the device: seconds, not minutes)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").exists() and (out_dir / "model.safetensors").exists():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(vocab_size=len(tokenizer), **config_kwargs)
    torch.manual_seed(0)
    with _device():
        model = LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    del model
    _release()
    return out_dir


def _hf_generate(model_dir: Path, dtype: str, requests: list[BenchRequest], out_len: int) -> tuple[list[list[int]], float]:
    from benchmarks.peers import hf_generate

    result = hf_generate(str(model_dir), dtype, requests, out_len, device=_device().type)
    _release()
    return result


def _pagoda_generate(model_dir: Path, dtype: str, requests: list[BenchRequest], **engine_kwargs: Any) -> tuple[list[list[int]], float]:
    from pagoda.benchmarks.throughput import timed_generate
    from pagoda.entrypoints.llm import LLM

    llm = LLM(model=str(model_dir), dtype=dtype, **engine_kwargs)
    outputs, elapsed = timed_generate(llm, requests, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    del llm, outputs
    _release()
    return tokens, elapsed


def check_greedy(model_dir: Path, num_prompts: int, in_len: int, out_len: int) -> dict[str, Any]:
    """float32 greedy tokens of pagoda and transformers on the same weights and prompts."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    requests = random_requests(num_prompts, in_len, out_len, vocab, seed=7)
    ours, _ = _pagoda_generate(model_dir, "float32", requests, max_model_len=in_len + out_len + 16)
    theirs, _ = _hf_generate(model_dir, "float32", requests, out_len)
    first_diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, theirs)]
    return {
        "prompts": num_prompts,
        "identical": sum(d is None for d in first_diffs),
        "first_differing_position": first_diffs,
    }


def check_throughput(model_dir: Path, num_prompts: int, in_len: int, out_len: int) -> dict[str, Any]:
    """Output tokens/s of pagoda (graphs on, off) and transformers on the same bf16 work."""
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    requests = random_requests(num_prompts, in_len, out_len, vocab)
    total = num_prompts * out_len
    results: dict[str, Any] = {"prompts": num_prompts, "input_len": in_len, "output_len": out_len}
    for name, kwargs in (("pagoda", {}), ("pagoda_enforce_eager", {"enforce_eager": True})):
        tokens, elapsed = _pagoda_generate(model_dir, "bfloat16", requests, max_model_len=in_len + out_len + 16, **kwargs)
        results[name] = {"elapsed_s": elapsed, "output_tokens_per_s": sum(map(len, tokens)) / elapsed}
    _, elapsed = _hf_generate(model_dir, "bfloat16", requests, out_len)
    results["transformers"] = {"elapsed_s": elapsed, "output_tokens_per_s": total / elapsed}
    for name in ("pagoda", "pagoda_enforce_eager"):
        results[f"{name}_vs_transformers"] = results[name]["output_tokens_per_s"] / results["transformers"]["output_tokens_per_s"]
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "pagoda-gpu-checks"))
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and a few short prompts (runs on CPU)")
    ap.add_argument("--skip", default="", help="comma-separated: greedy, throughput")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)

    from benchmarks.export import export_hf_dir

    work = Path(args.work_dir)
    skip = set(filter(None, args.skip.split(",")))
    smol = export_hf_dir(None, work / "smollm2-f32")
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
    }
    try:
        import triton  # type: ignore[import-not-found]

        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    if "greedy" not in skip:
        greedy_dir = smol
        if args.tiny:
            greedy_dir = build_random_llama(work / "tiny-f32", smol, TINY_CONFIG, torch.float32)
        report["greedy"] = check_greedy(greedy_dir, 8 if not args.tiny else 3, 16, 32 if not args.tiny else 8)
        print("greedy:", json.dumps(report["greedy"]), flush=True)
    if "throughput" not in skip:
        if args.tiny:
            model_dir = build_random_llama(work / "tiny-bf16", smol, TINY_CONFIG, torch.bfloat16)
            report["throughput"] = check_throughput(model_dir, 4, 16, 8)
        else:
            model_dir = build_random_llama(work / "llama-1b-bf16", smol, ONE_B_CONFIG, torch.bfloat16)
            report["throughput"] = check_throughput(model_dir, 256, 512, 256)
        print("throughput:", json.dumps(report["throughput"]), flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
