"""pagoda's structured-outputs backend on xgrammar."""

from pagoda_structured_xgrammar.backend import XgrammarBackend

__all__ = ["XgrammarBackend"]
