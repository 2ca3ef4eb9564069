"""One checkpoint loader for every model family (vLLM's ``AutoWeightsLoader``).

A family's ``load_weights`` builds an ``AutoWeightsLoader`` over its model and
hands it the ``(name, tensor)`` stream; the loader decides, for each tensor,
which parameter (and which shard of it) it fills, and calls that parameter's
``weight_loader(param, tensor, shard_id)``. The parameter's layer does the
rest (where a parameter has none, its module's ``weight_loader`` method is
used: parameters made anew by ``to_empty`` lose their attributes): core's tensor-parallel layers (``pagoda.layers.parallel_linear``,
``vocab_parallel_embedding``) cut this rank's slice out of the whole checkpoint
tensor, a quantization method stores it in its own form, a Gemma norm adds its
1. A parameter without one is copied whole (``default_weight_loader``).

Where a checkpoint tensor goes is read off tables built once, up front, by
walking the module tree:

* every parameter under its own name (shard ``None``: the whole parameter);
* ``packed_modules_mapping`` (vLLM's name; fused module -> the checkpoint
  modules stacked into it, in row order): ``...q_proj.weight`` fills shard 0 of
  ``...qkv_proj.weight``. A checkpoint that stores the fused tensor itself
  loads it under the fused name (shard ``None``; the layer splits it);
* a module's own ``checkpoint_shards()`` (local checkpoint name -> (local
  parameter name, shard)), for a parameter a checkpoint stores in pieces
  outside that mapping (``PerHeadLayerNorm``: ``norms.<h>.weight`` is row h).

Every parameter must be filled by every one of its shards; an unknown name, a
tensor its layer cannot take and a parameter left unfilled raise ``ValueError``
naming the checkpoint tensor (parameters start as ``torch.empty``: a gap would
be garbage, not an error later). A family's naming differences stay in the
family: ``name_mapper`` renames a checkpoint name to the model's,
``inverse_name_mapper`` turns a model name back for the missing-weights
message, ``tensor_mapper`` changes a tensor's layout or splits it into named
pieces (all experts of a layer in one 3-D tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pagoda.distributed.pipeline import is_pp_missing_parameter

# (name, tensor) -> (name, tensor) pieces, after renaming
TensorMapper = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
    """The whole checkpoint tensor into ``param``, cast to its dtype; shapes must agree."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"the model expects {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def _identity_tensor(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield name, tensor


class AutoWeightsLoader:
    """Loads a checkpoint stream into ``module``; see the module docstring for the rules."""

    def __init__(
        self,
        module: nn.Module,
        *,
        packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
        skip_prefixes: Sequence[str] = (),
        skip_suffixes: Sequence[str] = (),
        skip_names: Collection[str] = (),
        name_mapper: Callable[[str], str] | None = None,
        inverse_name_mapper: Callable[[str], str] | None = None,
        tensor_mapper: TensorMapper | None = None,
    ) -> None:
        self.module = module
        # checked on the checkpoint's own name: buffers a checkpoint carries that the model recomputes
        self.skip_suffixes = tuple(skip_suffixes)
        # checked on the renamed name: tensors this model does not compute from (a tied LM head, an unused head)
        self.skip_prefixes = tuple(skip_prefixes)
        self.skip_names = frozenset(skip_names)
        self.name_mapper = name_mapper or (lambda name: name)
        self.inverse_name_mapper = inverse_name_mapper or (lambda name: name)
        self.tensor_mapper: TensorMapper = tensor_mapper or _identity_tensor
        # a skipped name is no parameter to fill either (a tied LM head that ``to_empty`` untied: the model ties it again)
        self.params: dict[str, nn.Parameter] = {
            name: p for name, p in module.named_parameters() if name not in self.skip_names}
        # checkpoint name (model naming) -> (parameter name, shard or None for the whole parameter)
        self.targets: dict[str, tuple[str, Any]] = {name: (name, None) for name in self.params}
        # parameter -> the checkpoint names that together fill it
        self.pieces: dict[str, list[str]] = {name: [name] for name in self.params}
        self._add_packed(dict(packed_modules_mapping or {}))
        self._add_module_shards()
        self.filled: set[str] = set()

    def _add_packed(self, packed: dict[str, Sequence[str]]) -> None:
        for pname in self.params:
            parts = pname.split(".")
            if len(parts) < 2 or parts[-2] not in packed:
                continue
            owner, leaf = parts[:-2], parts[-1]
            names = [".".join([*owner, sub, leaf]) for sub in packed[parts[-2]]]
            for shard, name in enumerate(names):
                self.targets[name] = (pname, shard)
            # the fused tensor itself still loads (a checkpoint that stores it so), but then fills every shard
            self.pieces[pname] = names

    def _add_module_shards(self) -> None:
        for prefix, mod in self.module.named_modules():
            shards = getattr(mod, "checkpoint_shards", None)
            if shards is None:
                continue
            owner = f"{prefix}." if prefix else ""
            by_param: dict[str, list[str]] = {}
            for local, (param_local, shard) in shards().items():
                pname = owner + param_local
                if pname not in self.params:
                    continue
                self.targets[owner + local] = (pname, shard)
                by_param.setdefault(pname, []).append(owner + local)
            for pname, names in by_param.items():
                self.targets.pop(pname, None)  # only its pieces load it
                self.pieces[pname] = names

    def _load_one(self, original: str, name: str, tensor: torch.Tensor) -> None:
        found = self.targets.get(name)
        if found is None:
            if is_pp_missing_parameter(name, self.module):
                return  # another pipeline stage holds it
            raise ValueError(f"checkpoint weight {original!r} matches no parameter of {type(self.module).__name__}")
        pname, shard = found
        param = self.params[pname]
        # the parameter's own loader; else its layer's (``to_empty`` from the meta device makes new
        # Parameter objects, without the attribute); else a plain copy
        owner = self.module.get_submodule(pname.rpartition(".")[0])
        loader: Callable[..., None] = default_weight_loader
        for holder in (param, owner):
            found_loader = getattr(holder, "weight_loader", None)
            if found_loader is not None:
                loader = found_loader
                break
        try:
            loader(param, tensor, shard)
        except ValueError as exc:
            raise ValueError(f"checkpoint weight {original!r} has shape {tuple(tensor.shape)}, which {pname} "
                             f"cannot take: {exc}") from exc
        if shard is None:
            self.filled.update(self.pieces[pname])
        else:
            self.filled.add(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load every tensor; return the checkpoint names consumed (skipped ones excluded)."""
        loaded: set[str] = set()
        with torch.no_grad():
            for original, tensor in weights:
                if original.endswith(self.skip_suffixes):
                    continue
                name = self.name_mapper(original)
                if name in self.skip_names or name.startswith(self.skip_prefixes):
                    continue
                for piece_name, piece in self.tensor_mapper(name, tensor):
                    self._load_one(original, piece_name, piece)
                loaded.add(original)
        missing = self.missing()
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(f"checkpoint is missing weight(s) {', '.join(missing[:8])}{more}")
        return loaded

    def missing(self) -> list[str]:
        """The checkpoint names (under the checkpoint's own naming) that no tensor filled."""
        return [self.inverse_name_mapper(name) for names in self.pieces.values() for name in names
                if name not in self.filled]


def substitute(name: str, pairs: Iterable[tuple[str, str]]) -> str:
    """``name`` with each (old, new) pair applied in order: "."-led parts anywhere, others as a prefix.

    Plain string pairs rather than patterns, so a family's rename table also runs backwards (a
    missing weight is reported under the checkpoint's own name).
    """
    for old, new in pairs:
        if old.startswith("."):
            name = name.replace(old, new)
        elif name.startswith(old):
            name = new + name[len(old):]
    return name


def load_renamed_checkpoint(model: Any, weights: Iterable[tuple[str, torch.Tensor]],
                            skip_suffixes: Sequence[str] = ()) -> set[str]:
    """Load a family whose model renames checkpoint names by a table; returns the checkpoint names consumed.

    The model provides ``checkpoint_renames`` ((checkpoint part, model part) pairs for ``substitute``),
    ``map_checkpoint_name`` (checkpoint name -> parameter name; the table, and whatever else the family
    normalises first), ``convert_checkpoint_tensor(name, tensor)`` (a layout change after renaming),
    ``packed_modules_mapping`` and ``tie_word_embeddings`` (the LM head's checkpoint weight is then skipped).
    """
    inverse = [(new, old) for old, new in reversed(model.checkpoint_renames)]

    def convert(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        yield name, model.convert_checkpoint_tensor(name, tensor)

    return AutoWeightsLoader(
        model,
        packed_modules_mapping=model.packed_modules_mapping,
        skip_suffixes=skip_suffixes,
        skip_names={"lm_head.weight"} if model.tie_word_embeddings else (),
        name_mapper=model.map_checkpoint_name,
        inverse_name_mapper=lambda name: substitute(name, inverse),
        tensor_mapper=convert,
    ).load_weights(weights)
