"""Entry point of the ROCm platform plugin: only specs, nothing heavy."""

from pagoda.plugins import PlatformSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="rocm",
            cls="pagoda_platform_rocm.platform:RocmPlatform",
            device_type="cuda",  # torch exposes HIP devices as "cuda"
            package="pagoda-platform-rocm",
            priority=100,
            verified_on_hardware=False,
        )
    ]
