"""SamplingParams: vLLM defaults, normalization and validation."""

from __future__ import annotations

import pickle

import msgspec
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from pagoda.logprobs import Logprob
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, SamplingType
from pagoda.structured_output.params import StructuredOutputsParams


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.best_of, params.temperature, params.top_p, params.top_k, params.min_p) == (
        1,
        1,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.seed) == (16, 0, None, None)
    assert params.stop == [] and params.stop_token_ids == [] and params.bad_words == []
    assert params.skip_special_tokens and params.spaces_between_special_tokens and params.detokenize
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert params.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.1}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -3}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"temperature": 0.0, "n": 2}, "n"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_normalization() -> None:
    params = SamplingParams(top_k=-1, seed=-1, stop="END", logit_bias={"5": 250.0, 7: -1.5}, output_kind=1)
    assert params.top_k == 0 and params.seed is None
    assert params.stop == ["END"]
    assert params.logit_bias == {5: 100.0, 7: -1.5}
    assert params.output_kind is RequestOutputKind.DELTA
    assert params.output_text_buffer_length == 2
    assert SamplingParams(stop="END", include_stop_str_in_output=True).output_text_buffer_length == 0


def test_greedy_resets_truncation() -> None:
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert params.sampling_type is SamplingType.GREEDY
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.5, seed=1).sampling_type is SamplingType.RANDOM_SEED


def test_from_optional_uses_defaults_for_none() -> None:
    params = SamplingParams.from_optional(temperature=None, top_p=0.5, max_tokens=None)
    assert params.temperature == 1.0 and params.top_p == 0.5 and params.max_tokens == 16


def test_generation_config_eos() -> None:
    params = SamplingParams(stop_token_ids=[9])
    params.update_from_generation_config({"eos_token_id": [2, 3]}, model_eos_token_id=2)
    assert params.all_stop_token_ids == {2, 3, 9}
    # The primary EOS is handled by the engine, the extra one becomes a stop token.
    assert sorted(params.stop_token_ids) == [3, 9]
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": 3}, model_eos_token_id=2)
    assert ignoring.stop_token_ids == [] and ignoring.all_stop_token_ids == {2, 3}


def _toy_tokenizer() -> Tokenizer:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "bad": 3, "very": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


class _EncodeAdapter:
    """Gives a `tokenizers.Tokenizer` the HF-style encode(text, add_special_tokens) -> list[int]."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def test_update_from_tokenizer_builds_bad_word_ids() -> None:
    params = SamplingParams(bad_words=["bad", "very bad"])
    params.update_from_tokenizer(_EncodeAdapter(_toy_tokenizer()), vocab_size=5)
    assert params.bad_words_token_ids == [[3], [4, 3]]
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["very"]).update_from_tokenizer(_EncodeAdapter(_toy_tokenizer()), vocab_size=4)


def test_clone_pickle_and_processors_shared() -> None:
    def processor(output_ids: list[int], logits):  # noqa: ANN001, ANN202
        return logits

    params = SamplingParams(stop=["a"], logit_bias={1: 1.0}, logits_processors=[processor])
    clone = params.clone()
    assert clone == params and clone.stop is not params.stop
    assert clone.logits_processors[0] is processor
    clone.stop.append("b")
    assert params.stop == ["a"]
    plain = SamplingParams(stop=["a"], seed=3, logprobs=2)
    assert pickle.loads(pickle.dumps(plain)) == plain


def test_beam_search_params() -> None:
    params = BeamSearchParams(beam_width=4, max_tokens=8)
    assert (params.ignore_eos, params.temperature, params.length_penalty, params.include_stop_str_in_output) == (
        False,
        0.0,
        1.0,
        False,
    )
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=8)
    assert pickle.loads(pickle.dumps(params)) == params


def test_logprob_record() -> None:
    record = Logprob(logprob=-0.5, rank=1, decoded_token="hi")
    assert (record.logprob, record.rank, record.decoded_token) == (-0.5, 1, "hi")


def test_structs_declared_as_vllm_declares_them() -> None:
    # Libraries written for vLLM read the struct's configuration and fields, not just attributes.
    for cls in (SamplingParams, BeamSearchParams):
        assert issubclass(cls, msgspec.Struct)
        info = cls.__struct_config__
        assert info.omit_defaults and info.dict
    assert {"n", "temperature", "structured_outputs", "_all_stop_token_ids", "output_text_buffer_length"} <= set(
        SamplingParams.__struct_fields__
    )


def test_field_by_field_copy_with_a_constraint_added() -> None:
    # What Outlines' vLLM offline model does to add a constraint to a user's params.
    original = SamplingParams(temperature=0.0, max_tokens=7, stop=["\n"], seed=5)
    original.update_from_generation_config({"eos_token_id": [2, 9]}, model_eos_token_id=2)
    values = {name: getattr(original, name) for name in original.__struct_fields__}
    rebuilt = SamplingParams(**{**values, "structured_outputs": StructuredOutputsParams(regex="[0-9]+")})
    assert (rebuilt.temperature, rebuilt.max_tokens, rebuilt.stop, rebuilt.seed) == (0.0, 7, ["\n"], 5)
    assert rebuilt.structured_outputs.regex == "[0-9]+"
    assert rebuilt.all_stop_token_ids == {2, 9} and rebuilt.stop_token_ids == [9]
    assert rebuilt.output_text_buffer_length == 0
    # A field the copy carries is still validated.
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(**{**values, "top_p": 0.0, "temperature": 1.0})


def test_msgspec_round_trip_runs_the_checks() -> None:
    params = SamplingParams(n=2, temperature=0.7, stop="END", logit_bias={"3": 150.0})
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params and decoded.logit_bias == {3: 100.0} and decoded.output_text_buffer_length == 2
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 0.0}', type=SamplingParams)
    beam = BeamSearchParams(beam_width=2, max_tokens=4)
    assert msgspec.json.decode(msgspec.json.encode(beam), type=BeamSearchParams) == beam
    assert msgspec.json.encode(beam) == b'{"beam_width":2,"max_tokens":4}'
