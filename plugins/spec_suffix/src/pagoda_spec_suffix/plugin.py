"""Entry point of the suffix decoding proposer plugin; the proposer module is imported only when an engine uses it."""

from pagoda.plugins import SpecProposerSpec, hookimpl

PAGODA_PLUGIN_API_VERSION = "1.6"


@hookimpl
def pagoda_register_spec_proposers() -> list[SpecProposerSpec]:
    return [SpecProposerSpec(name="suffix", cls="pagoda_spec_suffix.proposer:SuffixProposer")]
