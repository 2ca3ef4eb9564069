"""``vllm.engine.arg_utils``: the engine arguments (pagoda's pydantic ``EngineArgs``)."""

from pagoda.config import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
