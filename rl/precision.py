"""The one place that decides how forward passes run: device and autocast dtype."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def autocast(model: torch.nn.Module, precision: str) -> Iterator[None]:
    """bfloat16 autocast on the model's device when ``precision == "bfloat16"`` (float32 master weights)."""
    device = device_of(model)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        yield
