"""The model capabilities (pagoda.models.interface): declared by inheritance, read through their helpers."""

from __future__ import annotations

import pytest
from torch import nn

from pagoda.models.adapters import as_pooling_model
from pagoda.models.interface import (
    NoCudaGraphs,
    PoolingModel,
    SupportsPP,
    SupportsQuant,
    SupportsTokenTypeIds,
    check_declarations,
    is_pooling_model,
    quant_unsupported_reason,
    supports_cuda_graphs,
    supports_pp,
    supports_quant,
    supports_token_type_ids,
)


class Plain(nn.Module):
    pass


class Pipelined(nn.Module, SupportsPP, SupportsQuant):
    pass


class Moe(Pipelined, NoCudaGraphs):
    pass


class Declines(Pipelined):
    quant_unsupported_reason = "its projections are no Linear layers"


class Encoder(nn.Module, PoolingModel, SupportsTokenTypeIds):
    pass


def test_a_capability_is_its_class_in_the_mro() -> None:
    assert supports_pp(Pipelined()) and supports_quant(Pipelined()) and not supports_pp(Plain())
    assert supports_token_type_ids(Encoder()) and not supports_token_type_ids(Pipelined())
    # a flag alone, without the class, declares nothing
    flagged = type("Flagged", (nn.Module,), {"supports_pp": True})
    assert not supports_pp(flagged())


def test_an_architecture_declines_quant_with_its_reason() -> None:
    assert not supports_quant(Declines())
    assert quant_unsupported_reason(Declines()) == "its projections are no Linear layers"
    assert quant_unsupported_reason(Plain()) == "its model family does not declare SupportsQuant"


def test_graphs_are_off_for_no_cuda_graphs_and_pooling_models() -> None:
    assert supports_cuda_graphs(Plain()) and supports_cuda_graphs(Pipelined())
    assert not supports_cuda_graphs(Moe()) and not supports_cuda_graphs(Encoder())
    converted = as_pooling_model(Pipelined, "embed")
    assert is_pooling_model(converted) and not supports_cuda_graphs(converted)
    assert is_pooling_model(Encoder) and is_pooling_model(Encoder()) and not is_pooling_model(Pipelined)
    with pytest.raises(ValueError, match="already a pooling model"):
        as_pooling_model(Encoder, "embed")


@pytest.mark.parametrize(("flag", "value", "capability"), [
    ("supports_pp", True, "SupportsPP"),
    ("supports_output_rows", True, "SupportsOutputRows"),
    ("uses_token_type_ids", True, "SupportsTokenTypeIds"),
    ("is_pooling_model", True, "PoolingModel"),
    ("supports_cuda_graphs", False, "NoCudaGraphs"),
])
def test_an_old_flag_without_its_class_is_refused(flag: str, value: bool, capability: str) -> None:
    old = type("OldStyle", (nn.Module,), {flag: value})
    with pytest.raises(TypeError, match=f"Sub sets {flag} = {value} .in OldStyle.*inherit pagoda.models.interface.{capability}"):
        check_declarations(type("Sub", (old,), {}))


def test_declared_classes_and_harmless_flags_load() -> None:
    for cls in (Plain, Pipelined, Moe, Declines, Encoder):
        check_declarations(cls)
    # the old flags' other value declared nothing, and a flag beside its class is redundant, not wrong
    check_declarations(type("Graphs", (nn.Module,), {"supports_cuda_graphs": True, "supports_pp": False}))
    check_declarations(type("Both", (Pipelined,), {"supports_pp": True}))
