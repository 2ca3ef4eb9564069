"""Entry point of the CPU platform plugin: only specs, nothing heavy."""

from pagoda.envs import EnvRegistry
from pagoda.plugins import PlatformSpec, hookimpl

# 1.5: pagoda_add_env_vars
PAGODA_PLUGIN_API_VERSION = "1.5"


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


@hookimpl
def pagoda_add_env_vars(registry: EnvRegistry) -> None:
    from pagoda_platform_cpu.env_vars import VARIABLES

    registry.add(*VARIABLES)
