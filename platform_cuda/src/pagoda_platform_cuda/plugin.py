"""Entry point of the CUDA platform plugin: only specs, nothing heavy."""

from pagoda.plugins import PlatformSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="cuda",
            cls="pagoda_platform_cuda.platform:CudaPlatform",
            device_type="cuda",
            package="pagoda-platform-cuda",
            priority=100,
            verified_on_hardware=False,  # see CudaPlatform.verified_on_hardware
        )
    ]
