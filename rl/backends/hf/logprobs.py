"""Per-token logprobs of given sequences under a model (policy, reference policy, or the training forward).

Owns the forward pass -> logprob reduction: the trunk over the padded micro-batch, the LM head (`rl.backends.hf.lm_head`)
only over the wanted positions, packed; log_softmax over the vocabulary is never materialized.
"""

from __future__ import annotations

import torch

from rl.backends.hf.lm_head import lm_head
from rl.precision import autocast, device_of


def hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, precision: str, **kwargs) -> torch.Tensor:
    """[M, S, H] final hidden states of the model's trunk (the decoder without the LM head), in ``precision``.

    ``kwargs`` go to the decoder's forward (``position_ids``, ``past_key_values``, ``use_cache``). Callers that
    run many forwards with unchanged weights wrap them in one :func:`rl.precision.autocast` block: torch's autocast
    caches the bf16 copies of weights that require grad until the outermost block exits.
    """
    device = device_of(model)
    with autocast(model, precision):
        return model.get_decoder()(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
        ).last_hidden_state


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    *,
    precision: str,
    temperature: float = 1.0,
    token_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logprobs of right-padded sequences, each shared prompt encoded once; gradients flow if enabled by the caller.

    Each row splits at its first wanted token: the prefix before the position that predicts it (the prompt, for a
    rollout) and the suffix (last prompt token + response). Rows with the same prefix (a GRPO group's G
    completions) share one prefix forward, whose KV cache the suffixes attend to; autograd carries their gradients
    back through it. A group of 8 rollouts of SmolLM2 (prompts ~37 tokens, responses ~22) then runs ~45% fewer
    trunk tokens than the plain padded forward, with the same values up to float rounding (positions and masks
    are those of the full sequence). The LM head (a [H, V] matmul and a [T, V] log-sum-exp) runs only on the
    wanted positions, packed into one [T, H] batch (`rl.backends.hf.lm_head`).

    Args:
        model: Hugging Face causal LM with a bias-free linear LM head (see :func:`rl.backends.hf.lm_head.lm_head`).
        input_ids: [M, S] int64, right-padded.
        input_lengths: [M] int64 unpadded lengths (>= 1).
        precision: ``auto``, ``bfloat16`` or ``float32`` (see :func:`rl.precision.autocast`).
        temperature: logits are divided by it, matching the sampling distribution of generation.
        token_mask: [M, S] bool, the tokens whose logprobs are wanted (position 0 is never computed); None = all.

    Returns:
        [M, S] float32 (float64 for a float64 model): entry t = log p(input_ids[t] | input_ids[<t]) in nats where
        wanted, 0 elsewhere (position 0, padding, tokens outside ``token_mask``).
    """
    from transformers import DynamicCache

    m, s = input_ids.shape
    device = device_of(model)
    arange = torch.arange(s)[None, :]  # [1, S]
    want = (arange < input_lengths[:, None])[:, 1:]  # [M, S-1], position t predicts token t+1
    if token_mask is not None:
        want = want & token_mask[:, 1:].bool()
    first = torch.where(want.any(1), want.int().argmax(1), 0)  # [M] first predicting position = prefix length
    prefixes = [tuple(input_ids[i, : int(first[i])].tolist()) for i in range(m)]
    distinct: dict[tuple[int, ...], int] = {}
    owner = torch.tensor([distinct.setdefault(p, len(distinct)) for p in prefixes])  # [M] row -> its prefix
    cache, prefix_mask = None, torch.zeros(m, 0, dtype=torch.int64)  # [M, P]
    if int(first.max()) > 0:  # encode each distinct prefix once, then give every row its prefix's KV cache
        # right-padded, so that no query row is fully masked (in float64 that gives NaN, which the pad positions'
        # keys would carry into the suffix); the suffix's attention mask hides the pad keys
        width = max(map(len, distinct))
        ids = torch.tensor([[*p, *(0,) * (width - len(p))] for p in distinct])  # [k, P]
        attn = (torch.arange(width)[None, :] < torch.tensor([len(p) for p in distinct])[:, None]).long()  # [k, P]
        cache = DynamicCache(config=model.config)
        hidden_states(model, ids, attn, precision=precision, past_key_values=cache, use_cache=True)
        cache.batch_select_indices(owner.to(device))
        prefix_mask = attn[owner]
    width = int((input_lengths - first).max())  # suffix width R
    cols = first[:, None] + torch.arange(width)[None, :]  # [M, R] source positions of the suffix
    live = cols < input_lengths[:, None]  # [M, R]
    suffix = torch.where(live, input_ids.gather(1, cols.clamp(max=s - 1)), 0)  # [M, R]
    hidden = hidden_states(
        model, suffix, torch.cat([prefix_mask, live.long()], 1), precision=precision, position_ids=cols.to(device),
        past_key_values=cache, use_cache=cache is not None,
    )  # [M, R, H]
    # suffix position j (source position cols[i, j]) predicts token cols[i, j] + 1
    picked = live & (cols < s - 1) & want.gather(1, cols.clamp(max=s - 2))  # [M, R]
    rows, js = picked.nonzero(as_tuple=True)  # [T] each
    targets = input_ids[rows, cols[rows, js] + 1]  # [T]
    lp = lm_head(model, precision).token_logprobs(hidden[rows.to(device), js.to(device)], targets.to(device), temperature).cpu()
    return lp.new_zeros(m, s).index_put((rows, cols[rows, js] + 1), lp)  # [M, S]


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
        token_mask: [N, S] bool, True on response tokens: the only tokens whose logprobs are computed.

    Returns:
        [N, S] float32, 0 outside ``token_mask``.
    """
    out = torch.zeros(input_ids.shape, dtype=torch.float32)  # [N, S]
    order = torch.arange(input_ids.shape[0])  # row order: a rollout's groups stay together and share their prompt
    with torch.no_grad(), autocast(model, precision):  # one block: weights are cast once (when they require grad)
        for a in range(0, input_ids.shape[0], batch_size):
            rows = order[a : a + batch_size]  # [m]
            width = int(input_lengths[rows].max())
            out[rows, :width] = forward_logprobs(
                model,
                input_ids[rows, :width],
                input_lengths[rows],
                precision=precision,
                temperature=temperature,
                token_mask=token_mask[rows, :width],
            ).to(out.dtype)
    return out
