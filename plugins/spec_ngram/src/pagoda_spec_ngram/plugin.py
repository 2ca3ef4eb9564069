"""Entry point of the n-gram proposer plugin; the proposer module is imported only when an engine uses it."""

from pagoda.plugins import SpecProposerSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.6"


@hookimpl
def pagoda_register_spec_proposers() -> list[SpecProposerSpec]:
    return [SpecProposerSpec(name="ngram", cls="pagoda_spec_ngram.proposer:NgramProposer")]
