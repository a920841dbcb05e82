"""Which of PyTorch's scaled-dot-product-attention kernels a decode loop runs on a CUDA GPU, and which one torch
picks for a decode step's shapes.

A one-token decode step attends under a padding mask (left-padded prompts), so SDPA's flash kernel, which takes no
mask, is out; from torch 2.11 on Hopper GPUs a masked call prefers cuDNN's kernel, which builds an execution plan for
every new (batch, key length) shape, where the memory-efficient kernel has nothing to build. The loops therefore run
under a pin (:func:`pinned`), restored when they return: the pin is process-wide while it is held (torch's
``sdpa_kernel`` sets global flags), so a trainer thread that runs meanwhile in the same process runs under it too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PINS: dict[str, tuple[str, ...] | None] = {
    "torch": None,
    "cudnn": ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"),
    "no_cudnn": ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"),
}
"""SDPA pins by name, each the kernels enabled in priority order (``torch.nn.attention.SDPBackend`` names):
``torch`` leaves torch's own choice (no pin), ``cudnn`` puts cuDNN first, ``no_cudnn`` turns it off (the
memory-efficient kernel first)."""

DECODE_PIN = "no_cudnn"
"""The pin both decode loops run under on CUDA. On an H200 with prompts of one unchanging shape cuDNN's kernel decoded
~15% faster (the plans it builds were all cached), while the dynamic loop that changed its batch shape as rows
finished ran at 0.63x the fixed-shape loop under cuDNN (a plan for every new shape): a real run's prompt widths change
every step, so the decode runs on the kernels that build nothing. ``bench/step.py`` times each pin side by side; the
figures are in ``docs/gpu.md``."""


def check_pin(name: str) -> None:
    """Raises:
    ValueError: ``name`` is not one of :data:`PINS`."""
    if name not in PINS:
        msg = f"unknown SDPA pin {name!r}: use one of {sorted(PINS)}"
        raise ValueError(msg)


@contextlib.contextmanager
def pinned(device: torch.device, name: str = DECODE_PIN) -> Iterator[None]:
    """Run the block with SDPA limited to the kernels of pin ``name`` (:data:`PINS`), on a CUDA ``device`` only;
    elsewhere (CPU, the fake device of the tests) and for ``torch`` the block runs as it is. Torch's flags are
    restored on exit, also when the block raises.

    Raises:
        ValueError: an unknown pin.
    """
    check_pin(name)
    backends = PINS[name]
    if device.type != "cuda" or backends is None:
        yield
        return
    import inspect

    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}
    with sdpa_kernel([getattr(SDPBackend, b) for b in backends], **order):  # a torch without priorities: enables only
        yield


def decode_choice(device: torch.device, *, rows: int, heads: int, head_dim: int, keys: int, dtype: torch.dtype) -> str:
    """The kernel torch's SDPA dispatcher picks, under the flags in force, for a one-token decode step: a query
    [rows, heads, 1, head_dim], keys and values [rows, heads, keys, head_dim] of ``dtype`` and a bool mask
    [rows, 1, 1, keys] (what transformers' SDPA attention passes under a mask on CUDA: the key-value heads repeated
    to ``heads``).

    Returns:
        an ``SDPBackend`` name such as ``EFFICIENT_ATTENTION``, or ``n/a`` off CUDA.
    """
    if device.type != "cuda":
        return "n/a"
    from torch.nn.attention import SDPBackend

    q = torch.empty(rows, heads, 1, head_dim, dtype=dtype, device=device)
    k = torch.empty(rows, heads, keys, head_dim, dtype=dtype, device=device)
    mask = torch.ones(rows, 1, 1, keys, dtype=torch.bool, device=device)
    return SDPBackend(torch._fused_sdp_choice(q, k, k, mask, 0.0, False)).name


def cudnn_version() -> int | None:
    """``torch.backends.cudnn.version()`` where cuDNN is available, else None."""
    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
