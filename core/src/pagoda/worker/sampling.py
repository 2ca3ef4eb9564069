"""Bridges the runner's rows and the batched sampler (temporary minimal version)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagoda.scheduler.output import ModelRunnerOutput
from pagoda.worker.input_batch import InputBatch, RowState


class RunnerSampler:
    def __init__(self, config: Any, text_config: Any, batch: InputBatch, device: torch.device, model: Any) -> None:
        self.batch = batch
        self.device = device
        self.seed = config.model.seed
        self.generators: dict[int, torch.Generator] = {}

    def add(self, state: RowState) -> None:
        seed = getattr(state.sampling_params, "seed", None)
        if seed is not None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed)
            self.generators[state.row] = g

    def remove(self, state: RowState) -> None:
        self.generators.pop(state.row, None)

    def sample(self, logits: torch.Tensor, rows: np.ndarray, req_ids: list[str], out: ModelRunnerOutput) -> torch.Tensor:
        params = [self.batch.rows[r].sampling_params for r in req_ids]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps < 1e-5
        if bool(greedy.all()):
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / torch.where(greedy, 1.0, temps).unsqueeze(1), dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(rows.tolist()):
            g = self.generators.get(int(r))
            if g is not None:
                noise[i].exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)
