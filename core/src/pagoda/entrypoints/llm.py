"""``LLM``: offline inference with vLLM's API."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagoda.beam_search import BeamSearchOutput, EarlyStopping, request_output_to_beam_search_output
from pagoda.config import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.entrypoints.chat_utils import extract_images, is_conversation_list, render_chat_prompt
from pagoda.entrypoints.log_config import configure_default_logging
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.media import MediaPolicy
from pagoda.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from pagoda.plugins.io_processors import get_io_processor
from pagoda.pooling_params import POOLING_TASKS, PoolingParams
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
        configure_default_logging()
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._request_counter = 0
        # the IO processor plugin that encode({"data": ...}) goes through (io_processor_plugin, or the model config's)
        self.io_processor = get_io_processor(self.llm_engine.config, self.engine_args.io_processor_plugin)

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

    @staticmethod
    def _lora_list(lora_request: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
        """One adapter per prompt: the one given for all of them, or one per prompt (vLLM's rule)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} lora_request(s) for {n} prompts; pass one or one per prompt")
        return loras

    # -- sleep mode (vLLM's LLM.sleep / wake_up; needs enable_sleep_mode=True) -----------------------
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) or the weights too (level 2) until ``wake_up``; generating meanwhile
        is refused. Greedy outputs after ``wake_up`` equal those before (docs/server.md, "Sleep mode")."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm_engine.wake_up(tags)

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """What the model serves: ("generate",), or its pooling tasks (embed, classify, score, token_embed, ...)."""
        return self.llm_engine.supported_tasks

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        if "generate" not in self.supported_tasks:
            raise ValueError(
                f"LLM.generate needs a generative model; this one runs with the pooling runner (tasks: "
                f"{', '.join(self.supported_tasks)}). Use LLM.embed / classify / score / reward / encode.")
        items = self._normalize(prompts)
        params = self._params_list(sampling_params, len(items))
        loras = self._lora_list(lora_request, len(items))
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
                self.llm_engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                            lora_request=loras[i])
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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (the tokenizer's chat template, or ``chat_template``)."""
        conversations = list(messages) if is_conversation_list(messages) else [messages]
        tokenizer = self.get_tokenizer()
        mm = self.llm_engine.processor.mm_processor
        load_image = MediaPolicy.from_model_config(self.llm_engine.config.model).load_image if mm is not None else None
        if chat_template is None and mm is not None and not getattr(tokenizer, "chat_template", None):
            chat_template = mm.chat_template
        prompts: list[dict[str, Any]] = []
        for conversation in conversations:
            conversation, images = extract_images(conversation, load_image)
            text = render_chat_prompt(
                tokenizer, conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools, chat_template_kwargs=chat_template_kwargs,
            )
            if images:
                # the processor expands the template's image tokens; the template wrote the special tokens
                prompts.append({"prompt": text, "multi_modal_data": {"image": images},
                                "mm_processor_kwargs": {"add_special_tokens": False}})
                continue
            # the template writes its own special tokens (BOS included)
            ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        use_tqdm: bool = False,
        early_stopping: EarlyStopping = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search over every prompt at once, inside the scheduler (beams fork and share KV blocks).

        Ranking and stopping follow transformers' ``generate(num_beams=W, do_sample=False,
        early_stopping=False)`` (see ``pagoda.beam_search.group``).
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        items = self._normalize(prompts)
        loras = self._lora_list(lora_request, len(items))
        ids: list[str] = []
        try:
            for prompt, lora in zip(items, loras):
                rid = str(self._request_counter)
                self._request_counter += 1
                self.llm_engine.add_beam_search_request(rid, prompt, params, early_stopping=early_stopping,
                                                        lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise
        tokenizer = self.get_tokenizer()
        return [request_output_to_beam_search_output(o, tokenizer) for o in self._run_engine(ids, use_tqdm)]

    # -- pooling models (vLLM's offline pooling API) ------------------------------------------------
    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run prompts through the pooler of task ``pooling_task`` (embed, classify, score, token_embed,
        token_classify; "encode" = the model's per-token task); one ``PoolingRequestOutput`` each, in order.

        A dict with ``"data"`` is a request for the IO processor plugin: one ``PoolingRequestOutput``
        whose ``outputs`` is the plugin's output (vLLM's behaviour)."""
        self._require_pooling("LLM.encode")
        if isinstance(prompts, dict) and "data" in prompts:
            return [self._encode_with_io_processor(prompts, pooling_params, pooling_task, use_tqdm)]
        items = self._normalize(prompts)
        params = self._pooling_params_list(pooling_params, len(items))
        loras = self._lora_list(lora_request, len(items))
        task = pooling_task
        if task is None:
            tasks = {p.task for p in params}
            if len(tasks) != 1 or None in tasks:
                raise ValueError("LLM.encode needs pooling_task (one of "
                                 f"{', '.join(self.supported_tasks)}), or PoolingParams that set task")
            task = tasks.pop()
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling_task={task!r} is not one of {', '.join(POOLING_TASKS)}")
        limit = truncate_prompt_tokens
        if tokenization_kwargs:
            unknown = set(tokenization_kwargs) - {"truncation", "max_length"}
            if unknown:
                raise ValueError(f"tokenization_kwargs {sorted(unknown)} are not supported (only truncation, max_length)")
            if tokenization_kwargs.get("truncation") and limit is None:
                limit = tokenization_kwargs.get("max_length", -1)
        ready = []
        for p in params:
            p = p.clone()
            if p.task is not None and p.task != task:
                raise ValueError(f"PoolingParams.task={p.task!r} disagrees with pooling_task={task!r}")
            p.task = task  # type: ignore[assignment]
            if limit is not None:
                p.truncate_prompt_tokens = limit
                p.__post_init__()
            ready.append(p)
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(items, ready, loras):
                rid = str(self._request_counter)
                self._request_counter += 1
                self.llm_engine.add_request(rid, prompt, p, lora_request=lora)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.llm_engine.abort_request(rid)
            raise
        return self._run_engine(ids, use_tqdm)  # type: ignore[return-value]

    def _encode_with_io_processor(self, request: dict[str, Any], pooling_params: Any, pooling_task: str | None,
                                  use_tqdm: bool) -> PoolingRequestOutput:
        """parse_request -> pre_process -> encode each prompt -> post_process, as vLLM's LLM.encode."""
        processor = self.io_processor
        if processor is None:
            raise ValueError("LLM.encode got a request with 'data', which is for an IO processor plugin, and this LLM "
                             "runs none: pass io_processor_plugin=NAME (see `pagoda plugins list`)")
        request_id = f"io-{self._request_counter}"
        prompts = processor.pre_process(processor.parse_request(request), request_id=request_id)
        params = processor.validate_or_generate_params(pooling_params)
        first = params if isinstance(params, PoolingParams) else next(iter(params), PoolingParams())
        # the plugin's task, else the caller's, else the model's own (the engine's rule)
        task = first.task or pooling_task or self.llm_engine.processor.pooling_task(first)
        outputs = self.encode(prompts, params, use_tqdm=use_tqdm, pooling_task=task)
        return PoolingRequestOutput("", processor.post_process(outputs, request_id=request_id), [], 0, True)

    def embed(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (normalized unless ``PoolingParams(normalize=False)``)."""
        self._require_task("LLM.embed", "embed")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                              lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def classify(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (softmax, or sigmoid for one label; raw logits with use_activation=False)."""
        self._require_task("LLM.classify", "classify")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                              lora_request=lora_request, pooling_task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in outputs]

    def reward(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Per-token outputs of a reward model (``convert="reward"``, or a token classifier): [tokens, ...] each."""
        self._require_task("LLM.reward", "token_classify")
        return self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                           lora_request=lora_request, pooling_task="token_classify")

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of (data_1, data_2) pairs, paired 1:1, 1:N or N:N as vLLM pairs them.

        A cross-encoder (a one-label classifier: the ``score`` task) reads each pair as one input,
        the tokenizer's pair encoding with its token type ids; an embedding model scores by the cosine
        similarity of the two embeddings.
        """
        tasks = self.supported_tasks
        if "score" not in tasks and "embed" not in tasks:
            raise ValueError("LLM.score needs a cross-encoder (a one-label classifier: the 'score' task) or an embedding "
                             f"model; this model supports {', '.join(tasks)}")
        first = [data_1] if isinstance(data_1, str) else list(data_1)
        second = [data_2] if isinstance(data_2, str) else list(data_2)
        if not first or not second:
            raise ValueError("LLM.score needs at least one text on each side")
        if len(first) == 1:
            first = first * len(second)
        elif len(first) != len(second):
            raise ValueError(f"input lengths must be 1:1, 1:N or N:N; got {len(first)} and {len(second)}")
        if "score" in tasks:
            tokenizer = self.get_tokenizer()
            prompts = []
            for a, b in zip(first, second):
                if truncate_prompt_tokens is None:
                    enc = tokenizer(a, text_pair=b)
                else:
                    limit = self.llm_engine.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
                    enc = tokenizer(a, text_pair=b, truncation=True, max_length=limit)
                prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
                if enc.get("token_type_ids") is not None:
                    prompt["token_type_ids"] = list(enc["token_type_ids"])
                prompts.append(prompt)
            outputs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="score",
                                  lora_request=lora_request)
            return [ScoringRequestOutput.from_base(o) for o in outputs]
        if pooling_params is not None and pooling_params.use_activation is not None:
            raise ValueError("use_activation applies to cross-encoder scores; this model scores by cosine similarity")
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError("LLM.score with an embedding model takes one lora_request for all its texts, not a list")
        texts = list(dict.fromkeys(first + second))
        embedded = self.embed(texts, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                              pooling_params=pooling_params, lora_request=lora_request)
        by_text = dict(zip(texts, embedded))
        import torch

        scores = []
        for a, b in zip(first, second):
            ea, eb = by_text[a], by_text[b]
            cosine = torch.nn.functional.cosine_similarity(torch.tensor(ea.outputs.embedding),
                                                           torch.tensor(eb.outputs.embedding), dim=0)
            scores.append(ScoringRequestOutput.from_base(PoolingRequestOutput(
                f"{ea.request_id}_{eb.request_id}", PoolingOutput(cosine.reshape(1)),
                list(ea.prompt_token_ids) + list(eb.prompt_token_ids), 0, True)))
        return scores

    def _require_pooling(self, method: str) -> None:
        if "generate" in self.supported_tasks:
            raise ValueError(f"{method} needs a pooling model; this model generates text (runner 'generate'). Load it "
                             "with runner='pooling' (and convert='embed' / 'classify' / 'reward') to pool a decoder.")

    def _require_task(self, method: str, task: str) -> None:
        self._require_pooling(method)
        if task not in self.supported_tasks:
            raise ValueError(f"{method} needs the {task!r} task; this model supports {', '.join(self.supported_tasks)}")

    def _pooling_params_list(self, params: Any, n: int) -> list[PoolingParams]:
        if params is None:
            return [PoolingParams() for _ in range(n)]
        if isinstance(params, PoolingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} pooling params for {n} prompts; pass one or one per prompt")
        if not all(isinstance(p, PoolingParams) for p in params):
            raise TypeError("pooling_params must be PoolingParams")
        return params

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[Any]:
        results: dict[str, Any] = {}
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
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            if isinstance(out, RequestOutput):
                                out_tokens += sum(len(o.token_ids) for o in out.outputs)
                                bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s", refresh=False)
                            else:
                                # a pooling request reads its prompt and writes no tokens
                                out_tokens += len(out.prompt_token_ids)
                                bar.set_postfix_str(f"input {out_tokens / elapsed:.1f} tok/s", refresh=False)
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
