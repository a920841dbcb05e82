"""The one place that decides how forward passes run: device and compute dtype, and how tensors cross between the
host and the device (the back-end seam's contract: host batches in, one copy to the device, host results out).

``model.precision: auto`` picks bfloat16 where the hardware multiplies in bfloat16 natively (a CUDA device that
supports it, or a CPU with AVX-512 BF16 or AMX) and float32 elsewhere: on CPUs without native bf16, PyTorch's
bf16 matmuls are emulated and ~400x slower than float32 (0.33 vs 127 GFLOP/s measured on an AVX2 EPYC), while on
an AVX-512 BF16 EPYC they are ~5.5x faster (779 vs 142 GFLOP/s, 2048^3, 2 threads).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

PRECISIONS = ("auto", "bfloat16", "float32")


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def on_accelerator(device: torch.device | str) -> bool:
    """Whether ``device`` is not the host: tensors must be copied to it, and results copied back."""
    return torch.device(device).type != "cpu"


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``: as it is on the CPU; elsewhere through pinned (page-locked) host memory
    with a non-blocking copy, so that the host goes on queueing work while the copy runs (made contiguous first: CUDA
    copies a strided source through a pageable staging buffer). The pinned buffer comes from torch's caching host
    allocator, which keeps it until the copy has finished."""
    if not on_accelerator(device) or not tensor.is_cpu:
        return tensor if tensor.device == torch.device(device) else tensor.to(device)
    return tensor.contiguous().pin_memory().to(device, non_blocking=True)  # a strided pinned copy would be staged


def device_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed``: sampling draws on the device that holds the logits.
    The same seed gives the same stream on the same kind of device (CPU: Mersenne Twister; CUDA: Philox), not across
    kinds."""
    return torch.Generator(device=device).manual_seed(seed)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True when ``/proc/cpuinfo`` lists ``avx512_bf16`` or ``amx_bf16`` (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve(precision: str, device: torch.device | str = "cpu") -> str:
    """``bfloat16`` or ``float32``: ``precision`` itself, or for ``auto`` what ``device`` runs fastest.

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        msg = f"precision {precision!r} is not one of {PRECISIONS}"
        raise ValueError(msg)
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if device.type == "cpu" and cpu_has_native_bf16() else "float32"


def runs_bf16(model: torch.nn.Module, precision: str) -> bool:
    """Whether ``precision`` runs ``model`` in bfloat16 mixed precision: it resolves to bfloat16 on the model's
    device, and (for ``auto``) the master weights are float32.

    Raises:
        ValueError: ``precision`` is not one of :data:`PRECISIONS`.
    """
    master = next(model.parameters()).dtype
    return resolve(precision, device_of(model)) == "bfloat16" and not (precision == "auto" and master != torch.float32)


def autocast_off(device: torch.device | str) -> contextlib.AbstractContextManager:
    """A block where autocast is off on ``device`` (inside an outer bf16 block, ops run in their inputs' dtype). The
    dtype is given so that torch never reads it from thread state; a device type without autocast needs nothing."""
    kind = torch.device(device).type
    if not torch.amp.is_autocast_available(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=False)


@contextlib.contextmanager
def autocast(model: torch.nn.Module, precision: str) -> Iterator[None]:
    """Run ``model``'s forward passes inside this block in the resolved precision.

    bfloat16 is mixed precision: float32 master weights and the transformer trunk under ``torch.autocast`` in
    bfloat16. The LM head is not run through the model's forward: `rl.backends.hf.lm_head` computes it (bf16 matmul with
    exact float32 logits where they decide a logprob). ``auto`` leaves a model whose weights are not float32 (a
    float64 test model, a bf16 checkpoint) in its own dtype.
    """
    if not runs_bf16(model, precision):
        yield
        return
    with torch.autocast(device_type=device_of(model).type, dtype=torch.bfloat16):
        yield
