"""Loading a Hugging Face causal LM for the transformers back-ends (device, dtype, attention implementation)."""

from __future__ import annotations

from typing import Any

from rl.model import model_construction


def default_attention(device: Any) -> str:
    """``sdpa`` on a GPU (fused attention kernels), ``eager`` on the CPU: there, the KV-cached decode of generation and
    the full forward of training give the same bf16 logprobs with it (token_mult_prob_error 1.0000 on SmolLM2
    rollouts, vs 1.014 with PyTorch's CPU SDPA), and its backward is faster at these lengths (PyTorch's CPU
    flash-attention backward took 1.5 s of a 15 s training step)."""
    import torch

    return "eager" if torch.device(device).type == "cpu" else "sdpa"


def load_model(path: str, attn_implementation: str | None = None, *, dtype: Any = None, device: Any = None) -> Any:
    """Causal LM at ``path`` in eval mode.

    Thread-safe: ``from_pretrained`` runs under :func:`rl.model.model_construction` (transformers swaps process-wide
    state while it builds a model, which a concurrent load in another thread would see: an async local run's
    trajectory collector loads its generation copy beside the main thread's loads).

    Args:
        path: a Hugging Face model folder.
        attn_implementation: ``eager``, ``sdpa``, ...; None: :func:`default_attention` for the device.
        dtype: parameter dtype; None: float32 (the master weights a trainer needs).
        device: where the model lives; None: the GPU when CUDA is present, else the CPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    with model_construction():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype or torch.float32, attn_implementation=attn_implementation or default_attention(device)
        )
    model.eval()
    return model.to(device)
