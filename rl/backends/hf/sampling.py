"""What both decode loops share (the dynamic-cache loop of `rl.backends.hf.decode`, the static-cache one of
`rl.backends.hf.static_decode`): their settings, the left-padded prompt batch and its prefill, the one-token step's
attention mask, the sampling of a token with its generation logprob, and the output buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.backends.hf.gqa_decode import NAME
from rl.backends.hf.lm_head import LMHead
from rl.backends.hf.logprobs import hidden_states

SDPA_LIKE = ("sdpa", NAME)
"""Attention implementations that take SDPA's masks: transformers' own, and its grouped-query decode
(`rl.backends.hf.gqa_decode`)."""

SYNC_EVERY = 4
"""Decode steps between two reads of the open-row count on a GPU (on the CPU: every step)."""


@dataclass(frozen=True)
class DecodeSettings:
    """What a decode loop takes besides the model and the prompts.

    Attributes:
        pad_id: the tokenizer's pad id (left padding of prompts; tokens after a row's eos).
        eos_id: the tokenizer's eos id: a row that samples it is finished.
        max_new_tokens: most tokens per completion.
        temperature, top_p, greedy: sampling (:func:`sample_next`).
        precision: ``auto``, ``bfloat16`` or ``float32`` (:func:`rl.precision.autocast`).
        generator: the ``torch.Generator`` on the model's device that all sampling draws from; None: torch's global
            generator.
    """

    pad_id: int
    eos_id: int
    max_new_tokens: int
    temperature: float
    top_p: float
    greedy: bool
    precision: str
    generator: torch.Generator | None


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows`` left-padded to the longest, on the host: ``(input_ids, attention_mask, position_ids)``, [n, P] int64
    each. Positions count real tokens only (``cumsum(attention_mask) - 1``, 0 on padding), so a left-padded prompt is
    encoded exactly as it is alone, and as the right-padded training forward encodes it."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)  # [n, P]
    attn = torch.zeros((len(rows), width), dtype=torch.int64)  # [n, P]
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
    pos = (attn.cumsum(-1) - 1).clamp_(min=0)  # [n, P]
    return ids, attn, pos


def prefill(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache: object, precision: str
) -> None:
    """Write all but the last token of every row (``ids``, ``pos``: [n, P], from :func:`left_pad`) into the KV
    ``cache``, the trunk only (no LM head); nothing when P is 1. The last token is the first decode step's input.
    ``attn`` is [n, P], or [n, C + P] where the cache already holds C positions (its padding mask first)."""
    if ids.shape[1] > 1:
        hidden_states(
            model,
            ids[:, :-1],
            attn[:, :-1],
            precision=precision,
            position_ids=pos[:, :-1],
            past_key_values=cache,
            use_cache=True,
        )


def one_token_masks_apply(model: torch.nn.Module, longest: int) -> bool:
    """Whether a decode step's 4D mask may be built by :func:`one_token_mask`: the model attends to every past token
    (no sliding window shorter than ``longest``) through eager or SDPA attention."""
    window = getattr(model.config, "sliding_window", None)
    return model.config._attn_implementation in ("eager", *SDPA_LIKE) and (window is None or window >= longest)


def one_token_mask(model: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The [m, 1, 1, L] attention mask of a one-token decode step from its [m, L] padding mask: the query attends to
    every real key, so causality adds nothing. Transformers takes a 4D mask as it is; from a 2D one its SDPA path
    decides whether to skip the mask by reading the mask's values on the host, which waits for the GPU every token.
    Bool for SDPA; additive (0 or the dtype's minimum, as transformers' eager mask) for eager attention."""
    keep = mask.bool()[:, None, None, :]  # [m, 1, 1, L]
    if model.config._attn_implementation in SDPA_LIKE:
        return keep
    dtype = model.get_input_embeddings().weight.dtype
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its generation logprob.

    Sampling is inverse-CDF (one uniform per row against the cumulative probabilities): the same distribution
    as ``torch.multinomial``, which on CPU spends ~78 ms per [64, 49152] call drawing an exponential per entry.

    Args:
        logits: [n, V] float32 next-token logits, on any device (the draws happen there).
        temperature: logits are divided by it (ignored when ``greedy``).
        top_p: nucleus sampling mass (1.0 = off); the logprob stays that of the temperature-scaled distribution
            before truncation (what the trainer computes, and what the vLLM back-end reports: its
            ``raw_logprobs`` at temperature 1). NeMo-RL instead reports the truncated distribution's and truncates
            in the trainer too.
        greedy: argmax; the logprob is that of the unscaled distribution.
        generator: source of the uniforms, on the logits' device; None: torch's global generator.

    Returns:
        ``(tokens [n] int64, logprobs [n] float32)``.
    """
    logp = (logits if greedy else logits / temperature).float().log_softmax(-1)  # [n, V]
    if greedy:
        tokens = logp.argmax(-1)  # [n]
    else:
        probs = logp.exp()  # [n, V]
        order = None
        if top_p < 1.0:
            probs, order = probs.sort(-1, descending=True)
            keep = probs.cumsum(-1) - probs < top_p  # [n, V], the first token always kept
            probs = probs * keep
        cdf = probs.cumsum(-1)  # [n, V]
        u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]  # [n, 1]
        tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1).squeeze(1)  # [n]
        if order is not None:
            tokens = order.gather(1, tokens[:, None]).squeeze(1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def next_tokens(
    head: LMHead, hidden: torch.Tensor, logits: torch.Tensor, settings: DecodeSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_next` on ``logits`` ([m, V], from ``hidden`` [m, H]) with ``settings``' sampling, with the
    sampled token's logprob made exact where the head runs in bf16 (its logit recomputed as the training forward
    computes it: `rl.backends.hf.lm_head`).

    Returns:
        ``(tokens [m] int64, generation logprobs [m] float32)``.
    """
    s = settings
    nxt, lp = sample_next(logits, temperature=s.temperature, top_p=s.top_p, greedy=s.greedy, generator=s.generator)
    if head.corrected:
        exact = head.target_logits(hidden, nxt) - logits.gather(1, nxt[:, None]).squeeze(1)
        lp = lp + exact.to(lp.dtype) / (1.0 if s.greedy else s.temperature)
    return nxt, lp


class Completions:
    """The output buffers of a decode batch on its device, filled token by token, copied to the host once.

    Attributes:
        tokens: [n, T] int64, pad after a row's eos (and for rows still to decode).
        logprobs: [n, T] float32, 0 where ``tokens`` is pad.
        lengths: [n] int64 response lengths, eos counted (T for a row that never produced it).
        finished: [n] bool, True where the row produced eos.
    """

    def __init__(self, n: int, t_max: int, *, pad_id: int, eos_id: int, device: torch.device) -> None:
        self.pad_id, self.eos_id = pad_id, eos_id
        self.tokens = torch.full((n, t_max), pad_id, dtype=torch.int64, device=device)  # [n, T]
        self.logprobs = torch.zeros(n, t_max, device=device)  # [n, T]
        self.lengths = torch.full((n,), t_max, dtype=torch.int64, device=device)  # [n]
        self.finished = torch.zeros(n, dtype=torch.bool, device=device)  # [n]

    def record(
        self, rows: torch.Tensor, t: int, nxt: torch.Tensor, lp: torch.Tensor, live: torch.Tensor
    ) -> torch.Tensor:
        """Store token ``t`` of ``rows`` (their draws ``nxt`` and logprobs ``lp``, [m] each) where ``live`` ([m] bool,
        still open); returns the new ``live``: without the rows that produced eos. No device sync."""
        self.tokens[rows, t] = torch.where(live, nxt, self.pad_id)
        self.logprobs[rows, t] = torch.where(live, lp, 0.0)
        done = live & (nxt == self.eos_id)  # [m]
        self.lengths[rows] = torch.where(done, t + 1, self.lengths[rows])
        self.finished[rows] = self.finished[rows] | done
        return live & ~done

    def to_host(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens, logprobs, lengths, finished)`` on the host, cut to the longest response."""
        lengths = self.lengths.cpu()
        width = int(lengths.max()) if len(lengths) else 0
        return self.tokens.cpu()[:, :width], self.logprobs.cpu()[:, :width], lengths, self.finished.cpu()
