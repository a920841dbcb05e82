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
        [M, S] float32 (float64 for float64 logits): entry t (t >= 1) = log p(input_ids[t] | input_ids[<t]) in nats; entry 0 is 0.
    """
    shifted = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))  # [M, S-1, V]
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
    first_token: int = 1,
) -> torch.Tensor:
    """Logprobs of right-padded sequences; gradients flow if enabled by the caller.

    The LM head (a [hidden, V] matmul, ~20% of SmolLM2's FLOPs per token) runs only on the positions that
    predict tokens ``first_token ..``: pass the first response position to skip the prompt.

    Args:
        model: causal LM whose forward accepts ``logits_to_keep`` (every current HF decoder).
        input_ids: [M, S] int64, right-padded.
        input_lengths: [M] int64 unpadded lengths.
        precision: ``auto``, ``bfloat16`` or ``float32`` (see :func:`rl.precision.autocast`).
        temperature: see :func:`logprobs_from_logits`.
        first_token: first position whose logprob is needed (>= 1).

    Returns:
        [M, S] float32; entries before ``first_token`` and at/after ``input_lengths`` are 0.
    """
    device = device_of(model)
    m, s = input_ids.shape
    first_token = max(1, min(first_token, s - 1)) if s > 1 else 1
    positions = torch.arange(s)[None, :]  # [1, S]
    attention_mask = (positions < input_lengths[:, None]).long()  # [M, S]
    keep = s - (first_token - 1)  # logits for positions first_token-1 .. S-1
    with autocast(model, precision):
        logits = model(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), logits_to_keep=keep
        ).logits  # [M, keep, V]
    lp = logprobs_from_logits(logits, input_ids[:, first_token - 1 :].to(device), temperature).cpu()  # [M, keep]
    out = torch.zeros(m, s, dtype=lp.dtype)  # [M, S]
    out[:, first_token:] = lp[:, 1:]
    return out * attention_mask


def first_response_token(token_mask: torch.Tensor) -> int:
    """Smallest index of a True entry of ``token_mask`` [M, S] over all rows (S if none)."""
    hits = token_mask.any(0).nonzero()
    return int(hits[0]) if len(hits) else token_mask.shape[1]


def batched_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    batch_size: int,
    precision: str,
    temperature: float = 1.0,
) -> torch.Tensor:
    """:func:`forward_logprobs` over micro-batches of ``batch_size`` rows, without gradients.

    Args:
        token_mask: [N, S] bool, True on response tokens; logprobs are computed from the first one on.

    Returns:
        [N, S] float32, 0 before each micro-batch's first response token and on padding.
    """
    out = torch.zeros(input_ids.shape, dtype=torch.float32)  # [N, S]
    order = torch.argsort(input_lengths, stable=True)  # similar lengths per micro-batch pad less
    with torch.no_grad():
        for a in range(0, input_ids.shape[0], batch_size):
            rows = order[a : a + batch_size]  # [m]
            width = int(input_lengths[rows].max())
            out[rows, :width] = forward_logprobs(
                model,
                input_ids[rows, :width],
                input_lengths[rows],
                precision=precision,
                temperature=temperature,
                first_token=first_response_token(token_mask[rows, :width]),
            ).to(out.dtype)
    return out
