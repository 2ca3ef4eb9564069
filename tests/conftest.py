"""Shared fixtures for the acceptance tests: tiny random models saved as safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TINY = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    # a wide init keeps logits apart, so float rounding cannot flip a greedy argmax
    initializer_range=0.3,
    tie_word_embeddings=False,
)


def _build(kind: str) -> tuple[Any, Any]:
    import transformers as tf

    if kind == "llama":
        cfg = tf.LlamaConfig(**TINY, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif kind == "llama_tied":
        cfg = tf.LlamaConfig(**{**TINY, "tie_word_embeddings": True})
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(**TINY, sliding_window=48)
        cls = tf.MistralForCausalLM
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**TINY)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**TINY, head_dim=16)
        cls = tf.Qwen3ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    return cfg, model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: kind -> (directory with config.json + model.safetensors, transformers model)."""
    cache: dict[str, tuple[Path, Any]] = {}

    def make(kind: str) -> tuple[Path, Any]:
        if kind not in cache:
            cfg, model = _build(kind)
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            model.save_pretrained(path, safe_serialization=True)
            cache[kind] = (path, model)
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(directory with a tiny random LLaVA 1.5 + its LlavaProcessor, the transformers model): no hub."""
    from pagoda.testing.tiny_llava import save_tiny_llava

    return save_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """(directory with a tiny random Idefics3 + its Idefics3Processor, the transformers model): no hub."""
    from pagoda.testing.tiny_idefics3 import save_tiny_idefics3

    return save_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


def _hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on one unpadded prompt."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


# -- OpenAI-compatible server fixtures (tests/test_server*.py) ---------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RunningServer:
    """A `pagoda serve` subprocess on 127.0.0.1; ``url`` is its base URL."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 180.0,
                 entrypoint: tuple[str, ...] = ("-m", "pagoda.entrypoints.cli.main", "serve")) -> None:
        import os
        import subprocess
        import sys
        import time

        import httpx

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-serve-{self.port}.log", "w+")
        cmd = [sys.executable, *entrypoint, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        started = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with {self.proc.returncode}:\n{self.output()[-5000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout:
                log = self.output()[-5000:]  # before stop() closes the log
                self.stop()
                raise RuntimeError(f"pagoda serve did not answer /health in {timeout} s:\n{log}")
            time.sleep(0.25)
        self.startup_seconds = time.monotonic() - started

    def output(self) -> str:
        """Everything the server has logged so far (the start-up block of resolved config values alone is
        several KB, so a tail would lose the lines tests look for)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture(scope="session")
def default_model_server():
    """The default model (SmolLM2-135M-Instruct, real tokenizer + chat template) behind `pagoda serve`."""
    server = RunningServer(["--max-model-len", "512", "--max-num-seqs", "64", "--max-n", "8"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def start_server():
    """Factory: (serve args, env) -> RunningServer; every server it started is stopped at the end of the
    module (a whole suite's servers kept to the end of the session outgrew a 24 GiB machine)."""
    started: list[RunningServer] = []

    def start(args: list[str], env: dict[str, str] | None = None, timeout: float = 180.0,
              entrypoint: tuple[str, ...] = ("-m", "pagoda.entrypoints.cli.main", "serve")) -> RunningServer:
        server = RunningServer(args, env, timeout, entrypoint)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _hf_top2_gap(model: Any, token_ids: list[int]) -> float:
    """Gap between transformers' two best next-token logits after ``token_ids``."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


# Below this gap two engines' float32 rounding may legitimately pick different tokens.
TIE_GAP = 1e-4


def _divergence_is_a_tie(model: Any, prompt: list[int], ours: list[int], expected: list[int]) -> bool:
    """True when the first differing token is a near-tie in transformers' own logits."""
    for i, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            return _hf_top2_gap(model, prompt + expected[:i]) < TIE_GAP
    return len(ours) == len(expected)


@pytest.fixture(scope="session")
def divergence_is_a_tie():
    return _divergence_is_a_tie
