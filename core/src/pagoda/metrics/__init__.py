"""Engine statistics and their Prometheus export (vLLM's metric families under ``pagoda:``)."""

from pagoda.metrics.requests import RequestMetrics
from pagoda.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger

__all__ = ["FinishedRequestStats", "IterationStats", "RequestMetrics", "SchedulerStats", "StatLogger"]
