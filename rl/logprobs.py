"""Per-token logprobs of given sequences under a model (policy, reference policy, or the training forward).

Owns the forward pass -> logprob reduction; never materializes log_softmax over the vocabulary
(gather minus logsumexp over float32 logits, one micro-batch at a time).
"""

from __future__ import annotations

import torch

from rl.precision import autocast, device_of


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Full-length logprobs aligned with ``input_ids``.

    Args:
        logits: [M, S, V] any float dtype; position t predicts token t+1.
        input_ids: [M, S] int64.
        temperature: logits are divided by it, matching the sampling distribution of generation.

    Returns:
        [M, S] float32: entry t (t >= 1) = log p(input_ids[t] | input_ids[<t]) in nats; entry 0 is 0.
    """
    shifted = logits[:, :-1].float()  # [M, S-1, V]
    if temperature != 1.0:
        shifted = shifted / temperature
    targets = input_ids[:, 1:, None]  # [M, S-1, 1]
    lp = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, -1)  # [M, S-1]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)  # [M, S]


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    precision: str,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprobs of right-padded sequences; gradients flow if enabled by the caller.

    Args:
        model: causal LM.
        input_ids: [M, S] int64, right-padded.
        input_lengths: [M] int64 unpadded lengths.
        precision: ``bfloat16`` or ``float32``.
        temperature: see :func:`logprobs_from_logits`.

    Returns:
        [M, S] float32; entries at and beyond ``input_lengths`` are 0.
    """
    device = device_of(model)
    positions = torch.arange(input_ids.shape[1])[None, :]  # [1, S]
    attention_mask = (positions < input_lengths[:, None]).long()  # [M, S]
    with autocast(model, precision):
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits  # [M, S, V]
    lp = logprobs_from_logits(logits, input_ids.to(device), temperature).cpu()  # [M, S]
    return lp * attention_mask


def batched_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    batch_size: int,
    precision: str,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`forward_logprobs` over micro-batches of ``batch_size`` rows, without gradients. [N, S] float32."""
    out = torch.zeros(input_ids.shape, dtype=torch.float32)  # [N, S]
    with torch.no_grad():
        for a in range(0, input_ids.shape[0], batch_size):
            b = a + batch_size
            width = int(input_lengths[a:b].max())
            out[a:b, :width] = forward_logprobs(
                model, input_ids[a:b, :width], input_lengths[a:b], precision=precision, temperature=temperature
            )
    return out
