"""Tensors of a Hugging Face checkpoint directory: safetensors (single or sharded) or PyTorch ``.bin``.

Tensors are yielded one at a time from memory-mapped files, so the loader
never holds a second copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagoda.model_loader.errors import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
# Files with a weight-like suffix that trainers leave beside the model; never model weights.
_NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.bin", "scheduler.pt")


def _files_from_index(directory: Path, index_name: str) -> list[Path]:
    index_path = directory / index_name
    try:
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read the shard index {index_path}: {exc}") from exc
    files = [directory / name for name in sorted(set(weight_map.values()))]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"Shard index {index_path} lists files that are missing: {', '.join(missing)}")
    return files


def safetensors_files(directory: Path) -> list[Path]:
    """The safetensors files holding the model; empty when there are none."""
    if (directory / SAFETENSORS_INDEX).is_file():
        return _files_from_index(directory, SAFETENSORS_INDEX)
    return sorted(directory.glob("*.safetensors"))


def pt_files(directory: Path) -> list[Path]:
    """The PyTorch pickle files (``.bin``/``.pt``) holding the model; empty when there are none."""
    if (directory / PT_INDEX).is_file():
        return _files_from_index(directory, PT_INDEX)
    candidates = sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt"))
    return [f for f in candidates if f.name not in _NOT_WEIGHTS and not f.name.startswith("rng_state")]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def iter_pt(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            # weights_only: a checkpoint is data, never code to run
            state_dict = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # torch raises several types for corrupt / legacy / unsafe pickles
            raise ModelLoadError(f"Cannot load PyTorch weights from {file}: {exc}") from exc
        if not isinstance(state_dict, dict):
            raise ModelLoadError(f"{file} holds a {type(state_dict).__name__}, not a state dict of tensors")
        for name in list(state_dict):
            tensor = state_dict.pop(name)  # drop our reference as we go
            if not isinstance(tensor, torch.Tensor):
                raise ModelLoadError(f"{file} entry {name!r} is a {type(tensor).__name__}, not a tensor")
            yield name, tensor
        del state_dict
