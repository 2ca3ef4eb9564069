"""Speculative decoding: the config, the proposer interface (plugins implement it) and the rejection sampler."""

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.proposer import DraftRequest, Proposer

__all__ = ["DraftRequest", "Proposer", "SpeculativeConfig", "load_proposer_class"]


def load_proposer_class(method: str) -> type[Proposer]:
    """The proposer class the plugins register for ``method`` (hook ``pagoda_register_spec_proposers``)."""
    from pagoda.plugins import get_plugin_manager

    found = get_plugin_manager().spec_proposers()
    if method not in found:
        hint = {"ngram": "pagoda-spec-ngram", "suffix": "pagoda-spec-suffix"}.get(method)
        install = f"; install {hint}" if hint else ""
        raise ValueError(f"no speculative decoding proposer {method!r} is installed (installed: {sorted(found)}){install}")
    cls = found[method].load()
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"speculative proposer {method!r} ({found[method].cls}) is not a pagoda.spec_decode.Proposer")
    return cls
