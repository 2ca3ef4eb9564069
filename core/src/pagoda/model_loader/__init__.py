"""Finding a checkpoint and reading its config, tokenizer and weights (HF safetensors/.bin or GGUF)."""

from pagoda.model_loader.errors import ModelLoadError, ModelNotFoundError
from pagoda.model_loader.generation_config import GenerationDefaults, load_generation_defaults
from pagoda.model_loader.hf_config import apply_hf_overrides, load_hf_config, load_model_config
from pagoda.model_loader.source import ModelSource, default_model_path, resolve_model_path
from pagoda.model_loader.tokenizer import load_tokenizer
from pagoda.model_loader.weights import LOAD_FORMATS, checkpoint_dtype, iter_weights

__all__ = [
    "LOAD_FORMATS",
    "GenerationDefaults",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelSource",
    "apply_hf_overrides",
    "checkpoint_dtype",
    "default_model_path",
    "iter_weights",
    "load_generation_defaults",
    "load_hf_config",
    "load_model_config",
    "load_tokenizer",
    "resolve_model_path",
]
