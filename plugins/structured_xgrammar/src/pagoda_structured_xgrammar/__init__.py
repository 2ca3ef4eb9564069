"""pagoda's structured-outputs backend on xgrammar.

``XgrammarBackend`` is imported on first access: the plugin's entry point (``plugin``) is loaded by
every engine process, and importing xgrammar (with transformers) cost ~0.7 s of each engine core's
start-up whether or not a request ever asked for a grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda_structured_xgrammar.backend import XgrammarBackend

__all__ = ["XgrammarBackend"]


def __getattr__(name: str) -> Any:
    if name == "XgrammarBackend":
        from pagoda_structured_xgrammar.backend import XgrammarBackend

        return XgrammarBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
