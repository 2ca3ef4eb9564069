"""Errors raised while finding or reading a model checkpoint."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A checkpoint cannot be found, recognised or read; the message names what is wrong."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path does not exist (or the embedded default model is not installed)."""
