"""Choose the attention backend: an explicit choice, else the platform's preference."""

from __future__ import annotations

from pagoda import envs
from pagoda.attention.interface import AttentionBackend, AttentionSpec
from pagoda.attention.kv_quant import is_fp8
from pagoda.platforms import Platform
from pagoda.plugins import get_plugin_manager

BACKEND_ENV = "PAGODA_ATTENTION_BACKEND"


class AttentionBackendError(RuntimeError):
    pass


def select_attention_backend(platform: Platform, spec: AttentionSpec, requested: str | None = None) -> type[AttentionBackend]:
    specs = get_plugin_manager().attention_backends()
    requested = requested or envs.PAGODA_ATTENTION_BACKEND
    if requested:
        if requested not in specs:
            raise AttentionBackendError(
                f"attention backend {requested!r} is not installed; installed: {', '.join(sorted(specs)) or 'none'}"
            )
        cls: type[AttentionBackend] = specs[requested].load()
        reasons = _reasons(cls, spec)
        if reasons:
            raise AttentionBackendError(f"attention backend {requested!r} cannot serve this model here: {'; '.join(reasons)}")
        return cls
    tried: list[str] = []
    for name in platform.attention_backend_preference(spec):
        if name not in specs:
            tried.append(f"{name}: not installed")
            continue
        if spec.device_type not in specs[name].device_types:
            tried.append(f"{name}: does not run on {spec.device_type}")
            continue
        candidate: type[AttentionBackend] = specs[name].load()
        reasons = _reasons(candidate, spec)
        if not reasons:
            return candidate
        tried.append(f"{name}: {'; '.join(reasons)}")
    raise AttentionBackendError(
        f"no attention backend can serve this model on platform {platform.name!r}: "
        + ("; ".join(tried) or "the platform prefers none")
        + ". Install one (e.g. pagoda-attn-torch) or pick one with --attention-backend."
    )


def _reasons(cls: type[AttentionBackend], spec: AttentionSpec) -> list[str]:
    reasons = cls.reasons_unsupported(spec)
    if is_fp8(spec.cache_dtype) and not cls.supports_fp8_kv_cache:
        reasons = [*reasons, f"an fp8 KV cache ({spec.cache_dtype}) is not implemented by this backend"]
    return reasons
