"""Per-token logprobs of given sequences under a model (policy, reference policy, or the training forward).

Owns the forward pass -> logprob reduction: the trunk over the padded micro-batch, the LM head
(`rl.backends.hf.lm_head`) only over the wanted positions, packed; log_softmax over the vocabulary is never
materialized. Index maths runs on the host, the forward on the model's device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rl.backends.hf.lm_head import lm_head
from rl.backends.micro_batch import micro_batch_slices
from rl.precision import autocast, device_of, on_accelerator, to_device


def hidden_states(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, precision: str, **kwargs
) -> torch.Tensor:
    """[M, S, H] final hidden states of the model's trunk (the decoder without the LM head), in ``precision``.

    ``kwargs`` go to the decoder's forward (``position_ids``, ``past_key_values``, ``use_cache``). Callers that
    run many forwards with unchanged weights wrap them in one :func:`rl.precision.autocast` block: torch's autocast
    caches the bf16 copies of weights that require grad until the outermost block exits.
    """
    device = device_of(model)
    with autocast(model, precision):
        return model.get_decoder()(
            input_ids=input_ids.to(device),
            attention_mask=None if attention_mask is None else attention_mask.to(device),
            **kwargs,
        ).last_hidden_state


@dataclass(frozen=True)
class ForwardPlan:
    """Where one shared-prefix forward reads and writes: index tensors built on the host from a host micro-batch, so
    that shaping the forward needs no device sync; :meth:`to` copies them to the model's device once.

    Attributes:
        shape: ``(M, S)`` of the micro-batch.
        prefix_ids: [k, P] int64, each distinct prefix once (first-appearance order), right-padded with 0; None when
            no row has a prefix.
        prefix_mask: [k, P] int64, 1 on prefix tokens.
        owner: [M] int64, the distinct prefix of each row.
        suffix_ids: [M, R] int64, each row from its last prefix position (the one that predicts its first wanted
            token) to its end, padded with 0.
        attention_mask: [M, P + R] int64, the row's prefix mask then 1 on its live suffix positions.
        positions: [M, R] int64, the suffix's positions in the full sequence.
        rows, cols: [T] int64, the suffix entries whose hidden states predict a wanted token.
        targets: [T] int64, the tokens they predict.
        out_cols: [T] int64, where those tokens are in the [M, S] output (``positions[rows, cols] + 1``).
    """

    shape: tuple[int, int]
    prefix_ids: torch.Tensor | None
    prefix_mask: torch.Tensor
    owner: torch.Tensor
    suffix_ids: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    out_cols: torch.Tensor

    def to(self, device: torch.device) -> ForwardPlan:
        """This plan's tensors on ``device`` (pinned, non-blocking copies: `rl.precision.to_device`)."""
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shape"}
        return ForwardPlan(
            shape=self.shape, **{k: None if v is None else to_device(v, device) for k, v in moved.items()}
        )


SHARED_PREFIX_MIN_SAVING = {"cpu": 0.0, "cuda": 0.0}
"""Per device type: the shared-prefix forward runs when it saves more than this fraction of the plain forward's
trunk tokens (``1 - (k P + M R) / (M S)`` for k distinct prefixes of width P, M rows of suffix width R and width S);
otherwise one plain forward over the whole rows (one launch sequence, no KV-cache copies). Measured in
``bench/megatron.py``'s ``--variants`` (``docs/gpu.md``)."""


def plan_forward(
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    token_mask: torch.Tensor | None = None,
    *,
    min_saving: float | None = 0.0,
) -> ForwardPlan:
    """The :class:`ForwardPlan` of a right-padded micro-batch; vectorized host maths, no per-row Python.

    Each row splits at its first wanted token: the prefix before the position that predicts it (the prompt, for a
    rollout) and the suffix. Rows with the same prefix (a GRPO group's G completions) share one prefix forward, when
    that saves more than ``min_saving`` of the trunk tokens of a plain forward over the whole rows; otherwise (and
    with ``min_saving`` None) the plan is the plain forward: no prefix, every row from position 0.

    Args:
        input_ids: [M, S] int64, right-padded (host; a device tensor is copied to the host first).
        input_lengths: [M] int64 unpadded lengths (>= 1).
        token_mask: [M, S] bool, the tokens whose logprobs are wanted (position 0 never is); None = all.
    """
    input_ids, input_lengths = input_ids.cpu(), input_lengths.cpu()
    m, s = input_ids.shape
    arange = torch.arange(s)[None, :]  # [1, S]
    want = (arange < input_lengths[:, None])[:, 1:]  # [M, S-1], position t predicts token t+1
    if token_mask is not None:
        want = want & token_mask.cpu()[:, 1:].bool()
    first = torch.where(want.any(1), want.int().argmax(1), 0)  # [M] first predicting position = prefix length
    width = int(first.max()) if m else 0  # P
    inverse = None
    if width > 0:
        inside = arange[:, :width] < first[:, None]  # [M, P]
        keyed = torch.where(inside, input_ids[:, :width], -1)  # [M, P]; token ids are >= 0, so lengths tell apart
        _, inverse = torch.unique(keyed, dim=0, return_inverse=True)  # [M] sorted-order id of each row's prefix
        k = int(inverse.max()) + 1
        shared = k * width + m * int((input_lengths - first).max())  # trunk tokens of the shared-prefix forward
        if min_saving is None or shared >= (1 - min_saving) * m * int(input_lengths.max()):
            first, width = torch.zeros_like(first), 0  # the plain forward
    prefix_ids, owner, prefix_rows = None, torch.zeros(m, dtype=torch.int64), torch.zeros(m, 0, dtype=torch.int64)
    prefix_mask = torch.zeros(0, 0, dtype=torch.int64)
    if width > 0:  # each distinct prefix once, in the order rows first name it
        assert inverse is not None
        first_row = torch.full((int(inverse.max()) + 1,), m).scatter_reduce(0, inverse, torch.arange(m), "amin")  # [k]
        order = first_row.argsort()  # [k] sorted id -> first-appearance rank
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(len(order)))  # [k]
        owner = rank[inverse]  # [M]
        heads = first_row[order]  # [k] the first row of each distinct prefix
        # right-padded, so that no query row is fully masked (in float64 that gives NaN, which the pad positions'
        # keys would carry into the suffix); the suffix's attention mask hides the pad keys
        prefix_mask = inside[heads].long()  # [k, P]
        prefix_ids = input_ids[heads, :width] * prefix_mask  # [k, P]
        prefix_rows = prefix_mask[owner]  # [M, P]
    r = int((input_lengths - first).max()) if m else 0  # suffix width R
    positions = first[:, None] + torch.arange(r)[None, :]  # [M, R] source positions of the suffix
    live = positions < input_lengths[:, None]  # [M, R]
    suffix = torch.where(live, input_ids.gather(1, positions.clamp(max=s - 1)), 0)  # [M, R]
    # suffix position j (source position positions[i, j]) predicts token positions[i, j] + 1
    picked = live & (positions < s - 1) & want.gather(1, positions.clamp(max=max(s - 2, 0)))  # [M, R]
    rows, cols = picked.nonzero(as_tuple=True)  # [T] each
    out_cols = positions[rows, cols] + 1  # [T]
    return ForwardPlan(
        shape=(m, s),
        prefix_ids=prefix_ids,
        prefix_mask=prefix_mask,
        owner=owner,
        suffix_ids=suffix,
        attention_mask=torch.cat([prefix_rows, live.long()], 1),
        positions=positions,
        rows=rows,
        cols=cols,
        targets=input_ids[rows, out_cols],
        out_cols=out_cols,
    )


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

    Device: the inputs are host tensors; their :class:`ForwardPlan` is built on the host and copied to the model's
    device once, and everything after (forward, head, output) stays there: no device sync.

    Args:
        model: Hugging Face causal LM with a bias-free linear LM head (see :func:`rl.backends.hf.lm_head.lm_head`).
        input_ids: [M, S] int64, right-padded, on the host.
        input_lengths: [M] int64 unpadded lengths (>= 1), on the host.
        precision: ``auto``, ``bfloat16`` or ``float32`` (see :func:`rl.precision.autocast`).
        temperature: logits are divided by it, matching the sampling distribution of generation.
        token_mask: [M, S] bool on the host, the tokens whose logprobs are wanted (position 0 is never computed);
            None = all.

    Returns:
        [M, S] float32 (float64 for a float64 model) on the model's device: entry t = log p(input_ids[t] |
        input_ids[<t]) in nats where wanted, 0 elsewhere (position 0, padding, tokens outside ``token_mask``).
    """
    from transformers import DynamicCache

    device = device_of(model)
    p = plan_forward(input_ids, input_lengths, token_mask, min_saving=SHARED_PREFIX_MIN_SAVING.get(device.type, 0.0))
    unpadded = p.prefix_ids is None and bool(
        (input_lengths == input_ids.shape[1]).all()
    )  # host: whole rows, no padding
    p = p.to(device)
    cache = None
    if p.prefix_ids is not None:  # encode each distinct prefix once, then give every row its prefix's KV cache
        cache = DynamicCache(config=model.config)
        # right-padded, so causal attention alone keeps every real position off the padding (whose keys the suffix's
        # mask hides); on a device, no padding mask, because transformers' SDPA path reads one on the host to decide
        # whether it may skip it
        mask = None if on_accelerator(device_of(model)) else p.prefix_mask
        hidden_states(model, p.prefix_ids, mask, precision=precision, past_key_values=cache, use_cache=True)
        cache.batch_select_indices(p.owner)
    # a plain forward over unpadded rows needs no mask: causal attention alone (SDPA's flash kernel on CUDA)
    hidden = hidden_states(
        model,
        p.suffix_ids,
        None if unpadded else p.attention_mask,
        precision=precision,
        position_ids=p.positions,
        past_key_values=cache,
        use_cache=cache is not None,
    )  # [M, R, H]
    lp = lm_head(model, precision).token_logprobs(hidden[p.rows, p.cols], p.targets, temperature)  # [T]
    return lp.new_zeros(p.shape).index_put((p.rows, p.out_cols), lp)  # [M, S]


def batched_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    batch_size: int | None,
    precision: str,
    temperature: float = 1.0,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """:func:`forward_logprobs` over micro-batches of consecutive rows, at most ``batch_size`` rows (None: no cap) and
    ``max_tokens`` padded tokens (None: no budget) each (`rl.backends.micro_batch.micro_batch_slices`), without
    gradients.

    Args:
        token_mask: [N, S] bool, True on response tokens: the only tokens whose logprobs are computed.

    Returns:
        [N, S] float32 on the host, 0 outside ``token_mask``: computed into one device buffer, copied back once.
    """

    out = torch.zeros(input_ids.shape, dtype=torch.float32, device=device_of(model))  # [N, S]
    with torch.no_grad(), autocast(model, precision):  # one block: weights are cast once (when they require grad)
        # consecutive rows: a rollout's groups stay together and share their prompt
        for rows in micro_batch_slices(input_lengths, max_rows=batch_size, max_tokens=max_tokens):
            width = int(input_lengths[rows].max())
            out[rows, :width] = forward_logprobs(
                model,
                input_ids[rows, :width],
                input_lengths[rows],
                precision=precision,
                temperature=temperature,
                token_mask=token_mask[rows, :width],
            ).to(out.dtype)
    return out.cpu()
