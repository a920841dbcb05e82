"""Rollout generation with a batched, KV-cached decode loop over a Hugging Face causal LM: completions, their
per-token generation logprobs, and the jagged per-token fields the data plane stores.

Owns sampling only; scoring is `rl.data`, storage is `dataplane`.
"""

from __future__ import annotations

import torch

from rl.backends.hf.lm_head import lm_head
from rl.backends.interfaces import Generated
from rl.backends.hf.logprobs import hidden_states
from rl.precision import autocast, device_of


def _group_size(prompts: list[list[int]]) -> int:
    """G if ``prompts`` is runs of G identical consecutive prompts (a rollout's groups), else 1."""
    g = 1
    while g < len(prompts) and prompts[g] == prompts[0]:
        g += 1
    if len(prompts) % g or any(prompts[i] != prompts[i - i % g] for i in range(len(prompts))):
        return 1
    return g


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, P] int64 ids and attention mask of ``rows``, left-padded to the longest."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)  # [n, P]
    attn = torch.zeros((len(rows), width), dtype=torch.int64)  # [n, P]
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
    return ids, attn


def sample_next(
    logits: torch.Tensor, *, temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its generation logprob.

    Sampling is inverse-CDF (one uniform per row against the cumulative probabilities): the same distribution
    as ``torch.multinomial``, which on CPU spends ~78 ms per [64, 49152] call drawing an exponential per entry.

    Args:
        logits: [n, V] float32 next-token logits.
        temperature: logits are divided by it (ignored when ``greedy``).
        top_p: nucleus sampling mass (1.0 = off); the logprob stays that of the temperature-scaled distribution
            before truncation, as in NeMo-RL / vLLM ``generation_logprobs``.
        greedy: argmax; the logprob is that of the unscaled distribution.
        generator: source of the uniforms (a CPU generator for CPU logits); None: torch's global generator.

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


def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
    precision: str = "auto",
    generator: torch.Generator | None = None,
) -> Generated:
    """Generate one completion per prompt (repeat a prompt G times, consecutively, for a group).

    A KV-cached decode loop: when the prompts come in runs of G identical ones, each distinct prompt is prefilled
    once and its KV cache repeated G times (the prompt is encoded B times instead of B*G); rows that have produced
    eos leave the batch, so late decode steps run only the still-open rows. Positions count real tokens only
    (``cumsum(attention_mask) - 1``), so a left-padded prompt is encoded exactly as it is alone, and as the
    right-padded training forward encodes it.

    Args:
        model: causal LM (eval mode) whose forward takes ``past_key_values`` and ``position_ids``.
        tokenizer: its tokenizer (pad and eos ids are used).
        prompts: N prompt token-id lists.
        max_new_tokens: most tokens per completion.
        temperature, top_p: sampling; ignored when ``greedy``.
        greedy: argmax decoding (validation).
        batch_size: sequences per decode batch (rounded down to whole groups).
        precision: ``auto``, ``bfloat16`` or ``float32`` (see :func:`rl.precision.autocast`).
        generator: a CPU ``torch.Generator`` that all sampling draws from (None: torch's global generator).

    Returns:
        :class:`Generated`.
    """
    eos = tokenizer.eos_token_id
    g = _group_size(prompts)
    step = max(g, batch_size // g * g)
    out = Generated([], [], [], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), [])
    p_lens, r_lens, trunc = [], [], []
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        new, lp, lengths, finished = _decode(
            model, chunk, g, pad_id=tokenizer.pad_token_id, eos_id=eos, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, greedy=greedy, precision=precision, generator=generator,
        )
        for i, p in enumerate(chunk):
            r = int(lengths[i])
            out.input_ids.append(torch.cat([torch.tensor(p, dtype=torch.int64), new[i, :r]]))
            out.generation_logprobs.append(torch.cat([torch.zeros(len(p)), lp[i, :r]]))
            out.token_mask.append(torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(r, dtype=torch.bool)]))
            out.response_token_ids.append(new[i, :r].tolist())
            p_lens.append(len(p))
            r_lens.append(r)
            trunc.append(not bool(finished[i]))
    out.prompt_lengths = torch.tensor(p_lens, dtype=torch.int64)
    out.response_lengths = torch.tensor(r_lens, dtype=torch.int64)
    out.truncated = torch.tensor(trunc, dtype=torch.bool)
    return out


def _decode(
    model: torch.nn.Module,
    prompts: list[list[int]],
    g: int,
    *,
    pad_id: int,
    eos_id: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    greedy: bool,
    precision: str,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode ``prompts`` (runs of ``g`` identical ones) and return ``(tokens [n, T] int64, logprobs [n, T]
    float32, response lengths [n] int64 with eos counted, finished [n] bool)``; T <= ``max_new_tokens``."""
    from transformers import DynamicCache

    device = device_of(model)
    n = len(prompts)
    ids, attn = _left_pad(prompts[::g], pad_id)  # [n/g, P] each
    pos = (attn.cumsum(-1) - 1).clamp_(min=0)  # [n/g, P] positions of real tokens
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.int64)  # [n, T]
    logprobs = torch.zeros(n, max_new_tokens)  # [n, T]
    lengths = torch.full((n,), max_new_tokens, dtype=torch.int64)  # [n]
    finished = torch.zeros(n, dtype=torch.bool)  # [n]
    head = lm_head(model, precision)
    # one autocast block around the whole loop: its cache casts the float32 weights to bf16 once, not per token
    with torch.no_grad(), autocast(model, precision):
        cache = DynamicCache(config=model.config)
        if ids.shape[1] > 1:  # all but the last prompt token, once per distinct prompt (the trunk only)
            hidden_states(
                model, ids[:, :-1], attn[:, :-1], precision=precision, position_ids=pos[:, :-1].to(device),
                past_key_values=cache, use_cache=True,
            )
            if g > 1:
                cache.batch_repeat_interleave(g)
        rows = torch.arange(n)  # [m] rows still open, as indices into the chunk
        cur = ids[:, -1:].repeat_interleave(g, 0)  # [m, 1]
        cur_pos = pos[:, -1:].repeat_interleave(g, 0)  # [m, 1]
        mask = attn.repeat_interleave(g, 0)  # [m, L]
        for t in range(max_new_tokens):
            hidden = hidden_states(
                model, cur, mask, precision=precision, position_ids=cur_pos.to(device), past_key_values=cache, use_cache=True,
            )[:, -1]  # [m, H]
            logits = head.logits(hidden)  # [m, V]
            nxt, lp = sample_next(logits.cpu(), temperature=temperature, top_p=top_p, greedy=greedy, generator=generator)  # [m] each
            if head.corrected:  # the sampled token's exact logit, as the training forward computes it (rl.backends.hf.lm_head)
                exact = head.target_logits(hidden, nxt.to(device)) - logits.gather(1, nxt[:, None].to(device)).squeeze(1)
                lp = lp + exact.cpu().to(lp.dtype) / (1.0 if greedy else temperature)
            tokens[rows, t] = nxt
            logprobs[rows, t] = lp
            done = nxt == eos_id  # [m]
            lengths[rows[done]] = t + 1
            finished[rows[done]] = True
            if done.all():
                break
            if done.any():  # finished rows leave the batch and the cache
                keep = (~done).nonzero().squeeze(1)  # [m']
                cache.batch_select_indices(keep.to(device))
                rows, nxt, cur_pos, mask = rows[keep], nxt[keep], cur_pos[keep], mask[keep]
            cur = nxt[:, None]
            cur_pos = cur_pos + 1
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], 1)
    width = int(lengths.max()) if n else 0
    return tokens[:, :width], logprobs[:, :width], lengths, finished
