"""Request bodies of the pooling endpoints (embeddings, pooling, classify, score, rerank), with vLLM's fields.

As in ``protocol``, unknown fields are accepted and logged once as ignored (or
refused by name where they ask for what pagoda cannot do), and every bound
pydantic can check is declared here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, model_validator

from pagoda.entrypoints.openai.protocol import ChatMessage, PromptInput, _Body

# vLLM's pooling tasks a /pooling request may name.
PoolingTask = Literal["encode", "embed", "classify", "score", "token_embed", "token_classify"]


class _PoolingFields(_Body):
    """What every pooling request shares (vLLM's PoolingBasicRequestMixin, less multimodal)."""

    model: StrictStr | None = None
    user: StrictStr | None = None
    # -1: truncate to max_model_len; k > 0: keep k tokens (text: the first k; token ids: the last k, as vLLM)
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    request_id: StrictStr | None = None
    priority: StrictInt = Field(0, ge=-(2**63), le=2**63 - 1)

    @model_validator(mode="after")
    def _truncate_not_zero(self) -> Any:
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's length) or a positive number of tokens")
        return self


class _ChatInputFields(_Body):
    """A conversation rendered with the chat template, instead of ``input`` (vLLM's chat embeddings)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def tools(self) -> None:
        # chat_prompt reads it; a pooling request carries no tools
        return None

    def template_kwargs(self) -> dict[str, Any] | None:
        return self.chat_template_kwargs

    @model_validator(mode="after")
    def _consistent(self) -> Any:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class _EmbedFields(_Body):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    normalize: StrictBool | None = None


class EmbeddingCompletionRequest(_PoolingFields, _EmbedFields):
    """POST /v1/embeddings with ``input``: a string, strings, token ids, or lists of token ids."""

    input: PromptInput
    add_special_tokens: StrictBool = True


class EmbeddingChatRequest(_PoolingFields, _EmbedFields, _ChatInputFields):
    """POST /v1/embeddings with ``messages``."""


class PoolingCompletionRequest(EmbeddingCompletionRequest):
    """POST /pooling: the pooler's raw output for ``task`` (default: the model's own task)."""

    task: PoolingTask | None = None
    use_activation: StrictBool | None = None


class PoolingChatRequest(EmbeddingChatRequest):
    task: PoolingTask | None = None
    use_activation: StrictBool | None = None


class IOProcessorRequest(_Body):
    """POST /pooling with ``data``: a request for the server's IO processor plugin, which reads ``data``."""

    model: StrictStr | None = None
    user: StrictStr | None = None
    request_id: StrictStr | None = None
    priority: StrictInt = Field(0, ge=-(2**63), le=2**63 - 1)
    data: Any


class ClassificationRequest(_PoolingFields):
    """POST /classify."""

    input: PromptInput
    add_special_tokens: StrictBool = True
    use_activation: StrictBool | None = None


class ScoreRequest(_PoolingFields):
    """POST /score (and /v1/score): text_1 against text_2, 1:1, 1:N or N:N."""

    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: StrictBool | None = None


class RerankDocumentIn(_Body):
    """A document given as an object (Jina's and Cohere v1's shape)."""

    text: StrictStr


class RerankRequest(_PoolingFields):
    """POST /rerank, /v1/rerank (Jina, Cohere v1) and /v2/rerank (Cohere v2): one response shape, vLLM's."""

    query: StrictStr
    documents: list[StrictStr | RerankDocumentIn] = Field(min_length=1)
    # 0: every document (vLLM); Jina and Cohere send None for "all"
    top_n: StrictInt | None = Field(None, ge=0)
    # Jina and Cohere: whether each result carries its document; vLLM always sends it
    return_documents: StrictBool = True
    use_activation: StrictBool | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]
