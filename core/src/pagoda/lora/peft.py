"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors`` (or ``.bin``).

What PEFT can express and pagoda does not serve is refused by name (vLLM's rules): ``modules_to_save``
(whole replaced modules), DoRA (``use_dora``), LoRA biases, per-module rank/alpha patterns, layer
replication, embedding / LM-head adapters. Every refusal is a ``LoRAAdapterError`` naming the adapter
and the reason; a missing directory or file is its ``LoRAAdapterNotFoundError`` (the server's 404).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# a PEFT weight name: base_model.model.<module>.lora_A.weight (some tools keep the adapter's name: .lora_A.default.weight)
_WEIGHT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<factor>[AB])(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names it and says why."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """The adapter's directory or one of its files does not exist."""


@dataclass(frozen=True)
class PEFTConfig:
    """The fields of ``adapter_config.json`` that decide how the adapter computes."""

    r: int
    lora_alpha: float
    use_rslora: bool
    # module names, or one regex matched against the whole module name (PEFT's two forms)
    target_modules: list[str] | str

    @property
    def scaling(self) -> float:
        """What B·A is multiplied by: alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, module_name: str) -> bool:
        """Whether PEFT would have put an adapter on ``module_name`` (a checkpoint module name)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(module_name == t or module_name.endswith(f".{t}") for t in self.target_modules)


def _refuse(name: str, reason: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"LoRA adapter {name!r}: {reason}")


def read_peft_config(name: str, path: str | Path, max_lora_rank: int) -> PEFTConfig:
    """The adapter's config, checked against what pagoda serves and against ``max_lora_rank``."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: no directory at {str(path)!r}")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: {config_path} is missing (a PEFT adapter has "
                                       f"{CONFIG_FILE} and {' or '.join(WEIGHT_FILES)})")
    try:
        raw: dict[str, Any] = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise _refuse(name, f"{config_path} is not valid JSON: {e}") from e
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise _refuse(name, f"peft_type={peft_type!r}; only LoRA adapters (peft_type 'LORA') are served")
    if raw.get("use_dora"):
        raise _refuse(name, "use_dora=True: DoRA adapters are not supported")
    if raw.get("modules_to_save"):
        raise _refuse(name, f"modules_to_save={raw['modules_to_save']!r}: adapters that replace whole modules are "
                            "not supported (only LoRA factors)")
    if raw.get("bias", "none") != "none" or raw.get("lora_bias"):
        raise _refuse(name, f"bias={raw.get('bias')!r}: adapters that train biases are not supported (bias 'none' only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise _refuse(name, f"{key}={raw[key]!r}: per-module ranks or alphas are not supported")
    for key in ("layer_replication", "target_parameters", "megatron_config"):
        if raw.get(key):
            raise _refuse(name, f"{key}={raw[key]!r} is not supported")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r < 1:
        raise _refuse(name, f"r={r!r} in {CONFIG_FILE} is not a positive rank")
    if r > max_lora_rank:
        raise _refuse(name, f"rank r={r} is larger than max_lora_rank={max_lora_rank}; start the engine with "
                            f"max_lora_rank >= {r}")
    if not isinstance(alpha, (int, float)):
        raise _refuse(name, f"lora_alpha={alpha!r} in {CONFIG_FILE} is not a number")
    targets = raw.get("target_modules")
    if not isinstance(targets, (str, list)) or not targets:
        raise _refuse(name, f"target_modules={targets!r} in {CONFIG_FILE} names no modules")
    return PEFTConfig(r=r, lora_alpha=float(alpha), use_rslora=bool(raw.get("use_rslora", False)),
                      target_modules=targets if isinstance(targets, str) else [str(t) for t in targets])


def read_peft_weights(name: str, path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """checkpoint module name -> (A [r, in], B [out, r]) as stored (no scaling applied)."""
    folder = Path(path)
    tensors: dict[str, torch.Tensor]
    if (folder / WEIGHT_FILES[0]).is_file():
        from safetensors.torch import load_file

        tensors = load_file(str(folder / WEIGHT_FILES[0]))
    elif (folder / WEIGHT_FILES[1]).is_file():
        tensors = torch.load(str(folder / WEIGHT_FILES[1]), map_location="cpu", weights_only=True)
    else:
        raise LoRAAdapterNotFoundError(f"LoRA adapter {name!r}: no {' or '.join(WEIGHT_FILES)} in {str(path)!r}")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding_" in key or "modules_to_save" in key:
            raise _refuse(name, f"weight {key!r}: embedding adapters and modules_to_save are not supported")
        match = _WEIGHT_NAME.match(key)
        if match is None:
            raise _refuse(name, f"weight {key!r} is not a LoRA factor (expected <module>.lora_A.weight / .lora_B.weight)")
        factors.setdefault(match["module"], {})[match["factor"]] = tensor
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise _refuse(name, f"module {module!r} has lora_{''.join(pair)} but not both LoRA factors")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise _refuse(name, f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                                "[r, in] and [out, r] of one rank")
        out[module] = (a, b)
    if not out:
        raise _refuse(name, "its weights hold no LoRA factors")
    return out
