"""vLLM's default logging for offline use: ``LLM()`` shows what it loaded and how much KV cache it has.

A library must not take over the application's logging, so this acts only when the application configured
none (the root logger has no handler): then pagoda's loggers, and those of the installed plugins'
packages, write INFO lines to stderr, as vLLM's ``vllm`` logger does by default. They do not propagate
(vLLM's choice too), so a ``logging.basicConfig`` made later does not print them twice.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def _plugin_packages() -> set[str]:
    """Top-level packages of the installed plugins (pagoda_platform_cpu, pagoda_attn_cpu, ...)."""
    from importlib_metadata import entry_points

    from pagoda.plugins import ENTRY_POINT_GROUPS

    return {ep.value.split(":", 1)[0].split(".", 1)[0] for group in ENTRY_POINT_GROUPS.values()
            for ep in entry_points(group=group)}


def configure_default_logging() -> None:
    if logging.getLogger().handlers:
        return  # the application's own configuration decides
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    for name in sorted({"pagoda", *_plugin_packages()}):
        package_logger = logging.getLogger(name)
        if package_logger.handlers:
            continue  # configured already (an earlier LLM(), or the application)
        package_logger.addHandler(handler)
        if package_logger.level == logging.NOTSET:
            package_logger.setLevel(logging.INFO)
        package_logger.propagate = False
