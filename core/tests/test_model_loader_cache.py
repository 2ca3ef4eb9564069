"""pagoda's convert cache of GGUF files: reused on the next load, rebuilt when the file changes or the cache is damaged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from pagoda.disk_cache import CACHE_ROOT_ENV, DISABLE_ENV, cache_root
from pagoda.model_loader import iter_weights, load_hf_config, load_model_config, load_tokenizer, resolve_model_path
from pagoda.model_loader.convert_cache import FORMAT_VERSION, ConvertCache
from pagoda.model_loader.gguf import weights as gguf_weights_module
from pagoda.model_loader.hf_config import CachedHFConfig

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96
BLOCK_NAMES = ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _shape(name: str) -> tuple[int, ...]:
    head_dim = HIDDEN // HEADS
    return {
        "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,), "attn_q": (HEADS * head_dim, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN), "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HEADS * head_dim), "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN), "ffn_down": (HIDDEN, INTERMEDIATE),
        "token_embd": (VOCAB, HIDDEN), "output_norm": (HIDDEN,), "output": (VOCAB, HIDDEN),
    }[name]


def write_gguf(path: Path, seed: int = 0) -> Path:
    """A tiny llama GGUF file: Q4_1 matrices, F32 norms."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    names = ["token_embd", "output_norm", "output"] + [f"blk.{i}.{n}" for i in range(LAYERS) for n in BLOCK_NAMES]
    for name in names:
        shape = _shape(name.rsplit(".", 1)[-1])
        data = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 2:
            writer.add_tensor(f"{name}.weight", quantize(data, Q.Q4_1), raw_dtype=Q.Q4_1)  # shape from the bytes
        else:
            writer.add_tensor(f"{name}.weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ROOT_ENV, str(root))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    return root


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    return write_gguf(tmp_path / "model" / "tiny.gguf")


@pytest.fixture
def count_dequantize(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the GGUF file's tensors were dequantized (once per load that missed the cache)."""
    calls: list[int] = []
    original = gguf_weights_module._dequantized_tensors

    def counting(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        calls.append(1)  # runs when the first tensor is asked for, not when the generator is made
        yield from original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gguf_weights_module, "_dequantized_tensors", counting)
    return calls


def reference(model_file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors without the cache, cast as the model would."""
    return {name: t.to(dtype) for name, t in iter_weights(resolve_model_path(model_file))}


def load(model_file: Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return dict(iter_weights(resolve_model_path(model_file), cache_dtype=dtype))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def weights_file(model_file: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    cache = ConvertCache.for_gguf(model_file)
    assert cache is not None
    return cache.weights_path(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_second_load_reads_the_cache(cache_dir: Path, model_file: Path, count_dequantize: list[int],
                                     dtype: torch.dtype) -> None:
    want = reference(model_file, dtype)
    count_dequantize.clear()
    assert_same(load(model_file, dtype), want)
    assert len(count_dequantize) == 1 and weights_file(model_file, dtype).is_file()
    assert weights_file(model_file, dtype).parent.parent == cache_dir / "gguf"
    assert_same(load(model_file, dtype), want)
    assert len(count_dequantize) == 1  # no second conversion


def test_cached_weights_are_a_standard_safetensors_file(cache_dir: Path, model_file: Path) -> None:
    """The streamed file is what the safetensors library reads: same names, shapes, dtypes and values."""
    from safetensors import safe_open

    want = load(model_file, torch.bfloat16)
    with safe_open(str(weights_file(model_file)), framework="pt") as f:
        assert sorted(f.keys()) == sorted(want)
        assert f.metadata()["dtype"] == "bfloat16"
        for name, tensor in want.items():
            assert torch.equal(f.get_tensor(name), tensor), name


def test_without_cache_dtype_nothing_is_cached(cache_dir: Path, model_file: Path) -> None:
    dict(iter_weights(resolve_model_path(model_file)))
    assert not cache_dir.exists()


def test_disabled_cache(cache_dir: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert cache_root() is None
    assert_same(load(model_file), reference(model_file, torch.bfloat16))
    assert not cache_dir.exists()


def test_changed_gguf_file_is_converted_again(cache_dir: Path, model_file: Path, count_dequantize: list[int]) -> None:
    load(model_file)
    old_entry = weights_file(model_file).parent
    write_gguf(model_file, seed=1)
    os.utime(model_file, ns=(1, 1))  # a different mtime even on a coarse-clock filesystem
    count_dequantize.clear()
    want = reference(model_file, torch.bfloat16)
    count_dequantize.clear()
    assert_same(load(model_file), want)
    assert len(count_dequantize) == 1
    assert not old_entry.exists()  # the stale entry was pruned


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "other_header"])
def test_damaged_cache_file_is_ignored_and_rebuilt(cache_dir: Path, model_file: Path, count_dequantize: list[int],
                                                   damage: str) -> None:
    want = reference(model_file, torch.bfloat16)
    load(model_file)
    path = weights_file(model_file)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif damage == "empty":
        path.write_bytes(b"")
    else:  # a well-formed file made from something else
        current = f'"pagoda_format":"{FORMAT_VERSION}"'.encode()
        assert current in data
        path.write_bytes(data.replace(current, b'"pagoda_format":"0"'))
    count_dequantize.clear()
    assert_same(load(model_file), want)
    assert len(count_dequantize) == 1
    assert path.read_bytes() == data  # rebuilt
    count_dequantize.clear()
    assert_same(load(model_file), want)
    assert not count_dequantize


def test_consumer_stopping_early_leaves_no_file(cache_dir: Path, model_file: Path) -> None:
    weights = iter_weights(resolve_model_path(model_file), cache_dtype=torch.bfloat16)
    next(weights)
    weights.close()  # type: ignore[attr-defined]
    entry = weights_file(model_file).parent
    assert not weights_file(model_file).exists()
    assert not [p for p in entry.iterdir() if p.name.endswith(".tmp")]


def test_unwritable_cache_still_loads(tmp_path: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ROOT_ENV, str(blocker / "cache"))
    assert_same(load(model_file), reference(model_file, torch.bfloat16))


def test_orphan_and_stale_entries_are_pruned(cache_dir: Path, model_file: Path, tmp_path: Path) -> None:
    gone = write_gguf(tmp_path / "gone.gguf")
    load(gone)
    gone_entry = weights_file(gone).parent
    gone.unlink()
    orphan = cache_dir / "gguf" / "orphan"
    orphan.mkdir(parents=True)
    os.utime(orphan, (0, 0))  # a crashed writer's, long ago
    fresh_orphan = cache_dir / "gguf" / "fresh"
    fresh_orphan.mkdir()  # maybe a writer at work right now
    load(model_file)
    assert not gone_entry.exists() and not orphan.exists() and fresh_orphan.exists()


def test_config_is_cached(cache_dir: Path, model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = resolve_model_path(model_file)
    first = load_hf_config(source)
    config_file = ConvertCache.for_gguf(model_file).directory / "config.json"  # type: ignore[union-attr]
    assert config_file.is_file()
    import pagoda.model_loader.hf_config as hf_config_module

    def no_conversion(path: Path) -> None:
        raise AssertionError("the config was built from the GGUF file again")

    monkeypatch.setattr(hf_config_module, "load_gguf_config", no_conversion)
    assert not isinstance(load_hf_config(source), CachedHFConfig)  # transformers' models take only its own
    second = load_model_config(source)
    assert isinstance(second, CachedHFConfig)
    for key, value in first.to_dict().items():
        assert getattr(second, key) == value, key
    # what the model reads but to_dict may name otherwise
    for key in ("head_dim", "num_key_value_heads", "rope_parameters", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(second, key) == getattr(first, key), key
    assert second.name_or_path == first.name_or_path == str(model_file.parent)
    assert second.architectures == first.architectures == ["LlamaForCausalLM"]

    config_file.write_text("{not json")  # damaged: converted again
    monkeypatch.undo()
    monkeypatch.setenv(CACHE_ROOT_ENV, str(cache_dir))
    assert load_hf_config(source).to_dict() == first.to_dict()
    assert json.loads(config_file.read_text())["config"]["model_type"] == "llama"


def test_cached_config_is_read_without_transformers_config_classes(cache_dir: Path, model_file: Path) -> None:
    """The point of CachedHFConfig: a warm start skips ~1.5 s of transformers imports."""
    load_hf_config(resolve_model_path(model_file))  # fills the cache
    code = (
        "import sys; from pagoda.model_loader import load_model_config, resolve_model_path; "
        f"c = load_model_config(resolve_model_path({str(model_file)!r})); "
        "print(type(c).__name__, c.num_hidden_layers, 'transformers.models.llama' in sys.modules)"
    )
    env = {**os.environ, CACHE_ROOT_ENV: str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["CachedHFConfig", "2", "False"]


def test_default_model_config_and_tokenizer_from_cache_equal_the_converted(cache_dir: Path) -> None:
    source = resolve_model_path(None)
    config, tokenizer = load_hf_config(source), load_tokenizer(source)
    cache = ConvertCache.for_gguf(source.gguf_path)
    assert cache is not None and cache.tokenizer_dir() is not None
    cached_config, cached_tokenizer = load_hf_config(source), load_tokenizer(source)
    assert cached_config.to_dict() == config.to_dict()
    assert type(cached_tokenizer) is type(tokenizer)
    assert cached_tokenizer.name_or_path == tokenizer.name_or_path
    assert cached_tokenizer.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert cached_tokenizer.get_vocab() == tokenizer.get_vocab() and len(cached_tokenizer) == len(tokenizer)
    assert cached_tokenizer.special_tokens_map == tokenizer.special_tokens_map
    assert cached_tokenizer.all_special_ids == tokenizer.all_special_ids
    assert cached_tokenizer.chat_template == tokenizer.chat_template
    for text in ["Hello world", "<|im_start|>user\nhi<|im_end|>", "ünïcødé 🤖\t\tx  y", ""]:
        assert cached_tokenizer(text).input_ids == tokenizer(text).input_ids
        ids = tokenizer(text).input_ids
        assert cached_tokenizer.decode(ids) == tokenizer.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert cached_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
