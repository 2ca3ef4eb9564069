"""W8A8 int8 checkpoints of tiny transformers models, made by the compressed-tensors library, and their reference.

For a model family's tests that it loads quantized checkpoints: ``save_w8a8_checkpoint``
quantizes every ``nn.Linear`` of a (seeded, tiny) transformers model with compressed-tensors'
W8A8 preset (int8 weights, one scale per output channel; int8 activations, one dynamic scale per
token), the LM head kept in float, and saves it as compressed-tensors does (``int-quantized``).
``dequantized_w8a8_reference`` turns a fresh copy of the same model into what that checkpoint
computes: each quantized Linear's weight replaced by the checkpoint's int8 weight times its scale,
and its input rounded to int8 per token (scale max|x| / 127) and back. ``check_parity`` against it
then tests the family's quantized path with transformers as the reference.

Needs the ``compressed-tensors`` package (imported when called).

Tolerances: int8 activations make the model jumpy. A float difference in the last bit moves an
element on a rounding boundary a whole int8 step (1/127 of the token's largest value), and
transformers' own output moves with it: 1e-6 relative noise on every quantized Linear's input of
the reference moved top-5 logprobs by up to 0.105 (tiny Gemma, 10 mixed prompts, every position;
0.034 for a tiny Llama at the last position). ``W8A8_LOGPROB_ATOL`` and ``W8A8_TIE_GAP`` (for
``check_parity``) are set from that, not from pagoda's own error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

W8A8_LOGPROB_ATOL = 0.15
W8A8_TIE_GAP = 0.1


def save_w8a8_checkpoint(model: Any, path: Path, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """Quantize ``model``'s ``nn.Linear`` layers in place (W8A8, ``ignore`` kept float) and save it under ``path``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)),
                              show_progress=False)
    quantized = 0
    with torch.no_grad():
        for module in model.modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            # the library leaves the scales for a calibration step to fill: min/max of each row here
            w = module.weight.float()
            scale, zero = calculate_qparams(w.amin(dim=-1), w.amax(dim=-1), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            module.weight_zero_point.data = zero.reshape(module.weight_zero_point.shape)
            quantized += 1
    if not quantized:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer that compressed-tensors would quantize")
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def dequantized_w8a8_reference(model: Any, path: Path) -> Any:
    """``model`` (a fresh copy of the one saved to ``path``) computing what the W8A8 checkpoint there computes."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    found = 0
    for name, module in model.named_modules():
        scale = state.get(f"{name}.weight_scale")
        if scale is None:
            continue
        q = state[f"{name}.weight"]
        if q.dtype != torch.int8 or tuple(q.shape) != tuple(module.weight.shape):
            raise ValueError(f"{name}: expected an int8 weight of shape {tuple(module.weight.shape)}, "
                             f"the checkpoint has {q.dtype} {tuple(q.shape)}")
        module.weight.data = q.float() * scale.float()
        module.register_forward_pre_hook(_fake_quantize_input)
        found += 1
    if not found:
        raise ValueError(f"no quantized layer of {type(model).__name__} is in the checkpoint at {path}")
    return model


def _fake_quantize_input(module: Any, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, 1.0)
    q = torch.where(scale > 0, torch.round(x / safe), 0.0).clamp(-127, 127)
    return (q * scale, *args[1:])


def check_w8a8_parity(config: Any, tmp_path: Path, min_tokens: int = 80, **llm_kwargs: Any) -> Any:
    """A tiny seeded model of ``config`` saved as W8A8 and served by the engine: ``check_parity`` against
    its dequantized reference, with the tolerances above; returns the report (at least ``min_tokens``
    tokens compared). ``llm_kwargs`` go to the engine (e.g. ``model_impl``)."""
    from pagoda.testing.model_parity import build_tiny_model, check_parity

    path = save_w8a8_checkpoint(build_tiny_model(config, seed=1), tmp_path / "ckpt")
    reference = dequantized_w8a8_reference(build_tiny_model(config, seed=1), path)
    report = check_parity(reference, tmp_path, model_path=path, logprob_atol=W8A8_LOGPROB_ATOL, tie_gap=W8A8_TIE_GAP,
                          llm_kwargs=llm_kwargs or None)
    assert report.num_tokens_compared >= min_tokens, report
    return report
