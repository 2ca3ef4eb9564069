"""The engine's errors, importable without the engine (the server's error handlers load before torch)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The core thread is gone; no request can be served any more."""


class EngineSleepingError(RuntimeError):
    """The engine is asleep (``sleep``): ``wake_up`` it before sending requests."""


class EngineGenerateError(RuntimeError):
    """The engine failed while computing this request (an internal error, not bad input)."""
