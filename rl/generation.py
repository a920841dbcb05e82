"""Rollout generation with Hugging Face ``generate`` (KV cache, batched): completions, their
per-token generation logprobs, and the jagged per-token fields the data plane stores.

Owns sampling only; scoring is `rl.data`, storage is `dataplane`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl.precision import autocast, device_of


@dataclass
class Generated:
    """N completions (rows in the order of the prompts given).

    Attributes:
        input_ids: list of N int64 [L_i] tensors, prompt + response tokens.
        generation_logprobs: list of N float32 [L_i], log p(token_t | <t) under the sampling
            distribution (logits / temperature), 0 on prompt tokens.
        token_mask: list of N bool [L_i], True on response tokens.
        prompt_lengths, response_lengths: [N] int64.
        truncated: [N] bool, True where no eos was generated within ``max_new_tokens``.
        response_token_ids: N lists of response token ids (eos included when generated).
    """

    input_ids: list[torch.Tensor]
    generation_logprobs: list[torch.Tensor]
    token_mask: list[torch.Tensor]
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    response_token_ids: list[list[int]]


def _group_size(prompts: list[list[int]]) -> int:
    """G if ``prompts`` is runs of G identical consecutive prompts (a rollout's groups), else 1."""
    g = 1
    while g < len(prompts) and prompts[g] == prompts[0]:
        g += 1
    if len(prompts) % g or any(prompts[i] != prompts[i - i % g] for i in range(len(prompts))):
        return 1
    return g


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, P] int64 ids and attention mask, left-padded to the longest prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)  # [n, P]
    attn = torch.zeros((len(prompts), width), dtype=torch.int64)  # [n, P]
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    return ids, attn


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
    precision: str = "float32",
) -> Generated:
    """Generate one completion per prompt (repeat a prompt G times, consecutively, for a group).

    When the prompts come in runs of G identical ones, each distinct prompt is prefilled once and its KV
    cache repeated G times, so the prompt is encoded B times instead of B*G.

    Args:
        model: causal LM (eval mode).
        tokenizer: its tokenizer (pad and eos ids are used).
        prompts: N prompt token-id lists.
        max_new_tokens: most tokens per completion.
        temperature, top_p: sampling; ignored when ``greedy``.
        greedy: argmax decoding (validation).
        batch_size: sequences per ``generate`` call (rounded down to whole groups).
        precision: ``bfloat16`` (autocast) or ``float32``.

    Returns:
        :class:`Generated`. Randomness comes from torch's global generator: seed it before calling.
    """
    from transformers import DynamicCache, GenerationConfig

    eos = tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        top_p=1.0 if greedy else top_p,
        top_k=0,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    scale = 1.0 if greedy else temperature
    device = device_of(model)
    g = _group_size(prompts)
    step = max(g, batch_size // g * g)
    out = Generated([], [], [], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool), [])
    p_lens, r_lens, trunc = [], [], []
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        ids, attn = _left_pad(chunk[::g], tokenizer.pad_token_id)  # [n/g, P] each
        width = ids.shape[1]
        with torch.no_grad(), autocast(model, precision):
            kwargs = {}
            if g > 1 and width > 1:  # prefill all but the last prompt token once per distinct prompt
                cache = DynamicCache(config=model.config)
                model(input_ids=ids[:, :-1].to(device), attention_mask=attn[:, :-1].to(device), past_key_values=cache, use_cache=True)
                cache.batch_repeat_interleave(g)
                kwargs["past_key_values"] = cache
            ids, attn = ids.repeat_interleave(g, 0), attn.repeat_interleave(g, 0)  # [n, P]
            result = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), generation_config=config, **kwargs)
        new = result.sequences[:, width:].cpu()  # [n, T]
        logits = torch.stack(result.logits, 1).float().cpu()  # [n, T, V]
        lp = (logits / scale).log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)  # [n, T]
        for i, p in enumerate(chunk):
            row = new[i]
            hits = (row == eos).nonzero()
            r = int(hits[0]) + 1 if len(hits) else row.shape[0]
            resp = row[:r]
            out.input_ids.append(torch.cat([torch.tensor(p, dtype=torch.int64), resp]))
            out.generation_logprobs.append(torch.cat([torch.zeros(len(p)), lp[i, :r]]).float())
            out.token_mask.append(torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(r, dtype=torch.bool)]))
            out.response_token_ids.append(resp.tolist())
            p_lens.append(len(p))
            r_lens.append(r)
            trunc.append(not len(hits))
    out.prompt_lengths = torch.tensor(p_lens, dtype=torch.int64)
    out.response_lengths = torch.tensor(r_lens, dtype=torch.int64)
    out.truncated = torch.tensor(trunc, dtype=torch.bool)
    return out
