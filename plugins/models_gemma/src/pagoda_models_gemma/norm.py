"""Gemma's RMSNorm: core's RMSNorm, whose checkpoint weight is ``scale - 1``."""

from __future__ import annotations

from pagoda.layers import RMSNorm


class GemmaRMSNorm(RMSNorm):
    """Scales by ``1 + checkpoint weight``; ``load_gemma_weights`` folds the 1 into ``weight`` once, at load time,
    so the platform's fused RMSNorm kernels serve it unchanged."""
