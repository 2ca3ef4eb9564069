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
    config.dtype = dtype
    config.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def export_gguf(model: str | None, out_path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Rewrite a GGUF model with every tensor dequantized to F32 (or BF16), metadata unchanged.

    llama.cpp then runs the same weights as pagoda's HF export (both dequantize the
    same blocks), at the precision of the workload instead of the file's quantization.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    from pagoda.model_loader import resolve_model_path

    out = Path(out_path)
    if out.exists():
        return out
    source = resolve_model_path(model)
    if source.kind != "gguf":
        raise ValueError(f"{source.display_name} is not a GGUF model")
    reader = GGUFReader(source.gguf_path)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".partial")
    writer = GGUFWriter(tmp, arch)
    file_type = {torch.float32: 0, torch.bfloat16: 32}[dtype]  # LLAMA_FTYPE_ALL_F32 / MOSTLY_BF16
    writer.add_uint32("general.file_type", file_type)  # what this file holds now, not the source's quantization
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if dtype == torch.bfloat16 and values.ndim > 1:
            bits = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(tensor.name, bits, raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(tensor.name, values)  # norms stay F32, as llama.cpp's converter keeps them
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out
