"""Developer harnesses: same-run peer comparisons, the GPU checks, one-off measurements.

Not part of any distribution; run them from the repository root as
``python -m benchmarks.<name> ...`` (e.g. ``python -m benchmarks.peers --help``).
`pagoda bench`'s own modules stay in ``pagoda.benchmarks`` (pagoda-core).
"""
