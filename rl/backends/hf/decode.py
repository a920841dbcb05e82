"""Rollout generation with a batched, KV-cached decode loop over a Hugging Face causal LM: completions, their
per-token generation logprobs, and the jagged per-token fields the data plane stores.

Owns generation only (the dispatch to this dynamic-cache loop or the static-cache one of
`rl.backends.hf.static_decode`, and the decode batch size); what both loops share is `rl.backends.hf.sampling`'s;
scoring is `rl.data`, storage is `dataplane`.
"""

from __future__ import annotations

import torch

from rl.backends.hf.gqa_decode import grouped_query_decode
from rl.backends.hf.kv_reuse import KVRow, reusable, row_layers, seeded_cache
from rl.backends.hf.lm_head import lm_head
from rl.backends.hf.logprobs import hidden_states
from rl.backends.hf.sampling import (
    SYNC_EVERY,
    Completions,
    DecodeSettings,
    left_pad,
    next_tokens,
    one_token_mask,
    one_token_masks_apply,
    prefill,
)
from rl.backends.hf.sdpa import DECODE_PIN, check_pin, pinned
from rl.backends.hf.static_decode import decode_static, stored_in_compute_dtype
from rl.backends.hf.stop_strings import StopStrings
from rl.backends.interfaces import Generated
from rl.precision import autocast, device_of, on_accelerator, to_device

LOOPS = ("dynamic", "static", "graphs")
"""Decode loops: ``dynamic`` (a KV cache that grows per token, rows prefilled once per distinct prompt), ``static``
(a static KV cache of prompt + ``max_new_tokens`` positions: every step has the same shapes) and ``graphs`` (the
static loop with its one-token step replayed as a CUDA graph; without a graph off CUDA)."""

CUDA_LOOP = "dynamic"
"""The loop of a CUDA GPU when ``generation.cuda_graphs`` is null: measured fastest at 1B (``bench/step.py``, parts
``step1B`` and ``step1Bgraphs`` of ``scripts/gpu_check.sh``; the graph loop was faster only at 135M). Figures:
``docs/gpu.md``."""

COMPACT_BELOW = 0.5
"""On an accelerator the dynamic loop keeps finished rows in its batch (their tokens discarded), so that the batch
dimension stays put, until at most this share of the batch is still open; then the finished rows leave the batch and
the KV cache. On the CPU a finished row leaves at once."""


def _group_size(prompts: list[list[int]]) -> int:
    """G if ``prompts`` is runs of G identical consecutive prompts (a rollout's groups), else 1."""
    g = 1
    while g < len(prompts) and prompts[g] == prompts[0]:
        g += 1
    if len(prompts) % g or any(prompts[i] != prompts[i - i % g] for i in range(len(prompts))):
        return 1
    return g


def generate(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    batch_size: int | None = None,
    precision: str = "auto",
    generator: torch.Generator | None = None,
    loop: str = "dynamic",
    sdpa_pin: str = DECODE_PIN,
    compact_below: float = COMPACT_BELOW,
    gqa_decode: bool | None = None,
    kv_in: list[KVRow | None] | None = None,
    kv_out: list[KVRow | None] | None = None,
    stop_strings: list[list[str] | None] | None = None,
) -> Generated:
    """Generate one completion per prompt (repeat a prompt G times, consecutively, for a group).

    A KV-cached decode loop: when the prompts come in runs of G identical ones, each distinct prompt is prefilled
    once and its KV cache repeated G times (the prompt is encoded B times instead of B*G); rows that have produced
    eos leave the batch (on an accelerator once at most ``compact_below`` of the batch is open), so late decode steps
    run only the still-open rows. Or a static-cache loop (``loop``). Positions count real tokens only
    (:func:`rl.backends.hf.sampling.left_pad`), so a left-padded prompt is encoded exactly as it is alone, and as the
    right-padded training forward encodes it.

    Device: the prompts are copied to the model's device once per decode batch; sampling, masks, positions and the
    output buffers stay there, and the completions come back in one copy at the end. On the CPU a finished row leaves
    the batch at once; on a GPU the loop reads how many rows are open only every
    :data:`rl.backends.hf.sampling.SYNC_EVERY` tokens (each read waits for the device), so a finished row may run up
    to that many extra steps, its tokens discarded.

    Args:
        model: causal LM (eval mode) whose forward takes ``past_key_values`` and ``position_ids``.
        tokenizer: its tokenizer (pad and eos ids are used).
        prompts: N prompt token-id lists.
        max_new_tokens: most tokens per completion.
        temperature, top_p: sampling; ignored when ``greedy``.
        greedy: argmax decoding (validation).
        batch_size: sequences per decode batch (rounded down to whole groups); None: :func:`default_batch_size`.
        precision: ``auto``, ``bfloat16`` or ``float32`` (see :func:`rl.precision.autocast`).
        generator: a ``torch.Generator`` on the model's device that all sampling draws from (None: torch's global
            generator); the same seed gives the same completions on the same device.
        loop: one of :data:`LOOPS`. ``static`` and ``graphs`` (`rl.backends.hf.static_decode`) only for a model
            stored in its compute dtype (the GPU's bf16 generation copy), with eager or SDPA attention and no sliding
            window shorter than the sequence (:func:`rl.backends.hf.sampling.one_token_masks_apply`); otherwise the
            dynamic loop runs.
        sdpa_pin: the SDPA kernels the loop runs under on CUDA (:data:`rl.backends.hf.sdpa.PINS`).
        compact_below: see :data:`COMPACT_BELOW` (accelerators only).
        gqa_decode: decode steps attend with `rl.backends.hf.gqa_decode` (grouped query heads folded onto their
            key-value head, no copies) where the model runs SDPA with grouped heads; None: on CUDA only.
        kv_in: [N] the KV a previous call kept per row (`rl.backends.hf.kv_reuse.KVRow`, or None): a prompt that
            starts with its row's tokens prefills only the rest (the dynamic loop, prompts not in groups).
        kv_out: a list the call appends each row's KV to (None where the static loop ran), for the next call.
        stop_strings: [N] per prompt the strings that end its completion after the token that completes the first of
            them (kept in the completion; `rl.backends.hf.stop_strings`), or None. Rows with stop strings run the
            dynamic loop.

    Returns:
        :class:`Generated`, on the host.

    Raises:
        ValueError: an unknown ``loop`` or ``sdpa_pin``, or ``compact_below`` outside [0, 1].
    """
    if loop not in LOOPS:
        msg = f"unknown decode loop {loop!r}: use one of {list(LOOPS)}"
        raise ValueError(msg)
    check_pin(sdpa_pin)
    if not 0 <= compact_below <= 1:
        msg = f"compact_below is {compact_below}: use a share of the batch in [0, 1]"
        raise ValueError(msg)
    g = 1 if kv_in is not None else _group_size(prompts)  # continued rows each have their own cache
    longest = max((len(p) for p in prompts), default=0) + max_new_tokens
    step = max(g, (batch_size or default_batch_size(model, longest)) // g * g)
    out = Generated(
        [],
        [],
        [],
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.bool),
        [],
    )
    ends = {"pad_id": tokenizer.pad_token_id, "eos_id": tokenizer.eos_token_id, "max_new_tokens": max_new_tokens}
    sampling = {"temperature": temperature, "top_p": top_p, "greedy": greedy, "generator": generator}
    settings = DecodeSettings(**ends, **sampling, precision=precision)
    p_lens, r_lens, trunc = [], [], []
    device = device_of(model)
    static = loop != "dynamic" and stored_in_compute_dtype(model, precision) and one_token_masks_apply(model, longest)
    static = static and not any(stop_strings or ())
    for start in range(0, len(prompts), step):
        chunk = prompts[start : start + step]
        gqa = device.type == "cuda" if gqa_decode is None else gqa_decode
        with pinned(device, sdpa_pin), grouped_query_decode(model, gqa):
            if static:
                new, lp, lengths, finished = decode_static(
                    model, chunk, settings, graph=loop == "graphs" and device.type == "cuda", group=g
                )
            else:
                kept = None if kv_out is None else [None] * len(chunk)
                reuse = None if kv_in is None else kv_in[start : start + step]
                stops = None if stop_strings is None else StopStrings(tokenizer, stop_strings[start : start + step])
                new, lp, lengths, finished = _decode(model, chunk, g, settings, compact_below, reuse, kept, stops)
        if kv_out is not None:
            kv_out.extend(kept if not static and kept is not None else [None] * len(chunk))
        ids, r_list = new.tolist(), lengths.tolist()
        for i, p in enumerate(chunk):
            r = r_list[i]
            out.input_ids.append(torch.tensor([*p, *ids[i][:r]], dtype=torch.int64))
            out.generation_logprobs.append(torch.cat([torch.zeros(len(p)), lp[i, :r]]))
            out.token_mask.append(torch.cat([torch.zeros(len(p), dtype=torch.bool), torch.ones(r, dtype=torch.bool)]))
            out.response_token_ids.append(ids[i][:r])
            p_lens.append(len(p))
        r_lens += r_list
        trunc += (~finished).tolist()
    out.prompt_lengths = torch.tensor(p_lens, dtype=torch.int64)
    out.response_lengths = torch.tensor(r_lens, dtype=torch.int64)
    out.truncated = torch.tensor(trunc, dtype=torch.bool)
    return out


CPU_BATCH_SIZE = 64
"""Sequences per decode batch on the CPU: 64 x 32 new tokens of SmolLM2-135M measured fastest on 2 cores."""
MAX_DEVICE_BATCH_SIZE = 4096


def default_batch_size(model: torch.nn.Module, longest: int) -> int:
    """Sequences per decode batch when ``generation.batch_size`` is not set: :data:`CPU_BATCH_SIZE` on the CPU; 512 on
    an accelerator other than CUDA; on a CUDA GPU as many as half its free memory holds (free: unused device memory plus
    what torch's allocator holds unused), at least 1 and at most :data:`MAX_DEVICE_BATCH_SIZE`. Bytes per sequence: its
    KV cache of ``longest`` tokens (2 x layers x key-value heads x head dim x element size), one layer's prefill
    activations over ``longest`` tokens (3 x MLP width + 4 x hidden size elements each, as if every row were
    prefilled), and ten float32 vocabulary rows of sampling work (logits, log-softmax, probabilities, cumulative
    sums, and a top-p sort's values and int64 indices)."""
    device = device_of(model)
    if not on_accelerator(device):
        return CPU_BATCH_SIZE
    if device.type != "cuda":
        return 512
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
    elem = torch.finfo(next(model.parameters()).dtype).bits // 8
    kv = 2 * c.num_hidden_layers * heads * head_dim * elem * longest
    prefill = (3 * width + 4 * c.hidden_size) * elem * longest
    per_row = kv + prefill + 10 * 4 * c.vocab_size
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(max(1, min(MAX_DEVICE_BATCH_SIZE, free // 2 // per_row)))


def _decode(
    model: torch.nn.Module,
    prompts: list[list[int]],
    g: int,
    settings: DecodeSettings,
    compact_below: float,
    kv_in: list[KVRow | None] | None = None,
    kv_out: list[KVRow | None] | None = None,
    stops: StopStrings | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode ``prompts`` (runs of ``g`` identical ones) on the model's device, with a dynamic KV cache that finished
    rows leave (on an accelerator once at most ``compact_below`` of the batch is open); returns
    :meth:`rl.backends.hf.sampling.Completions.to_host`.

    ``kv_in`` ([n], with ``g`` 1): a row whose prompt starts with its entry's tokens prefills only the rest
    (`rl.backends.hf.kv_reuse`). ``kv_out`` ([n], filled in place): each row's KV of the tokens it fed. ``stops``:
    the rows' stop strings, checked at each read of the open rows and after the last step."""
    from transformers import DynamicCache

    device = device_of(model)
    check_every = SYNC_EVERY if on_accelerator(device) else 1
    if not on_accelerator(device):
        compact_below = 1.0  # a finished row leaves at once
    n, t_max, precision = len(prompts), settings.max_new_tokens, settings.precision
    cached = [reusable(kv, p) for kv, p in zip(kv_in, prompts, strict=True)] if kv_in and g == 1 else [0] * n
    ids, attn, pos = left_pad([p[c:] for p, c in zip(prompts[::g], cached[::g], strict=True)], settings.pad_id)
    pos = pos + torch.tensor(cached[::g], dtype=torch.int64)[:, None] * attn  # [n/g, P] each, host
    ids, attn, pos = to_device(ids, device), to_device(attn, device), to_device(pos, device)
    out = Completions(n, t_max, pad_id=settings.pad_id, eos_id=settings.eos_id, device=device)
    head = lm_head(model, precision)
    # one autocast block around the whole loop: its cache casts the float32 weights to bf16 once, not per token
    with torch.no_grad(), autocast(model, precision):
        if any(cached):  # the conversation so far from the last call; only what came after it is prefilled
            assert kv_in is not None
            cache, seen = seeded_cache(model, kv_in, cached)  # [n, C]
            attn = torch.cat([seen, attn], 1)  # [n, C + P]
            prefill(model, ids, attn, pos, cache, precision)
        else:
            cache = DynamicCache(config=model.config)
            prefill(model, ids, attn, pos, cache, precision)  # once per distinct prompt
            if ids.shape[1] > 1 and g > 1:
                cache.batch_repeat_interleave(g)
        width = attn.shape[1]  # C + P
        padded = any(cached) or any(len(p) != len(prompts[0]) for p in prompts)  # on the host: no device read
        own_mask = on_accelerator(device) and one_token_masks_apply(model, width + t_max)
        rows = torch.arange(n, device=device)  # [m] rows in the batch, as indices into the chunk
        live = torch.ones(n, dtype=torch.bool, device=device)  # [m] rows in the batch that are still open
        cur = ids[:, -1:].repeat_interleave(g, 0)  # [m, 1]
        cur_pos = pos[:, -1:].repeat_interleave(g, 0)  # [m, 1]
        mask = torch.cat([attn.repeat_interleave(g, 0), attn.new_ones(n, t_max)], 1)  # [m, P + T]
        stops = stops if stops is not None and stops.any else None
        checked = 0  # tokens 0..checked-1 were checked for stop strings
        for t in range(t_max):
            if not padded and own_mask:  # every key is real: no mask (SDPA's grouped-head kernels, as generate)
                step_mask = None
            elif own_mask:
                step_mask = one_token_mask(model, mask[:, : width + t])
            else:
                step_mask = mask[:, : width + t]
            hidden = hidden_states(
                model,
                cur,
                step_mask,
                precision=precision,
                position_ids=cur_pos,
                past_key_values=cache,
                use_cache=True,
            )[:, -1]  # [m, H]
            nxt, lp = next_tokens(head, hidden, head.logits(hidden), settings)
            live = out.record(rows, t, nxt, lp, live)
            if (t + 1) % check_every == 0:
                if stops is not None:
                    live, checked = stops.close(out, rows, live, t, checked), t + 1
                left = int(live.sum())  # waits for the device
                if left == 0:
                    break
                if left < len(rows) and left <= compact_below * len(rows):  # finished rows leave batch and cache
                    keep = live.nonzero().squeeze(1)  # [m']
                    if kv_out is not None:
                        _keep_kv(cache, rows, mask, out.lengths, width, (~live).nonzero().squeeze(1), kv_out)
                    cache.batch_select_indices(keep)
                    rows, live, nxt, cur_pos, mask = rows[keep], live[keep], nxt[keep], cur_pos[keep], mask[keep]
            cur = nxt[:, None]
            cur_pos = cur_pos + 1
        if stops is not None and t_max and checked <= t:  # the steps after the last read (t: the last step)
            stops.close(out, rows, live, t, checked)
        if kv_out is not None:  # the rows still in the batch
            _keep_kv(cache, rows, mask, out.lengths, width, torch.arange(len(rows), device=device), kv_out)
    host = out.to_host()
    if kv_out is not None:  # the tokens each row's KV covers: its prompt and its completion but the last token
        for i, p in enumerate(prompts):
            layers = kv_out[i]
            assert isinstance(layers, list)
            r = int(host[2][i])
            kv_out[i] = KVRow(tokens=[*p, *host[0][i, : r - 1].tolist()], layers=layers)
    return host


def _keep_kv(
    cache: object,
    rows: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    width: int,
    which: torch.Tensor,
    kv_out: list,
) -> None:
    """Copy the KV of batch rows ``which`` (indices into ``rows``) into ``kv_out`` at their chunk index, where not
    kept yet: the positions of each row's real tokens up to its last fed one (prompt width + response length - 1)."""
    picked = torch.stack([which, rows[which], lengths[rows[which]]]).cpu()  # [3, k]: one read of the device
    for j, i, r in zip(*picked.tolist(), strict=True):
        if kv_out[i] is None:
            kv_out[i] = row_layers(cache, j, mask[j, : width + r - 1].bool())
