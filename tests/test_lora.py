"""Multi-LoRA against transformers + peft: greedy outputs of mixed batches (base rows and rows of several
adapters) equal the merged model's, row for row, on tiny random models of three families."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_utils import make_adapter
from pagoda import LLM, LoRARequest, SamplingParams
from pagoda.lora.peft import LoRAAdapterError, LoRAAdapterNotFoundError

NEW_TOKENS = 6
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(kind: str) -> Any:
    import transformers as tf

    from tests.conftest import TINY

    torch.manual_seed(0)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, rope_theta=10000.0)).eval()
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY)).eval()
    if kind == "gemma":
        return tf.GemmaForCausalLM(tf.GemmaConfig(**TINY, head_dim=16)).eval()
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=384, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                                                initializer_range=0.3)).eval()
    raise ValueError(kind)


# per family: (first adapter's targets, second adapter's targets): different ranks and modules, one a regex
TARGETS: dict[str, tuple[Any, Any]] = {
    "llama": (["q_proj", "v_proj", "down_proj"], ALL_LLAMA),
    "qwen2": ([r".*\.(k_proj|gate_proj)"], ALL_LLAMA),
    "gemma": (["q_proj", "o_proj", "up_proj"], ALL_LLAMA),
    "gpt2": (["c_attn"], ["c_attn", "c_proj", "c_fc"]),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    """kind -> (base dir, transformers base model, [(LoRARequest, merged reference model)])."""
    cache: dict[str, Any] = {}

    def make(kind: str, extra: int = 0) -> tuple[Path, Any, list[tuple[LoRARequest, Any]]]:
        if kind not in cache:
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            model = _build(kind)
            model.save_pretrained(root / "base", safe_serialization=True)
            first, second = TARGETS[kind]
            first = first[0] if len(first) == 1 and first[0].startswith(".*") else first
            specs = [dict(r=4, target_modules=first, seed=1), dict(r=16, target_modules=second, seed=2, use_rslora=True),
                     dict(r=8, target_modules=second, seed=3, lora_alpha=8.0)]
            adapters = []
            for i, spec in enumerate(specs, start=1):
                ref = make_adapter(model, root / f"adapter{i}", **spec)
                adapters.append((LoRARequest(f"adapter{i}", i, str(root / f"adapter{i}")), ref))
            cache[kind] = (root / "base", model, adapters)
        return cache[kind]

    return make


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def _check(llm: LLM, base: Any, rows: list[tuple[list[int], LoRARequest | None, Any]], hf_greedy,
           divergence_is_a_tie) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in rows], params,
                        lora_request=[lora for _, lora, _ in rows], use_tqdm=False)
    changed = 0
    for i, ((prompt, lora, ref), out) in enumerate(zip(rows, outs)):
        expected = hf_greedy(ref, prompt, NEW_TOKENS)
        got = out.outputs[0].token_ids
        assert out.lora_request == lora
        if got != expected:
            assert divergence_is_a_tie(ref, prompt, got, expected), f"row {i} ({lora and lora.lora_name}): {got} != {expected}"
        if lora is not None and expected != hf_greedy(base, prompt, NEW_TOKENS):
            changed += 1
    # the adapters must matter, or the comparison proves nothing
    assert changed >= sum(lora is not None for _, lora, _ in rows) // 2


def _llm(base_dir: Path, **kwargs: Any) -> LLM:
    return LLM(model=str(base_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256, num_kv_blocks=256,
               enable_lora=True, max_lora_rank=16, **kwargs)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma", "gpt2"])
def test_mixed_batch_matches_peft_merged(family, hf_greedy, divergence_is_a_tie, kind: str) -> None:
    base_dir, base, adapters = family(kind)
    (l1, r1), (l2, r2), _ = adapters
    llm = _llm(base_dir, max_loras=2)
    prompts = _prompts(9, seed=5)
    choice = [(None, base), (l1, r1), (l2, r2)]
    _check(llm, base, [(p, *choice[i % 3]) for i, p in enumerate(prompts)], hf_greedy, divergence_is_a_tie)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_adapters_under_tensor_and_pipeline_parallelism(family, hf_greedy, divergence_is_a_tie,
                                                        layout: dict[str, int]) -> None:
    """Each rank holds its part of every adapter (column-split layers B's rows, row-split layers A's columns,
    KV heads of 2 ranks from 2 KV heads); each stage its own layers' parts. Adapters over every projection,
    of two ranks, beside base rows: the merged model's greedy output row for row."""
    base_dir, base, adapters = family("llama")
    (l1, r1), (l2, r2), _ = adapters
    llm = _llm(base_dir, max_loras=2, distributed_executor_backend="mp", **layout)
    choice = [(None, base), (l1, r1), (l2, r2)]
    _check(llm, base, [(p, *choice[i % 3]) for i, p in enumerate(_prompts(9, seed=11))], hf_greedy,
           divergence_is_a_tie)


def test_fewer_slots_than_adapters(family, hf_greedy, divergence_is_a_tie) -> None:
    """max_loras=1 with three adapters: each step holds one adapter's rows (and base rows); a host cache of two
    reads the third adapter back from disk; every row still matches."""
    base_dir, base, adapters = family("llama")
    llm = _llm(base_dir, max_loras=1, max_cpu_loras=2)
    prompts = _prompts(9, seed=8)
    choice = [(None, base)] + adapters
    rows = [(p, *choice[i % 4]) for i, p in enumerate(prompts)]
    _check(llm, base, rows, hf_greedy, divergence_is_a_tie)
    manager = llm.llm_engine.engine_core.core.runner.lora
    assert len(manager.host) <= 2 and len(manager.slot_ids) == 1


def test_scheduler_caps_distinct_adapters_per_step(family) -> None:
    base_dir, _, adapters = family("llama")
    llm = _llm(base_dir, max_loras=1)
    core = llm.llm_engine.engine_core.core
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, (lora, _) in enumerate(adapters * 2):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": [1, 2, 3 + i]}, params, lora_request=lora)
    llm.llm_engine.add_request("base", {"prompt_token_ids": [4, 5]}, params)
    while llm.llm_engine.has_unfinished_requests():
        running = core.scheduler.running_loras()
        assert len(running) <= 1
        llm.llm_engine.step()


def test_prefix_cache_is_keyed_by_adapter(family, hf_greedy) -> None:
    base_dir, base, adapters = family("llama")
    (l1, r1) = adapters[0]
    llm = _llm(base_dir, max_loras=2, block_size=16)
    prompt = _prompts(1, seed=3)[0] * 3  # > 2 full blocks
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    with_adapter = llm.generate({"prompt_token_ids": prompt}, params, lora_request=l1, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt}, params, lora_request=l1, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert with_adapter.num_cached_tokens == 0, "the base model's blocks hold other K/V than the adapter's"
    assert again.num_cached_tokens >= 32
    assert with_adapter.outputs[0].token_ids == again.outputs[0].token_ids == hf_greedy(r1, prompt, NEW_TOKENS)


def test_beam_search_with_adapter(family) -> None:
    """A beam search under an adapter ranks by the adapter's logprobs: its best beam is the merged model's."""
    from pagoda import BeamSearchParams

    base_dir, base, adapters = family("llama")
    (l2, r2) = adapters[1]
    llm = _llm(base_dir, max_loras=2)
    prompt = _prompts(1, seed=4)[0]
    ours = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=4),
                           lora_request=l2)[0].sequences[0].tokens
    ids = torch.tensor([prompt])
    expected = r2.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, do_sample=False, max_new_tokens=4,
                           min_new_tokens=4, early_stopping=False, eos_token_id=None, pad_token_id=0)[0].tolist()
    assert ours == expected


def _bad_adapter(root: Path, good: Path, name: str, edit) -> Path:
    import shutil

    path = root / name
    shutil.copytree(good, path)
    edit(path)
    return path


def test_bad_adapters_are_clear_errors_and_the_engine_keeps_serving(family, tmp_path: Path, hf_greedy) -> None:
    base_dir, base, adapters = family("llama")
    (l1, r1) = adapters[0]
    good = Path(l1.lora_path)

    def config_edit(**changes: Any):
        def edit(path: Path) -> None:
            cfg = json.loads((path / "adapter_config.json").read_text())
            cfg.update(changes)
            (path / "adapter_config.json").write_text(json.dumps(cfg))
        return edit

    other = _build("qwen2")  # same names, but a model made for another config: shapes that do not fit
    import transformers as tf
    from tests.conftest import TINY

    torch.manual_seed(0)
    wide = tf.LlamaForCausalLM(tf.LlamaConfig(**{**TINY, "hidden_size": 96, "num_attention_heads": 4})).eval()
    make_adapter(wide, tmp_path / "wide", r=4, target_modules=["q_proj"], seed=1)
    del other
    cases = {
        "missing": (tmp_path / "nowhere", LoRAAdapterNotFoundError, "no directory"),
        "rank": (_bad_adapter(tmp_path, good, "rank", config_edit(r=32)), LoRAAdapterError, "max_lora_rank=16"),
        "dora": (_bad_adapter(tmp_path, good, "dora", config_edit(use_dora=True)), LoRAAdapterError, "DoRA"),
        "saved": (_bad_adapter(tmp_path, good, "saved", config_edit(modules_to_save=["lm_head"])), LoRAAdapterError,
                  "modules_to_save"),
        "noweights": (_bad_adapter(tmp_path, good, "noweights",
                                   lambda p: (p / "adapter_model.safetensors").unlink()), LoRAAdapterNotFoundError,
                      "adapter_model"),
        "shape": (tmp_path / "wide", LoRAAdapterError, "does not fit the base model"),
    }
    llm = _llm(base_dir, max_loras=2)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8]
    for i, (name, (path, error, text)) in enumerate(cases.items(), start=10):
        with pytest.raises(error, match=text) as info:
            llm.generate({"prompt_token_ids": prompt}, params, lora_request=LoRARequest(name, i, str(path)),
                         use_tqdm=False)
        assert repr(name) in str(info.value), "the error names the adapter"
        out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=l1, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(r1, prompt, NEW_TOKENS)
    assert not llm.llm_engine.has_unfinished_requests()


def test_lora_request_without_enable_lora_is_refused(family) -> None:
    base_dir, _, adapters = family("llama")
    llm = LLM(model=str(base_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1), lora_request=adapters[0][0],
                     use_tqdm=False)
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=str(base_dir), skip_tokenizer_init=True, max_loras=2)


def test_pooling_with_an_adapter_matches_the_merged_model(family) -> None:
    """LLM.embed under an adapter (a decoder converted to embeddings): the merged model's normalized last hidden state."""
    base_dir, base, adapters = family("llama")
    (l1, r1) = adapters[0]
    llm = LLM(model=str(base_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=64,
              enable_lora=True, runner="pooling", convert="embed")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False, lora_request=[l1, None])
    for out, prompt, ref in zip(outs, prompts, [r1, base]):
        with torch.no_grad():
            hidden = ref.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(hidden, dim=0),
                                   atol=1e-4, rtol=1e-4)
