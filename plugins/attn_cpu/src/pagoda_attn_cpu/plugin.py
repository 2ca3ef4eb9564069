"""Entry point of the CPU paged-attention backend."""

from typing import Any

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


@hookimpl
def pagoda_startup(config: Any) -> None:
    # An engine is starting: begin compiling the kernel it will likely use while the weights load.
    if config is not None:
        from pagoda_attn_cpu.early_build import start_for_engine

        start_for_engine(config)
