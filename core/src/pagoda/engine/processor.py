"""The front ends' request side: a user request becomes scheduler requests for the core.

Shared by ``LLMEngine`` and ``AsyncLLM``: validate (errors never reach the
core), tokenize, expand ``n`` / ``best_of`` into one sequence each with its own
parameters, and build the output processor's state for them. A beam search
becomes one group and its root beam.
"""

from __future__ import annotations

from typing import Any

from pagoda.beam_search.frontend import BeamSearchFrontend
from pagoda.beam_search.group import BeamGroup, EarlyStopping
from pagoda.config import EngineConfig
from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.engine.input_processor import InputProcessor
from pagoda.engine.logits_processors import resolve_logits_processors
from pagoda.engine.messages import EngineCoreRequest
from pagoda.engine.output_processor import ParentState, RequestState
from pagoda.multimodal.processing import MultiModalProcessor, load_mm_processor
from pagoda.inputs import parse_prompt
from pagoda.model_loader import load_tokenizer
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import BeamSearchParams, SamplingParams
from pagoda.lora.peft import read_peft_config
from pagoda.lora.request import LoRARequest
from pagoda.scheduler.request import prompt_block_hashes
from pagoda.structured_output.limits import check_constraint_size
from pagoda.structured_output.manager import load_backend_class


def eos_and_stop_ids(tokenizer: Any, hf_config: Any, generation: Any = None) -> tuple[int | None, list[int]]:
    """-> (the EOS the engine stops on, the other end tokens: config.json's and generation_config.json's)."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    cfg_eos = getattr(hf_config, "eos_token_id", None)
    extra = [cfg_eos] if isinstance(cfg_eos, int) else list(cfg_eos or [])
    # generation_config.json lists every end token (Llama 3: <|end_of_text|>, <|eom_id|>, <|eot_id|>), as vLLM reads it
    extra += [t for t in (generation.eos_token_ids if generation is not None else ()) if t not in extra]
    if eos is None and extra:
        eos = extra[0]
    return eos, [t for t in extra if t != eos]


class Processor:
    """Turns prompts and parameters into the core's requests; owns the tokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        model = config.resolved
        self.config = config
        self.model_config = config.model
        self.tokenizer = None if config.model.skip_tokenizer_init else load_tokenizer(
            model.source, config.model.tokenizer, config.model.tokenizer_revision, config.load_config.download_dir,
            trust_remote_code=config.model.trust_remote_code,
        )
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size or (len(self.tokenizer) if self.tokenizer is not None else 0)
        self.eos_token_id, self.extra_stop_ids = eos_and_stop_ids(self.tokenizer, model.hf_config, model.generation)
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size,
                                              load_mm_processor(config))
        self.block_size = config.block_size
        self.beam_searches = BeamSearchFrontend(self.tokenizer, self.max_model_len)
        self.runner_type: str = model.runner_type
        # pagoda.pooling.PoolingModelInfo of a pooling model (what PoolingParams.verify reads)
        self.pooling = model.pooling
        # what the loaded model serves ("generate", or pooling tasks); set once the core has loaded it
        self.supported_tasks: tuple[str, ...] = ("generate",) if model.runner_type == "generate" else ()
        # adapters whose config check_lora read already: lora_int_id -> (name, path)
        self._checked_loras: dict[int, tuple[str, str]] = {}

    @property
    def mm_processor(self) -> MultiModalProcessor | None:
        """The model's multimodal processor; None for a text-only model."""
        return self.input_processor.mm_processor

    def _child_params(self, params: SamplingParams, prompt_len: int, rank_by_logprob: bool) -> SamplingParams:
        p = params.clone()
        # names become processors here, one instance per sequence (processors may keep state)
        p.logits_processors = resolve_logits_processors(p.logits_processors)
        if p.max_tokens is None:
            p.max_tokens = self.max_model_len - prompt_len
        # EOS and the config's extra EOS ids: stop tokens that min_tokens masks
        p.update_from_generation_config({"eos_token_id": self.extra_stop_ids}, model_eos_token_id=self.eos_token_id)
        if p.bad_words and self.tokenizer is not None:
            p.update_from_tokenizer(self.tokenizer, self.vocab_size)
        if rank_by_logprob and p.logprobs is None:
            # best_of ranks by cumulative logprob, so the sampler must report it
            p.logprobs = 0
        return p

    def _check(self, params: SamplingParams, priority: int) -> None:
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'")
        max_logprobs = self.model_config.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} exceeds max_logprobs={max_logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} exceeds max_logprobs={max_logprobs}")
        if params.structured_outputs is not None:
            # a bad schema, regex or grammar is the caller's error (ValueError; the server's 400), not the engine's
            # sized first: what a schema's shape says it would cost is known before anything parses it
            check_constraint_size(params.structured_outputs, self.config.structured_outputs_config)
            load_backend_class(self.config.structured_outputs_config.backend).validate(params.structured_outputs)
        # out-of-vocabulary ids would fail inside the engine step, where one request's error is everyone's
        vocab = self.vocab_size
        if params.logit_bias:
            bad = sorted(t for t in params.logit_bias if not 0 <= t < vocab)
            if bad:
                raise ValueError(f"logit_bias has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None:
            bad = sorted({t for t in params.allowed_token_ids if not 0 <= t < vocab})
            if bad:
                raise ValueError(f"allowed_token_ids has token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")

    def check_lora(self, lora_request: Any) -> LoRARequest | None:
        """A request's adapter, checked as far as the front end can (the config: rank, DoRA, files); the core
        checks its weights against the model."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a pagoda.lora.request.LoRARequest, got {type(lora_request).__name__}")
        lora = self.config.lora_config
        if lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r}: this engine was started without "
                             "enable_lora=True, so it serves no LoRA adapters")
        if self._checked_loras.get(lora_request.lora_int_id) != (lora_request.lora_name, lora_request.lora_path):
            # read once per adapter, not per request
            read_peft_config(lora_request.lora_name, lora_request.lora_path, lora.max_lora_rank)
            self._checked_loras[lora_request.lora_int_id] = (lora_request.lora_name, lora_request.lora_path)
        return lora_request

    def process(
        self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams, arrival_time: float, priority: int,
        lora_request: LoRARequest | None = None,
    ) -> tuple[ParentState, list[EngineCoreRequest]]:
        """-> (the output processor's state for the request, one core request per sequence)."""
        lora_request = self.check_lora(lora_request)
        if isinstance(params, PoolingParams):
            if self._prediction(prompt) is not None:
                raise ValueError("prediction_token_ids (predicted outputs) applies to generation, not pooling")
            return self.process_pooling(request_id, prompt, params, arrival_time, priority, lora_request)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}")
        if "generate" not in self.supported_tasks:
            raise ValueError(f"this model runs with the pooling runner (tasks: {', '.join(self.supported_tasks)}); it "
                             "cannot generate text: use embed / classify / score / encode")
        self._check(params, priority)
        prediction = self._prediction(prompt)
        text, ids, salt, mm = self.input_processor.process(prompt, params)
        n_children = max(params.best_of or params.n, params.n)
        rank = n_children > params.n
        states: list[RequestState] = []
        requests: list[EngineCoreRequest] = []
        hashes = prompt_block_hashes(ids, self.block_size, salt, lora_request, mm)
        for i in range(n_children):
            child_id = request_id if n_children == 1 else f"{i}_{request_id}"
            p = self._child_params(params, len(ids), rank)
            if n_children > 1 and p.seed is not None:
                p.seed = p.seed + i
            if i > 0:
                # the prompt's logprobs are the same for every sequence: computed once
                p.prompt_logprobs = None
            detok = None
            if self.tokenizer is not None and p.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens, p.spaces_between_special_tokens)
            states.append(RequestState(child_id, request_id, i, text, ids, p, detok,
                                       wants_logprobs=params.logprobs is not None))
            requests.append(EngineCoreRequest(child_id, ids, p, None if p.ignore_eos else self.eos_token_id,
                                              arrival_time, priority=priority, cache_salt=salt,
                                              block_hashes=hashes, lora_request=lora_request,
                                              prediction_token_ids=prediction, mm=mm))
        parent = ParentState(request_id, params.n, n_children, states, params.output_kind, rank_by_logprob=rank,
                             lora_request=lora_request)
        return parent, requests

    def _prediction(self, prompt: Any) -> list[int] | None:
        """A prompt dict's ``prediction_token_ids`` (predicted outputs: the expected output, tokenized), checked."""
        ids = prompt.get("prediction_token_ids") if isinstance(prompt, dict) else None
        if ids is None:
            return None
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prediction_token_ids must be a list of integers")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prediction_token_ids has token id(s) {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return list(ids) or None

    def pooling_task(self, params: PoolingParams) -> str:
        """The request's task: its own, else the model's first; "encode" runs as token_embed / token_classify."""
        tasks = self.supported_tasks
        if self.runner_type != "pooling":
            raise ValueError("this model generates text (runner 'generate'); pooling requests (embed, classify, score, "
                             "encode) need a pooling model: pass runner='pooling' (and convert) to pool a decoder")
        task = params.task
        if task is None:
            task = next((t for t in ("embed", "classify", "score", "token_embed", "token_classify") if t in tasks), None)
        elif task == "encode":
            task = next((t for t in ("token_embed", "token_classify") if t in tasks), "encode")
        if task not in tasks:
            raise ValueError(f"pooling task {params.task or task!r} is not supported by this model; it supports "
                             f"{', '.join(tasks) or 'none'}")
        return task

    def process_pooling(
        self, request_id: str, prompt: Any, params: PoolingParams, arrival_time: float, priority: int,
        lora_request: LoRARequest | None = None,
    ) -> tuple[ParentState, list[EngineCoreRequest]]:
        """A pooling request: one core request, prefill only; its PoolingParams checked against the model."""
        if priority != 0 and self.config.scheduler_config.scheduling_policy != "priority":
            raise ValueError("priority is only honoured with scheduling_policy='priority'")
        task = self.pooling_task(params)
        params = params.clone()
        if params.task == "encode":
            params.task = None
        params.verify(task, self.pooling)
        text, ids, salt, token_type_ids = self._pooling_prompt(prompt, params.truncate_prompt_tokens)
        if params.step_tag_id is not None or (self.pooling is not None and self.pooling.pooler_config.pooling_type == "STEP"):
            params.requires_token_ids = True
        state = RequestState(request_id, request_id, 0, text, ids, params, None)
        request = EngineCoreRequest(request_id, ids, params, None, arrival_time, priority=priority, cache_salt=salt,
                                    token_type_ids=token_type_ids, lora_request=lora_request,
                                    block_hashes=prompt_block_hashes(ids, self.block_size, salt, lora_request))
        parent = ParentState(request_id, 1, 1, [state], params.output_kind, lora_request=lora_request)
        return parent, [request]

    def _pooling_prompt(self, prompt: Any, truncate: int | None) -> tuple[str | None, list[int], str | None, list[int] | None]:
        """-> (text, ids, cache salt, token type ids); a pooling prompt may fill the whole context."""
        token_type_ids = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if isinstance(prompt, dict) and "token_type_ids" in prompt:
            prompt = {k: v for k, v in prompt.items() if k != "token_type_ids"}
        text, ids, salt = parse_prompt(prompt)
        limit = self.max_model_len if truncate == -1 else truncate
        if ids is None:
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be given as token ids (prompt_token_ids)")
            assert text is not None
            if self.pooling is not None and self.pooling.do_lower_case:
                text = text.lower()  # sentence_bert_config.json's do_lower_case, as vLLM applies it
            if limit is None:
                enc = self.tokenizer(text)
            else:
                # the tokenizer truncates text on its side, special tokens kept (vLLM's rule)
                enc = self.tokenizer(text, truncation=True, max_length=limit)
            ids = list(enc.input_ids)
            if token_type_ids is None and getattr(self.pooling, "extra", {}).get("uses_token_type_ids"):
                token_type_ids = enc.get("token_type_ids")
        elif limit is not None and len(ids) > limit:
            # token ids keep their last ``limit`` tokens (vLLM's rule)
            if token_type_ids is not None:
                token_type_ids = list(token_type_ids)[-limit:]
            ids = ids[-limit:]
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} out of range [0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt ({len(ids)} tokens) is longer than this model's maximum length of "
                             f"{self.max_model_len} tokens; shorten it or set truncate_prompt_tokens")
        if token_type_ids is not None:
            token_type_ids = [int(t) for t in token_type_ids]
            if len(token_type_ids) != len(ids):
                raise ValueError(f"token_type_ids has {len(token_type_ids)} entries for {len(ids)} prompt tokens")
            if any(t != 0 for t in token_type_ids) and not getattr(self.pooling, "extra", {}).get("uses_token_type_ids"):
                raise ValueError("token_type_ids are given but this model has no token type embeddings")
        return text, ids, salt, token_type_ids

    def process_beam_search(
        self, request_id: str, prompt: Any, params: BeamSearchParams, arrival_time: float | None,
        early_stopping: EarlyStopping, lora_request: LoRARequest | None = None,
    ) -> tuple[BeamGroup, EngineCoreRequest]:
        """-> (the group, its root beam); ``beam_searches`` tracks it until the core reports it done."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if "generate" not in self.supported_tasks:
            raise ValueError("beam search needs a generative model; this model runs with the pooling runner")
        lora_request = self.check_lora(lora_request)
        if self._prediction(prompt) is not None:
            raise ValueError("prediction_token_ids (predicted outputs) does not run with beam search: its beams "
                             "are chosen over several candidates, not verified against one draft")
        text, ids, salt, mm = self.input_processor.process(prompt, None)
        if mm is not None:
            raise ValueError("beam search does not take multi_modal_data")
        return self.beam_searches.start(request_id, text, ids, salt, params, self.eos_token_id,
                                        early_stopping, arrival_time, lora_request)
