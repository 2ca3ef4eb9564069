"""Entry point of the TPU platform plugin: only specs, nothing heavy."""

from pagoda.plugins import PlatformSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="tpu",
            cls="pagoda_platform_tpu.platform:TpuPlatform",
            device_type="xla",
            package="pagoda-platform-tpu",
            priority=100,
            verified_on_hardware=False,
        )
    ]
