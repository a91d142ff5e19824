"""Helpers shared by the insight tests (tests/test_stats.py, tests/test_insight.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import traintrace as tt


def configure(memory: tt.MemoryBackend, **settings: Any) -> tt.Recorder:
    base: dict[str, Any] = {"device_sample_interval": 0, "hang_timeout": 0, "job_id": "test"}
    base.update(settings)
    return tt.configure(backends={}, extra_backends=[memory], **base)


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    y = torch.randn(8, 1)
    return model, optimizer, x, y


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    with tt.zero_grad():
        optimizer.zero_grad()
    with tt.forward():
        loss = nn.functional.mse_loss(model(x), y)
    with tt.backward():
        loss.backward()
    with tt.optimizer_step():
        optimizer.step()
    return loss
