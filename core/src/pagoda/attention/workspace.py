"""Per-step scratch buffers that every layer of the step reuses."""

from __future__ import annotations

import torch


class Workspace:
    """Named buffers, made on first use and reused while the shape, dtype and device stay the same.

    Kept by a backend's prepared metadata for one step: fresh large buffers per layer would cost
    page faults on CPU, and every layer of a step gathers the same amount of K/V.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(shape, dtype=dtype, device=device)
            self._buffers[name] = buf
        return buf
