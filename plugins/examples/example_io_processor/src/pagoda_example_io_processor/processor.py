"""``chunked_embedding``: one embedding for a text of any length.

An embedding model reads at most its context (all-MiniLM-L6-v2: 256 tokens).
This processor splits a long text into chunks of ``chunk_words`` words, has
the model embed each chunk, and answers their mean weighted by each chunk's
token count, normalized to unit length: one vector for the whole text.

Request (``POST /pooling``, or ``LLM.encode({"data": ...})``)::

    {"data": {"text": "...", "chunk_words": 64}}

Response: ``{"request_id", "created_at", "data": {"embedding": [...], "num_chunks": k, "num_tokens": n}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from pagoda import PoolingParams
from pagoda.plugins.io_processors import IOProcessor, IOProcessorResponse


class ChunkedEmbeddingInput(BaseModel):
    """The plugin's part of a request (its ``data``); unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")

    text: StrictStr = Field(min_length=1)
    chunk_words: StrictInt = Field(64, ge=1)


class ChunkedEmbeddingProcessor(IOProcessor[ChunkedEmbeddingInput, dict[str, Any]]):
    def parse_request(self, request: Any) -> ChunkedEmbeddingInput:
        # the server hands its IOProcessorRequest, LLM.encode the dict it was given
        data = request["data"] if isinstance(request, dict) else request.data
        return ChunkedEmbeddingInput.model_validate(data)  # a ValidationError is a ValueError: the server's 400

    def pre_process(self, prompt: ChunkedEmbeddingInput, request_id: str | None = None, **kwargs: Any) -> list[str]:
        words = prompt.text.split()
        if not words:
            raise ValueError("text holds no words")
        n = prompt.chunk_words
        return [" ".join(words[i:i + n]) for i in range(0, len(words), n)]

    def validate_or_generate_params(self, params: Any = None) -> Any:
        if params is None:
            return PoolingParams(task="embed")
        if getattr(params, "task", None) not in (None, "embed"):
            raise ValueError(f"chunked_embedding embeds; it cannot run the task {params.task!r}")
        return params

    def post_process(self, model_output: Sequence[Any], request_id: str | None = None,
                     **kwargs: Any) -> dict[str, Any]:
        vectors = torch.stack([torch.as_tensor(o.outputs.data, dtype=torch.float32).flatten() for o in model_output])
        weights = torch.tensor([float(len(o.prompt_token_ids)) for o in model_output])
        mean = (weights[:, None] * vectors).sum(0) / weights.sum()
        embedding = torch.nn.functional.normalize(mean, dim=0)
        return {"embedding": embedding.tolist(), "num_chunks": len(model_output), "num_tokens": int(weights.sum())}

    def output_to_response(self, plugin_output: dict[str, Any]) -> IOProcessorResponse:
        return IOProcessorResponse(data=plugin_output)
