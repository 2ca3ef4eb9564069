"""Entry point of the torch paged-attention backend."""

from pagoda.plugins import AttentionBackendSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_attention_backends() -> list[AttentionBackendSpec]:
    return [
        AttentionBackendSpec(
            name="torch_paged",
            cls="pagoda_attn_torch.backend:TorchPagedAttentionBackend",
            device_types=("cpu", "cuda", "xla"),
        )
    ]
