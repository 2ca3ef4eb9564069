"""Entry point of the Triton paged-attention backend: only the spec, no triton import."""

from pagoda.plugins import AttentionBackendSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="triton_paged",
            cls="pagoda_attn_triton.backend:TritonPagedAttentionBackend",
            # ROCm devices are "cuda" devices to torch.
            device_types=("cuda",),
        )
    ]
