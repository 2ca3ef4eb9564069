"""Entry point of the CPU platform plugin: only specs, nothing heavy."""

from pagoda.plugins import PlatformSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.0"


@hookimpl
def pagoda_register_platforms() -> list[PlatformSpec]:
    return [
        PlatformSpec(
            name="cpu",
            cls="pagoda_platform_cpu.platform:CpuPlatform",
            device_type="cpu",
            package="pagoda-platform-cpu",
            priority=0,
        )
    ]
