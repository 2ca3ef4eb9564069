"""A model family's layer-level checks against transformers, over a real paged KV cache, for any family plugin.

pagoda's family plugins (``models_llama``, ``models_gpt``, ``models_neox``,
``models_gemma``) and a third party's run the same scenarios on every
configuration they serve: a ``ModelPair`` holds transformers' model (the
reference) and the engine's model loaded from its ``state_dict()``, and each
``check_*`` function runs one scenario through ``PagedKVHarness`` and asserts
on the logits. Where ``pagoda.testing.model_parity.check_parity`` serves a
checkpoint through the whole engine, these compare the model alone, step by
step, so a failure points at the model rather than at the engine around it.

Typical use in a plugin's tests::

    from pagoda.testing import family_checks as fc

    CONFIGS = {"mine": (MyConfig(vocab_size=256, ...), MyForCausalLM)}

    @pytest.fixture(scope="module", params=list(CONFIGS))
    def pair(request):
        return fc.ModelPair(*CONFIGS[request.param])

    class TestPagedKV(fc.PagedKVScenarios):  # the four scenarios below, on every configuration
        pass

The scenarios every configuration runs: ``check_loads_every_checkpoint_tensor``,
``check_single_prefill``, ``check_two_sequences_in_one_flat_batch`` and
``check_decode_beside_chunked_prefill``, and ``check_output_rows`` where the model declares
``SupportsOutputRows``. For a family's own cases (a checkpoint
saved under other names, a model built another way): ``check_saved_checkpoint_loads``,
``check_prefill_matches_reference`` and its negative control
``check_prefill_differs_from_reference``. ``tokens``, ``run_step`` and
``prefill_logits`` are the pieces they are made of.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagoda.attention import AttentionMetadata
from pagoda.models.interface import check_declarations, supports_output_rows
from pagoda.testing.model_parity import randomize_weights
from pagoda.testing.paged_kv import PagedKVHarness

# float32 engine logits against transformers' eager float32 forward
ATOL = 1e-4


def tokens(n: int, seed: int, vocab_size: int) -> torch.Tensor:
    """``n`` seeded random token ids below ``vocab_size``."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def run_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The logits of every row of one step (``forward`` then ``compute_logits``), without autograd."""
    engine: Any = model  # nn.Module types attributes as Tensor | Module; compute_logits is the model contract's
    with torch.inference_mode():
        logits: torch.Tensor = engine.compute_logits(engine(ids, positions, metadata))
    return logits


def prefill_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of every position of ``ids`` prefilled as one sequence over a fresh paged cache."""
    harness = PagedKVHarness(model)
    positions, metadata = harness.step([(harness.new_sequence(len(ids)), len(ids))])
    return run_step(model, ids, positions, metadata)


def reference_model(
    hf_config: Any,
    *,
    seed: int = 1234,
    randomize: Callable[[nn.Module], None] | None = None,
    attn_implementation: str = "eager",
) -> Any:
    """transformers' causal LM for ``hf_config`` in float32 eval mode, with seeded weights.

    Weights come from ``randomize_weights(model, seed=seed)`` (unit-scale rows, norm weights around 1,
    so a misplaced norm or bias shows in the logits) unless ``randomize`` is given, for a family whose
    norms store something else (Gemma's ``1 + weight``). A tied LM head is re-tied after.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_implementation).float().eval()
    if randomize is None:
        randomize_weights(model, seed=seed)
    else:
        randomize(model)
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()
    return model


class ModelPair:
    """A transformers reference model and the engine model (``cls``) loaded from its ``state_dict()``.

    ``hf_model`` defaults to ``reference_model(hf_config)``. ``hf_config`` is what the engine model is
    built from; build the reference from a copy where building it must not touch the engine's config.
    """

    def __init__(
        self, hf_config: Any, cls: type[nn.Module], hf_model: Any = None, dtype: torch.dtype = torch.float32
    ) -> None:
        self.hf_config = hf_config
        self.cls = cls
        self.hf = reference_model(hf_config) if hf_model is None else hf_model
        model: Any = cls(hf_config, dtype)
        self.model = model
        state = self.hf.state_dict()
        self.loaded: set[str] = model.load_weights(state.items())
        self.state_names = set(state)
        self.vocab_size: int = self.hf.config.vocab_size

    def tokens(self, n: int, seed: int) -> torch.Tensor:
        return tokens(n, seed, self.vocab_size)

    def reference_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """transformers' float32 logits for one sequence, every position."""
        with torch.no_grad():
            logits: torch.Tensor = self.hf(input_ids=token_ids[None]).logits[0].float()
        return logits


def check_loads_every_checkpoint_tensor(pair: ModelPair) -> None:
    """``load_weights`` reports every tensor of transformers' state dict consumed (a tied LM head excepted).

    The model ties its LM head exactly when the config does (one parameter under two module names), so an
    untied checkpoint's head is never skipped.
    """
    expected = set(pair.state_names)
    shared = len(list(pair.model.named_parameters(remove_duplicate=False))) - len(list(pair.model.parameters()))
    tied = shared > 0
    assert tied == bool(getattr(pair.hf_config, "tie_word_embeddings", False))
    if tied:
        expected.discard("lm_head.weight")
    assert pair.loaded == expected


def check_single_prefill(pair: ModelPair, atol: float = ATOL) -> None:
    """One 20-token prompt prefilled at once: float32 logits of every position equal transformers'."""
    ids = pair.tokens(20, seed=1)
    logits = prefill_logits(pair.model, ids)
    assert logits.dtype == torch.float32 and logits.shape == (20, pair.vocab_size)
    torch.testing.assert_close(logits, pair.reference_logits(ids), atol=atol, rtol=0)


def check_prefill_matches_reference(
    pair: ModelPair, ids: torch.Tensor, model: nn.Module | None = None, atol: float = ATOL
) -> None:
    """``model`` (default: the pair's; e.g. one loaded another way) prefilling ``ids`` gives transformers' logits."""
    got = prefill_logits(pair.model if model is None else model, ids)
    torch.testing.assert_close(got, pair.reference_logits(ids), atol=atol, rtol=0)


def check_prefill_differs_from_reference(
    pair: ModelPair, ids: torch.Tensor, model: nn.Module | None = None, min_diff: float = 1e-2
) -> None:
    """A negative control: ``model`` (one deliberately built or loaded wrong) gives logits off transformers'.

    A family's test that a layout conversion or an option matters pairs this with the matching check, so
    the conversion is shown to be needed and not merely harmless.
    """
    got = prefill_logits(pair.model if model is None else model, ids)
    diff = (got.float() - pair.reference_logits(ids)).abs().max().item()
    assert diff > min_diff, f"logits within {diff:.2e} of transformers': the change made no difference"


def check_saved_checkpoint_loads(pair: ModelPair, path: Path) -> None:
    """What transformers' ``save_pretrained`` writes (the hub's names: tied copies dropped, a family's own
    spellings such as GPT-NeoX's ``embed_out``) loads into a fresh model, which then matches transformers."""
    from safetensors.torch import load_file

    pair.hf.save_pretrained(path, safe_serialization=True)
    saved = load_file(str(path / "model.safetensors"))
    model: Any = pair.cls(pair.hf_config, torch.float32)
    model.load_weights(saved.items())
    check_prefill_matches_reference(pair, pair.tokens(9, seed=6), model)


def check_two_sequences_in_one_flat_batch(pair: ModelPair, atol: float = ATOL) -> None:
    """Two prompts (13 and 20 tokens) concatenated in one step: each sequence's logits are its own."""
    first, second = pair.tokens(13, seed=2), pair.tokens(20, seed=3)
    harness = PagedKVHarness(pair.model)
    positions, metadata = harness.step([(harness.new_sequence(13), 13), (harness.new_sequence(20), 20)])
    logits = run_step(pair.model, torch.cat([first, second]), positions, metadata)
    torch.testing.assert_close(logits[:13], pair.reference_logits(first), atol=atol, rtol=0)
    torch.testing.assert_close(logits[13:], pair.reference_logits(second), atol=atol, rtol=0)


def check_decode_beside_chunked_prefill(pair: ModelPair, atol: float = ATOL) -> None:
    """Sequence A prefills 12 tokens, then decodes one token a step; B prefills 22 tokens in chunks in the same steps."""
    a_ids, b_ids = pair.tokens(18, seed=4), pair.tokens(22, seed=5)
    a_ref, b_ref = pair.reference_logits(a_ids), pair.reference_logits(b_ids)
    harness = PagedKVHarness(pair.model)
    a, b = harness.new_sequence(18), harness.new_sequence(22)

    positions, metadata = harness.step([(a, 12)])
    torch.testing.assert_close(run_step(pair.model, a_ids[:12], positions, metadata), a_ref[:12], atol=atol, rtol=0)

    b_chunks = [5, 5, 5, 4, 3]
    b_done = 0
    for step, chunk in enumerate(b_chunks + [0]):
        a_pos = 12 + step
        scheduled = [(a, 1)] + ([(b, chunk)] if chunk else [])
        positions, metadata = harness.step(scheduled)
        ids = torch.cat([a_ids[a_pos : a_pos + 1], b_ids[b_done : b_done + chunk]])
        logits = run_step(pair.model, ids, positions, metadata)
        torch.testing.assert_close(logits[:1], a_ref[a_pos : a_pos + 1], atol=atol, rtol=0)
        torch.testing.assert_close(logits[1:], b_ref[b_done : b_done + chunk], atol=atol, rtol=0)
        b_done += chunk
    assert b_done == 22 and a.num_cached == 18


def check_output_rows(pair: ModelPair, atol: float = ATOL) -> None:
    """A ``SupportsOutputRows`` model's ``forward(output_rows=...)``: the rows it returns are the full forward's,
    and the K/V it writes past them (every row's, in the last layer too) serve the next decode as the full
    forward's do."""
    assert supports_output_rows(pair.model), f"{pair.cls.__name__} does not declare SupportsOutputRows"
    model: Any = pair.model
    first, second = pair.tokens(13, seed=2), pair.tokens(20, seed=3)
    logits = {}
    for pruned in (False, True):
        harness = PagedKVHarness(model)
        a, b = harness.new_sequence(14), harness.new_sequence(20)
        positions, metadata = harness.step([(a, 13), (b, 20)])
        rows = torch.tensor([12, 32])  # each sequence's last token
        with torch.inference_mode():
            hidden = model(torch.cat([first, second]), positions, metadata, output_rows=rows if pruned else None)
            prefill = model.compute_logits(hidden if pruned else hidden.index_select(0, rows))
            positions, metadata = harness.step([(a, 1)])  # a decode reads the last layer's K/V of every row
            decode = model.compute_logits(model(torch.tensor([7]), positions, metadata))
        assert prefill.shape == (2, pair.vocab_size)
        logits[pruned] = (prefill, decode)
    torch.testing.assert_close(logits[True][0], logits[False][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits[True][1], logits[False][1], atol=1e-6, rtol=0)
    reference = pair.reference_logits(torch.cat([first, torch.tensor([7])]))
    torch.testing.assert_close(logits[True][1][0], reference[13], atol=atol, rtol=0)


class PagedKVScenarios:
    """The four scenarios as pytest tests, every one on every configuration of the module's ``pair`` fixture.

    Beside them: the model class's capability declarations load (``check_declarations``), and a model that
    declares ``SupportsOutputRows`` runs ``check_output_rows``.

    In a family's test module that defines a (parametrized) ``pair`` fixture returning a ``ModelPair``::

        class TestPagedKV(fc.PagedKVScenarios):
            pass

    Not named ``Test*``, so pytest collects only the subclass.
    """

    def test_load_weights_consumes_every_checkpoint_tensor(self, pair: ModelPair) -> None:
        check_loads_every_checkpoint_tensor(pair)

    def test_single_prefill_matches_transformers(self, pair: ModelPair) -> None:
        check_single_prefill(pair)

    def test_two_sequences_in_one_flat_batch(self, pair: ModelPair) -> None:
        check_two_sequences_in_one_flat_batch(pair)

    def test_decode_steps_beside_a_chunked_prefill(self, pair: ModelPair) -> None:
        check_decode_beside_chunked_prefill(pair)

    def test_capability_declarations(self, pair: ModelPair) -> None:
        check_declarations(pair.cls)
        if supports_output_rows(pair.model):
            check_output_rows(pair)
