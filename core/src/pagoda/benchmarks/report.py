"""Tables and JSON for benchmark results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in ps} | {"mean": float("nan")}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


def print_table(title: str, rows: dict[str, Any]) -> None:
    width = max(len(k) for k in rows) + 2
    print(f"{'=' * 12} {title} {'=' * 12}")
    for key, value in rows.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}{shown}")


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
