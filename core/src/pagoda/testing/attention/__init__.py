"""Conformance cases for paged attention backends, public so every backend runs the same ones.

pagoda's own backends (``torch_paged``, ``cpu_paged``, ``triton_paged``) and a
third party's run ``CONFORMANCE_CASES`` through ``run_case`` (see
docs/plugins.md, "Testing your attention backend"). The pieces are public too,
for a backend's own extra cases: ``make_batch`` builds a paged step from
explicit K/V, ``reference_attention`` is the float64 dense answer, ``TOLERANCE``
the accepted error per dtype, and ``run_and_check`` one checked step.
"""

from pagoda.testing.attention.batch import (
    CHUNKED,
    DECODE,
    MIXED,
    PREFILL,
    Batch,
    Sequence,
    Shape,
    make_batch,
    params_for,
    spec_for,
)
from pagoda.testing.attention.conformance import (
    CONFORMANCE_CASES,
    ConformanceCase,
    UnsupportedCaseError,
    run_case,
)
from pagoda.testing.attention.dense import DenseTestBackend
from pagoda.testing.attention.reference import (
    TOLERANCE,
    assert_within_tolerance,
    check_cache,
    check_output,
    metadata_to,
    reference_attention,
    run_and_check,
)

__all__ = [
    "CHUNKED",
    "CONFORMANCE_CASES",
    "DECODE",
    "MIXED",
    "PREFILL",
    "TOLERANCE",
    "Batch",
    "ConformanceCase",
    "DenseTestBackend",
    "Sequence",
    "Shape",
    "UnsupportedCaseError",
    "assert_within_tolerance",
    "check_cache",
    "check_output",
    "make_batch",
    "metadata_to",
    "params_for",
    "reference_attention",
    "run_and_check",
    "run_case",
    "spec_for",
]
