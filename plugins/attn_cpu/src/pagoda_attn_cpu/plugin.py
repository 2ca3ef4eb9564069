"""Entry point of the CPU paged-attention backend."""

from pagoda.plugins import AttentionBackendSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="cpu_paged",
            cls="pagoda_attn_cpu.backend:CpuPagedAttentionBackend",
            device_types=("cpu",),
        )
    ]
