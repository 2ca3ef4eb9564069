"""The front end's multimodal processor: a prompt and its images -> token ids with the placeholders
expanded, and one ``MultiModalFeature`` per image (vLLM v1's input processor, in the front end so the
engine core never runs a Hugging Face processor).

Processing is transformers' ``AutoProcessor`` for the model (its image processor, its placeholder
expansion), called once per prompt; its outputs are cached (``ProcessedInputCache``) under the hash of the
prompt text, its images' content hashes and the processor arguments, so a repeated request skips it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.multimodal.hashing import hash_image, hash_prompt
from pagoda.multimodal.inputs import MultiModalFeature, MultiModalInputs, PlaceholderRange

if TYPE_CHECKING:
    from pagoda.config import EngineConfig

logger = logging.getLogger(__name__)

SUPPORTED_MODALITIES = ("image",)
# vLLM's default when limit_mm_per_prompt does not name a modality
DEFAULT_LIMIT_PER_PROMPT = 999
# what the processor returns beside the items' tensors
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids"})


def parse_mm_data(mm_data: Any, limits: dict[str, int]) -> list[Any]:
    """``multi_modal_data`` -> its images, checked (types, modalities, ``limit_mm_per_prompt``)."""
    from PIL import Image

    if not isinstance(mm_data, dict):
        raise ValueError(f"multi_modal_data must be a dict of modality -> items, got {type(mm_data).__name__}")
    unsupported = sorted(k for k in mm_data if k not in SUPPORTED_MODALITIES)
    if unsupported:
        raise ValueError(f"multi_modal_data has unsupported modality {unsupported[0]!r}; supported: "
                         f"{', '.join(SUPPORTED_MODALITIES)}")
    items = mm_data.get("image")
    if items is None:
        return []
    images = list(items) if isinstance(items, (list, tuple)) else [items]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}")
    limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
    if len(images) > limit:
        raise ValueError(f"the prompt has {len(images)} image(s), more than limit_mm_per_prompt allows "
                         f"({{'image': {limit}}})")
    return images


def placeholder_ranges(ids: list[int], token_id: int, num_items: int) -> list[PlaceholderRange]:
    """Each item's run of placeholder tokens. Adjacent items' runs touch, so a run holding several items is
    split evenly (a processor that expands every image alike: LLaVA 1.5's fixed 576 tokens)."""
    runs: list[PlaceholderRange] = []
    start = None
    for i, t in enumerate([*ids, -1]):
        if t == token_id and start is None:
            start = i
        elif t != token_id and start is not None:
            runs.append(PlaceholderRange(start, i - start))
            start = None
    if len(runs) == num_items:
        return runs
    total = sum(r.length for r in runs)
    if num_items == 0 or total % num_items or any(r.length % (total // num_items) for r in runs):
        raise ValueError(f"the prompt expands to {len(runs)} run(s) of image placeholder tokens ({total} tokens) "
                         f"for {num_items} image(s): give one image placeholder per image")
    size = total // num_items
    return [PlaceholderRange(r.offset + k * size, size) for r in runs for k in range(r.length // size)]


def split_items(processor: Any, ids: list[int], outputs: dict[str, Any], image_token_id: int,
                num_items: int) -> list[tuple[PlaceholderRange, dict[str, Any]]]:
    """Each item's placeholder range and processed tensors, for a processor that expands every image into one
    contiguous run of image tokens and stacks one tensor row per image (LLaVA 1.5). A family whose processor
    does otherwise declares ``split_mm_items`` (same arguments but ``image_token_id``; Idefics3's tiles)."""
    ranges = placeholder_ranges(ids, image_token_id, num_items)
    return [(r, {k: v[i:i + 1].contiguous() for k, v in outputs.items() if v.shape[:1] == (num_items,)})
            for i, r in enumerate(ranges)]


@dataclass(frozen=True)
class _Processed:
    ids: list[int]
    inputs: MultiModalInputs
    nbytes: int


class ProcessedInputCache:
    """Least recently used processor outputs, at most ``capacity_bytes`` of tensors (``mm_processor_cache_gb``)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, _Processed] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> _Processed | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: _Processed) -> None:
        if entry.nbytes > self.capacity_bytes or key in self._entries:
            return
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes

    def __len__(self) -> int:
        return len(self._entries)


class MultiModalProcessor:
    """A multimodal model's processor (``AutoProcessor.from_pretrained`` of its directory)."""

    def __init__(self, processor: Any, image_token_id: int, limits: dict[str, int] | None,
                 processor_kwargs: dict[str, Any] | None, cache_bytes: int, max_item_tokens: int | None,
                 model_cls: type | None = None) -> None:
        self.processor = processor
        self.image_token_id = image_token_id
        # the model family's own item splitter, where its processor's layout is not LLaVA's
        self._split_mm_items = getattr(model_cls, "split_mm_items", None)
        self.limits = dict(limits or {})
        self.processor_kwargs = dict(processor_kwargs or {})
        self.cache = ProcessedInputCache(cache_bytes)
        # the encoder budget / cache size where the user set them: an item over them is refused here (unset,
        # the scheduler runs an item larger than its budget alone in a step)
        self.max_item_tokens = max_item_tokens

    @classmethod
    def load(cls, path: str, trust_remote_code: bool, hf_config: Any, **kwargs: Any) -> MultiModalProcessor:
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 (what transformers raises varies: OSError, ValueError, KeyError)
            raise ValueError(f"the multimodal model at {path} has no loadable processor (AutoProcessor): {exc}") from exc
        token_id = getattr(hf_config, "image_token_index", None)
        if token_id is None:
            token_id = getattr(hf_config, "image_token_id", None)
        if token_id is None:
            raise ValueError(f"the model config at {path} names no image token (image_token_index)")
        return cls(processor, int(token_id), **kwargs)

    @property
    def chat_template(self) -> str | None:
        """The processor's chat template (where a checkpoint keeps it beside the processor, not the tokenizer)."""
        return getattr(self.processor, "chat_template", None)

    def process(self, text: str, mm_data: Any, mm_processor_kwargs: dict[str, Any] | None = None
                ) -> tuple[list[int], MultiModalInputs]:
        """-> (the prompt's token ids, placeholders expanded; its items). ValueError for bad input."""
        images = parse_mm_data(mm_data, self.limits)
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ValueError("mm_processor_kwargs must be a dict")
        kwargs = {**self.processor_kwargs, **(mm_processor_kwargs or {})}
        identifiers = [hash_image(image, kwargs) for image in images]
        key = hash_prompt(text, identifiers, kwargs)
        cached = self.cache.get(key)
        if cached is None:
            cached = self._run(text, images, identifiers, kwargs)
            self.cache.put(key, cached)
        return list(cached.ids), cached.inputs

    def _run(self, text: str, images: list[Any], identifiers: list[str], kwargs: dict[str, Any]) -> _Processed:
        try:
            out = self.processor(text=text, images=images or None, return_tensors="pt", **kwargs)
        except Exception as exc:  # noqa: BLE001 (a processor's input errors have no common type)
            raise ValueError(f"the model's processor refused the input: {exc}") from exc
        ids = [int(t) for t in out["input_ids"][0]]
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and hasattr(v, "shape")}
        if not images:
            items: list[tuple[PlaceholderRange, dict[str, Any]]] = []
        elif self._split_mm_items is not None:
            items = self._split_mm_items(self.processor, ids, tensors, len(images))
        else:
            items = split_items(self.processor, ids, tensors, self.image_token_id, len(images))
        for r, _ in items:
            if self.max_item_tokens is not None and r.num_embeds > self.max_item_tokens:
                raise ValueError(f"an image takes {r.num_embeds} encoder outputs, more than the encoder budget of "
                                 f"{self.max_item_tokens} (max_num_encoder_input_tokens / encoder_cache_size)")
        features: list[MultiModalFeature] = []
        nbytes = 0
        for identifier, (placeholder, data) in zip(identifiers, items):
            nbytes += sum(t.numel() * t.element_size() for t in data.values())
            features.append(MultiModalFeature("image", identifier, placeholder, data))
        return _Processed(ids, MultiModalInputs(features), nbytes)


def load_mm_processor(config: EngineConfig) -> MultiModalProcessor | None:
    """The processor of a model whose class declares ``SupportsMultiModal``; None for any other model."""
    from pagoda.models.interface import supports_multimodal
    from pagoda.models.registry import ModelRegistry, UnsupportedArchitectureError

    model = config.resolved
    mc = config.model
    hf = model.hf_config
    if getattr(hf, "vision_config", None) is None or model.runner_type != "generate" or mc.skip_tokenizer_init:
        return None
    try:
        cls = ModelRegistry.resolve(list(getattr(hf, "architectures", None) or []), mc.model_impl, hf,
                                    mc.trust_remote_code).load()
    except UnsupportedArchitectureError:
        return None  # the core names the problem when it loads the model
    if not supports_multimodal(cls):
        return None
    for modality in mc.limit_mm_per_prompt or {}:
        if modality not in cls.supported_modalities:
            raise ValueError(f"limit_mm_per_prompt names {modality!r}, which {cls.__name__} does not take "
                             f"(it takes: {', '.join(cls.supported_modalities)})")
    sc = config.scheduler_config
    budgets = [b for b in (sc.max_num_encoder_input_tokens, sc.encoder_cache_size) if b is not None]
    return MultiModalProcessor.load(
        str(model.source.path), mc.trust_remote_code, hf, limits=mc.limit_mm_per_prompt,
        processor_kwargs=mc.mm_processor_kwargs, cache_bytes=int(mc.mm_processor_cache_gb * (1 << 30)),
        max_item_tokens=min(budgets) if budgets else None, model_cls=cls)
