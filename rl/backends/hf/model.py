"""Loading a Hugging Face causal LM for the transformers back-ends (device, dtype, attention implementation)."""

from __future__ import annotations

from typing import Any


def load_model(path: str, attn_implementation: str = "eager") -> Any:
    """float32 causal LM in train mode off (eval), on CPU unless CUDA is present.

    Attention is the plain ("eager") implementation by default: with it, the KV-cached decode of generation and the
    full forward of training give the same bf16 logprobs (token_mult_prob_error 1.0000 on SmolLM2 rollouts, vs
    1.014 with PyTorch's CPU SDPA), and its backward is faster on CPU at these lengths (PyTorch's CPU
    flash-attention backward took 1.5 s of a 15 s training step). Pass ``"sdpa"`` for long sequences on GPU.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    model.eval()
    if torch.cuda.is_available():
        model.cuda()
    return model
