"""Export a model pagoda can load (e.g. the default GGUF) as a plain HF directory,
so peers (transformers, vLLM) run on exactly the same weights."""

from __future__ import annotations

from pathlib import Path

import torch


def export_hf_dir(model: str | None, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    from safetensors.torch import save_file

    from pagoda.model_loader import iter_weights, load_hf_config, load_tokenizer, resolve_model_path

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model_path(model)
    config = load_hf_config(source)
    tensors = {name: t.to(dtype).contiguous() for name, t in iter_weights(source)}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    config.torch_dtype = dtype
    config.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
