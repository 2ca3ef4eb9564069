"""Persistent per-row sampling state of the running batch.

The model runner gives each running request a row (``add_request``), keeps rows
compact with ``move``/``swap``, and asks for ``metadata(rows)`` every step.
Scalar settings live in host arrays indexed in bulk; per-request lists
(prompt, output, bias, bad words ...) are touched only for the rows that use
the feature that needs them.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.sample.metadata import PenaltyTensors, ProcessorCall, SamplingMetadata
from pagoda.sampling_params import _SAMPLING_EPS, SamplingParams

# Columns of the float parameter table.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
# Columns of the int parameter table.
_TOP_K, _MIN_TOKENS, _NUM_LOGPROBS = range(3)
_NO_LOGPROBS = -1


@dataclass
class _RowLists:
    """Python-side state of one row (everything that is not a scalar)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    prompt_array: np.ndarray | None  # only kept when the row has a repetition penalty
    stop_token_ids: np.ndarray  # masked while min_tokens is not reached
    allowed_token_ids: np.ndarray | None
    bias_tokens: np.ndarray | None
    bias_values: np.ndarray | None
    bad_words: list[list[int]]
    processors: list[tuple[Callable[..., torch.Tensor], bool]]
    generator: torch.Generator | None


def _takes_prompt(processor: Callable[..., torch.Tensor]) -> bool:
    try:
        count = len(inspect.signature(processor).parameters)
    except (TypeError, ValueError):
        return False
    if count not in (2, 3):
        raise ValueError(
            "a logits processor must take (output_ids, logits) or (prompt_ids, output_ids, logits), "
            f"got {processor!r} with {count} parameters."
        )
    return count == 3


class SamplingBatch:
    """Sampling state for up to ``max_num_seqs`` rows."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device | str = "cpu") -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}.")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}.")
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._floats = np.zeros((max_num_seqs, 6), dtype=np.float32)
        self._ints = np.zeros((max_num_seqs, 3), dtype=np.int64)
        self._active = np.zeros(max_num_seqs, dtype=bool)
        self._has_penalties = np.zeros(max_num_seqs, dtype=bool)
        # Rows that need their Python-side lists this step (allowed ids, bias,
        # bad words, processors, min_tokens); the rest are never looped over.
        self._has_lists = np.zeros(max_num_seqs, dtype=bool)
        self._has_generator = np.zeros(max_num_seqs, dtype=bool)
        self._rows: list[_RowLists | None] = [None] * max_num_seqs

    # ---- row management -------------------------------------------------

    def add_request(
        self,
        row: int,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: list[int],
        generator: torch.Generator | None = None,
    ) -> None:
        """Put a request in ``row``. ``output_token_ids`` is kept by reference: the engine appends to it.

        EOS masking under ``min_tokens`` uses ``params.all_stop_token_ids``, so the
        engine must call ``params.update_from_generation_config(...)`` first.
        A seeded request without a ``generator`` gets one seeded here.
        """
        self._check_row(row)
        if self._active[row]:
            raise ValueError(f"row {row} is already in use; remove it first.")
        vocab = self.vocab_size
        if generator is None and params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)

        greedy = params.temperature < _SAMPLING_EPS
        top_k = params.top_k if 0 < params.top_k < vocab else 0
        self._floats[row] = (
            # Greedy rows store 0 here; metadata swaps in 1.0 so dividing is harmless.
            0.0 if greedy else params.temperature,
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self._ints[row] = (top_k, params.min_tokens, _NO_LOGPROBS if params.logprobs is None else params.logprobs)

        has_repetition = params.repetition_penalty != 1.0
        has_penalties = has_repetition or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

        allowed = None
        if params.allowed_token_ids is not None:
            allowed = self._token_array("allowed_token_ids", params.allowed_token_ids)
        bias_tokens = bias_values = None
        if params.logit_bias:
            bias_tokens = self._token_array("logit_bias", list(params.logit_bias))
            bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        bad_words = [list(ids) for ids in (params.bad_words_token_ids or [])]
        for ids in bad_words:
            self._token_array("bad_words", ids)
        processors = [(p, _takes_prompt(p)) for p in (params.logits_processors or [])]
        stop_ids = np.array(sorted(t for t in params.all_stop_token_ids if t < vocab), dtype=np.int64)

        self._rows[row] = _RowLists(
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            prompt_array=np.asarray(prompt_token_ids, dtype=np.int64) if has_repetition else None,
            stop_token_ids=stop_ids,
            allowed_token_ids=allowed,
            bias_tokens=bias_tokens,
            bias_values=bias_values,
            bad_words=bad_words,
            processors=processors,
            generator=generator,
        )
        self._active[row] = True
        self._has_penalties[row] = has_penalties
        self._has_lists[row] = (
            allowed is not None
            or bias_tokens is not None
            or bool(bad_words)
            or bool(processors)
            or (params.min_tokens > 0 and stop_ids.size > 0)
        )
        self._has_generator[row] = generator is not None

    def remove(self, row: int) -> None:
        self._check_row(row)
        self._rows[row] = None
        self._active[row] = False
        self._has_penalties[row] = False
        self._has_lists[row] = False
        self._has_generator[row] = False

    def move(self, src: int, dst: int) -> None:
        """Move the request in ``src`` to the free row ``dst`` (to keep rows compact)."""
        self._check_row(src)
        self._check_row(dst)
        if not self._active[src]:
            raise ValueError(f"row {src} is empty; nothing to move.")
        if self._active[dst]:
            raise ValueError(f"row {dst} is in use; cannot move row {src} onto it.")
        self.swap(src, dst)

    def swap(self, a: int, b: int) -> None:
        self._check_row(a)
        self._check_row(b)
        for table in (
            self._floats,
            self._ints,
            self._active,
            self._has_penalties,
            self._has_lists,
            self._has_generator,
        ):
            table[[a, b]] = table[[b, a]]
        self._rows[a], self._rows[b] = self._rows[b], self._rows[a]

    @property
    def num_active(self) -> int:
        return int(self._active.sum())

    def is_active(self, row: int) -> bool:
        return bool(self._active[row])

    def num_logprobs(self, row: int) -> int | None:
        value = int(self._ints[row, _NUM_LOGPROBS])
        return None if value == _NO_LOGPROBS else value

    # ---- per step -------------------------------------------------------

    def metadata(self, rows: Sequence[int] | np.ndarray | torch.Tensor,
                 extra_output: Sequence[Sequence[int]] | None = None) -> SamplingMetadata:
        """Gather the sampling tensors for logits row ``i`` = batch row ``rows[i]``.

        ``extra_output[i]`` (speculative decoding): tokens that follow the row's output at logits row ``i``
        (the drafts before the position it verifies); penalties, bad words, min_tokens and logits
        processors see the output extended by them. A batch row may then appear several times.
        """
        index = self._as_index(rows)
        batch = index.size
        floats = self._floats[index]
        ints = self._ints[index]
        device = self.device

        temperature = floats[:, _TEMPERATURE]
        greedy = temperature < _SAMPLING_EPS
        all_greedy = bool(greedy.all())
        all_random = not bool(greedy.any())
        top_k = ints[:, _TOP_K]
        uses_top_k = top_k > 0
        uses_top_p = floats[:, _TOP_P] < 1.0
        uses_min_p = floats[:, _MIN_P] > 0.0
        num_logprobs = ints[:, _NUM_LOGPROBS]
        wants_logprobs = num_logprobs != _NO_LOGPROBS

        # One host-to-device copy for all float settings of the step.
        float_tensor = torch.from_numpy(np.where(greedy[:, None] & (np.arange(6) == _TEMPERATURE), 1.0, floats))
        float_tensor = float_tensor.to(device=device, dtype=torch.float32, non_blocking=True)

        metadata = SamplingMetadata(
            temperature=None if all_greedy else float_tensor[:, _TEMPERATURE],
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=None if (all_greedy or all_random) else torch.from_numpy(greedy).to(device, non_blocking=True),
            top_p=float_tensor[:, _TOP_P] if (not all_greedy and uses_top_p.any()) else None,
            top_k=(
                torch.from_numpy(np.where(uses_top_k, top_k, self.vocab_size)).to(device, non_blocking=True)
                if (not all_greedy and uses_top_k.any())
                else None
            ),
            max_top_k=int(top_k.max()) if batch else 0,
            min_p=float_tensor[:, _MIN_P] if (not all_greedy and uses_min_p.any()) else None,
            max_num_logprobs=int(num_logprobs[wants_logprobs].max()) if wants_logprobs.any() else None,
            num_logprobs=[int(n) if n != _NO_LOGPROBS else None for n in num_logprobs]
            if wants_logprobs.any()
            else [None] * batch,
        )
        if not all_greedy:
            for i in np.flatnonzero(self._has_generator[index]).tolist():
                generator = self._rows[index[i]].generator  # type: ignore[union-attr]
                assert generator is not None
                metadata.generators[i] = generator
        penalized = np.flatnonzero(self._has_penalties[index])
        if penalized.size:
            metadata.penalties = self._penalty_tensors(index, penalized, float_tensor, extra_output)
        listed = np.flatnonzero(self._has_lists[index])
        if listed.size:
            self._fill_list_constraints(metadata, index, listed, extra_output)
        return metadata

    def _output(self, i: int, row: int, extra_output: Sequence[Sequence[int]] | None) -> list[int]:
        state = self._rows[row]
        assert state is not None
        if extra_output is not None and extra_output[i]:
            return state.output_token_ids + list(extra_output[i])
        return state.output_token_ids

    def _penalty_tensors(self, index: np.ndarray, penalized: np.ndarray, float_tensor: torch.Tensor,
                         extra_output: Sequence[Sequence[int]] | None) -> PenaltyTensors:
        vocab = self.vocab_size
        rows = [self._rows[r] for r in index[penalized].tolist()]
        outputs = [self._output(i, int(index[i]), extra_output) for i in penalized.tolist()]
        lengths = np.fromiter(map(len, outputs), dtype=np.int64, count=len(outputs))
        flat = np.fromiter(itertools.chain.from_iterable(outputs), dtype=np.int64, count=int(lengths.sum()))
        positions = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab, lengths) + flat
        counts = torch.zeros(len(rows) * vocab, dtype=torch.float32, device=self.device)
        counts.index_put_(
            (torch.from_numpy(positions).to(self.device, non_blocking=True),),
            torch.ones((), dtype=torch.float32, device=self.device).expand(positions.size),
            accumulate=True,
        )
        prompt_mask = None
        prompts = [r.prompt_array for r in rows]  # type: ignore[union-attr]
        if any(p is not None for p in prompts):
            arrays = [p if p is not None else np.empty(0, dtype=np.int64) for p in prompts]
            prompt_lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
            prompt_positions = np.repeat(np.arange(len(rows), dtype=np.int64) * vocab, prompt_lengths)
            prompt_positions += np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
            prompt_mask = torch.zeros(len(rows) * vocab, dtype=torch.bool, device=self.device)
            prompt_mask[torch.from_numpy(prompt_positions).to(self.device, non_blocking=True)] = True
            prompt_mask = prompt_mask.view(len(rows), vocab)
        batch_rows = torch.from_numpy(penalized).to(self.device, non_blocking=True)
        return PenaltyTensors(
            rows=batch_rows,
            presence=float_tensor[batch_rows, _PRESENCE],
            frequency=float_tensor[batch_rows, _FREQUENCY],
            repetition=float_tensor[batch_rows, _REPETITION],
            output_counts=counts.view(len(rows), vocab),
            prompt_mask=prompt_mask,
        )

    def _fill_list_constraints(self, metadata: SamplingMetadata, index: np.ndarray, listed: np.ndarray,
                               extra_output: Sequence[Sequence[int]] | None = None) -> None:
        allowed_rows: list[int] = []
        allowed_ids: list[np.ndarray] = []
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        bias_rows: list[np.ndarray] = []
        bias_tokens: list[np.ndarray] = []
        bias_values: list[np.ndarray] = []
        min_tokens = self._ints[index, _MIN_TOKENS]
        for i in listed.tolist():
            state = self._rows[index[i]]
            assert state is not None
            output = self._output(i, int(index[i]), extra_output)
            if state.allowed_token_ids is not None:
                allowed_rows.append(i)
                allowed_ids.append(state.allowed_token_ids)
            for word in state.bad_words:
                prefix_length = len(word) - 1
                if prefix_length == 0 or (
                    len(output) >= prefix_length and output[len(output) - prefix_length :] == word[:-1]
                ):
                    banned_rows.append(i)
                    banned_tokens.append(word[-1])
            if len(output) < min_tokens[i] and state.stop_token_ids.size:
                banned_rows.extend([i] * state.stop_token_ids.size)
                banned_tokens.extend(state.stop_token_ids.tolist())
            if state.bias_tokens is not None and state.bias_values is not None:
                bias_rows.append(np.full(state.bias_tokens.size, i, dtype=np.int64))
                bias_tokens.append(state.bias_tokens)
                bias_values.append(state.bias_values)
            if state.processors:
                metadata.processor_calls.append(ProcessorCall(i, state.processors, state.prompt_token_ids, output))

        device = self.device
        if allowed_rows:
            lengths = np.fromiter(map(len, allowed_ids), dtype=np.int64, count=len(allowed_ids))
            positions = np.repeat(np.arange(len(allowed_rows), dtype=np.int64) * self.vocab_size, lengths)
            positions += np.concatenate(allowed_ids)
            mask = torch.ones(len(allowed_rows) * self.vocab_size, dtype=torch.bool, device=device)
            mask[torch.from_numpy(positions).to(device, non_blocking=True)] = False
            metadata.allowed_rows = torch.tensor(allowed_rows, dtype=torch.int64).to(device, non_blocking=True)
            metadata.disallowed_mask = mask.view(len(allowed_rows), self.vocab_size)
        if banned_rows:
            metadata.banned_rows = torch.tensor(banned_rows, dtype=torch.int64).to(device, non_blocking=True)
            metadata.banned_tokens = torch.tensor(banned_tokens, dtype=torch.int64).to(device, non_blocking=True)
        if bias_rows:
            metadata.bias_rows = torch.from_numpy(np.concatenate(bias_rows)).to(device, non_blocking=True)
            metadata.bias_tokens = torch.from_numpy(np.concatenate(bias_tokens)).to(device, non_blocking=True)
            metadata.bias_values = torch.from_numpy(np.concatenate(bias_values)).to(device, non_blocking=True)

    # ---- helpers ----------------------------------------------------------

    def _as_index(self, rows: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        if isinstance(rows, torch.Tensor):
            index = rows.detach().to("cpu", torch.int64).numpy()
        else:
            index = np.asarray(rows, dtype=np.int64)
        if index.ndim != 1:
            raise ValueError(f"rows must be one-dimensional, got shape {index.shape}.")
        if index.size and (index.min() < 0 or index.max() >= self.max_num_seqs):
            raise ValueError(f"rows must be in [0, {self.max_num_seqs}), got {index.tolist()}.")
        if not self._active[index].all():
            empty = index[~self._active[index]].tolist()
            raise ValueError(f"rows {empty} hold no request.")
        return index

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_num_seqs:
            raise ValueError(f"row must be in [0, {self.max_num_seqs}), got {row}.")

    def _token_array(self, field_name: str, tokens: Sequence[int]) -> np.ndarray:
        array = np.asarray(tokens, dtype=np.int64)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            bad = array[(array < 0) | (array >= self.vocab_size)].tolist()
            raise ValueError(f"{field_name} holds token ids {bad} outside the vocabulary [0, {self.vocab_size}).")
        return array
