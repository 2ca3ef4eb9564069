"""vLLM's ``backend="auto"``: per request, xgrammar when it supports the constraint, else guidance (llguidance)."""

from __future__ import annotations

import threading
from typing import Any

from pagoda.structured_output.backend import CompiledGrammar, StructuredOutputBackend, StructuredOutputError
from pagoda.structured_output.params import StructuredOutputsParams

# Tried in this order; any other installed backend comes after them, by name.
AUTO_ORDER = ("xgrammar", "guidance")


class AutoBackend(StructuredOutputBackend):
    """Picks a backend per request in the front end (``validate``) and compiles with it beside the scheduler."""

    name = "auto"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(tokenizer, vocab_size)
        self._backends: dict[str, StructuredOutputBackend] = {}
        # compile() runs in the manager's thread pool: two first requests must not build a backend twice
        self._lock = threading.Lock()

    @classmethod
    def select(cls, params: StructuredOutputsParams) -> str:
        """The first backend (AUTO_ORDER) whose ``validate`` accepts ``params``; records it on ``params``."""
        from pagoda.structured_output.manager import available_backends, load_backend_class

        if params._backend is not None:
            return params._backend
        installed = available_backends()
        order = [n for n in AUTO_ORDER if n in installed] + sorted(n for n in installed if n not in AUTO_ORDER)
        errors: list[str] = []
        for name in order:
            try:
                load_backend_class(name).validate(params)
            except StructuredOutputError as exc:
                errors.append(f"{name}: {exc}")
                continue
            params._backend = name
            return name
        if len(errors) == 1:
            raise StructuredOutputError(errors[0].split(": ", 1)[1])
        raise StructuredOutputError("no structured outputs backend accepts this constraint (" + "; ".join(errors) + ")")

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        cls.select(params)

    def backend_for(self, params: StructuredOutputsParams) -> StructuredOutputBackend:
        from pagoda.structured_output.manager import load_backend_class

        name = self.select(params)
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = load_backend_class(name)(self.tokenizer, self.vocab_size)
        return backend

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self.backend_for(params).compile(params)
