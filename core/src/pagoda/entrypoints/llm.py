"""``LLM``: offline inference with vLLM's API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.beam_search import BeamSearchOutput, EarlyStopping, request_output_to_beam_search_output
from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.chat_utils import is_conversation_list, render_chat_prompt
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# Show a progress bar only for batches long enough to be worth watching.
_TQDM_MIN_PROMPTS = 8


class LLM:
    """An engine plus a tokenizer for offline batches.

    ``LLM()`` with no model serves the embedded default (SmolLM2-135M-Instruct).
    Every keyword is an engine argument (see ``pagoda.config.EngineArgs``);
    an unknown one is an error naming it.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._request_counter = 0

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no sampling params: pagoda's defaults with the
        model's generation config on top (``generation_config``; vLLM's method of the same name)."""
        generation = self.llm_engine.config.resolved.generation
        if generation is None or not generation.sampling:
            return SamplingParams()
        return SamplingParams.from_optional(**generation.sampling)

    def _normalize(self, prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
                return [{"prompt_token_ids": list(prompts)}]
            return list(prompts)
        raise TypeError(f"prompts must be a string, a prompt dict or a list of them, not {type(prompts).__name__}")

    def _params_list(self, params: Any, n: int) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts; pass one or one per prompt")
        return params

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        items = self._normalize(prompts)
        params = self._params_list(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"got {len(priority)} priorities for {len(items)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(items, params)):
                if p.output_kind != RequestOutputKind.FINAL_ONLY:
                    p = p.clone()
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(self._request_counter)
                self._request_counter += 1
                self.llm_engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[Any],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the tokenizer's chat template, or ``chat_template``)."""
        conversations = list(messages) if is_conversation_list(messages) else [messages]
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = render_chat_prompt(
                tokenizer, conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template_kwargs=chat_template_kwargs,
            )
            # the template writes its own special tokens (BOS included)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        early_stopping: EarlyStopping = False,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt at once, inside the scheduler (beams fork and share KV blocks).

        Ranking and stopping follow transformers' ``generate(num_beams=W, do_sample=False,
        early_stopping=False)`` (see ``pagoda.beam_search.group``).
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        items = self._normalize(prompts)
        ids: list[str] = []
        try:
            for prompt in items:
                rid = str(self._request_counter)
                self._request_counter += 1
                self.llm_engine.add_beam_search_request(rid, prompt, params, early_stopping=early_stopping)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise
        tokenizer = self.get_tokenizer()
        return [request_output_to_beam_search_output(o, tokenizer) for o in self._run_engine(ids, use_tqdm)]

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) >= _TQDM_MIN_PROMPTS:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        out_tokens = 0
        try:
            wanted = set(ids)
            while len(results) < len(ids):
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
                            bar.update(1)
                if not self.llm_engine.has_unfinished_requests() and len(results) < len(ids):
                    missing = wanted - set(results)
                    raise RuntimeError(f"engine stopped with requests unfinished: {sorted(missing)[:5]}")
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.llm_engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]
