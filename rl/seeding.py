"""Seeds derived from (run seed, step, purpose): every random draw of a step is fixed by the step number, so
a retried or resumed step draws exactly what the first attempt drew, whatever ran in the process before."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def step_seed(seed: int, step: int, purpose: str) -> int:
    """A 63-bit seed from SHA-256 of ``(seed, step, purpose)``: independent streams per purpose and step."""
    digest = hashlib.sha256(f"{seed}\0{step}\0{purpose}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's ``random`` and NumPy's global generator with ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
