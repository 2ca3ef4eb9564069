"""Settings for the whole test suite (every testpath lies under this folder)."""

from __future__ import annotations

import os

# The suite starts hundreds of engines, several alive at once, most with the default CPU KV cache
# (0.5-4 GiB, following the model): faulted in at start-up, each would hold its whole cache resident (and spend seconds on it),
# more than a 24 GiB CI machine has. Lazily mapped, they hold only what the tests write. The prefault has its
# own tests (core/tests/test_host_memory.py, tests/test_kv_prefault.py), which turn it on.
os.environ.setdefault("PAGODA_CPU_KVCACHE_PREFAULT", "0")
