"""One GRPO optimizer update: micro-batched forward/backward of the clipped PG loss, gradient
clipping, AdamW step with warmup. Owns the optimizer; the loss maths is `rl.loss`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rl.config import GRPOConfig
from rl.backends.hf.logprobs import forward_logprobs
from rl.filters import seq_mult_prob_error
from rl.loss import LossInputs, accumulate, accumulate_on_device, clipped_pg_loss_with, loss_mask
from rl.precision import autocast, device_of, on_accelerator, to_device


def make_optimizer(model: torch.nn.Module, cfg: GRPOConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (betas 0.9/0.999, eps 1e-8) and a linear warmup from lr/10 to lr over ``warmup_steps``, then constant
    (NeMo-RL grpo_math_1B's LinearLR warmup + ConstantLR)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.999), eps=1e-8)
    warm = cfg.optim.warmup_steps

    def factor(step: int) -> float:
        return 1.0 if warm == 0 or step >= warm else 0.1 + 0.9 * step / warm

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


_LOSS_FIELDS = ("prev_logprobs", "reference_policy_logprobs", "generation_logprobs", "advantages", "token_mask", "sample_mask")
"""The fields of a micro-batch that the loss reads on the device (the forward reads ``input_ids`` through its plan)."""


def _micro_batch_loss(
    model: torch.nn.Module, cut: Any, cfg: GRPOConfig, *, global_toks: float, global_seqs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Forward one host micro-batch ``cut`` on the model's device; returns (loss with grad, detached metric sums, [m]
    sequence errors), all on the device. The loss fields are copied there once (`rl.precision.to_device`)."""
    device = device_of(model)
    logprobs = forward_logprobs(
        model,
        cut["input_ids"],
        cut["input_lengths"],
        precision=cfg.model.precision,
        temperature=cfg.generation.temperature,
        token_mask=cut["token_mask"],
    )  # [m, S] on the device
    on = {k: to_device(cut[k], device) for k in _LOSS_FIELDS if k in cut.keys()}
    prev = on["prev_logprobs"] if "prev_logprobs" in on else logprobs.detach()  # [m, S]
    inputs = LossInputs(
        logprobs=logprobs,
        prev_logprobs=prev,
        reference_policy_logprobs=on["reference_policy_logprobs"],
        generation_logprobs=on["generation_logprobs"],
        advantages=on["advantages"],
        token_mask=on["token_mask"],
        sample_mask=on["sample_mask"],
    )
    loss, sums = clipped_pg_loss_with(inputs, cfg.loss, global_valid_toks=global_toks, global_valid_seqs=global_seqs)
    errors = seq_mult_prob_error(on["generation_logprobs"], prev, on["token_mask"])  # [m]
    return loss, sums, errors


class _EmbeddingRows(torch.autograd.Function):
    """``weight[ids]`` whose backward adds the gradient rows into ``weight.grad`` in place (index_add_) instead of
    returning a dense [V, H] gradient: that one is allocated, zero-filled and added per forward call (49152 x 576
    float32 = 113 MB for SmolLM2: ~0.2 s each, 3.3 s of a step with two calls per micro-batch)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return weight[ids]

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        w, ids = ctx.weight, ids.reshape(-1)
        rows = grad.reshape(-1, w.shape[1])
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        w.grad.index_add_(0, ids, rows.to(w.grad.dtype))
        return None, None, None


@contextlib.contextmanager
def _embedding_grads_by_row(model: torch.nn.Module) -> Iterator[None]:
    """Inside this block the input embedding accumulates its gradient row by row (:class:`_EmbeddingRows`), on the CPU.
    On a GPU torch's own backward is kept: allocating the dense gradient is cheap there, and its sort-based kernel is
    deterministic where ``index_add_``'s atomics are not."""
    emb = model.get_input_embeddings()
    if type(emb) is not torch.nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or on_accelerator(emb.weight.device):
        yield  # an embedding with its own semantics keeps torch's backward
        return
    emb.forward = lambda ids: _EmbeddingRows.apply(ids, emb.weight, emb.padding_idx)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del emb.forward


@contextlib.contextmanager
def _reproducible_accumulation(device: torch.device | str = "cpu") -> Iterator[None]:
    """Run a CPU update with torch's deterministic algorithms, so that it is the same bit for bit at any thread count.

    On CPU with more than one thread, ``index_put_(accumulate=True)`` on 32,768 or more elements (the backward of
    ``x[idx]`` with repeated indices: the prefix KV-cache select of ``forward_logprobs``, ``weight[targets]`` in
    the LM head) adds with unordered atomics, so two identical runs of the default job ended ~1 ulp apart after a
    few steps. Deterministic mode makes that kernel serial. Uninitialized memory is not filled (a cost that buys
    nothing here: nothing reads it). Both settings are process-wide and restored on exit.

    On a GPU the block changes nothing: CUDA's deterministic kernels (and cuBLAS's ``CUBLAS_WORKSPACE_CONFIG``) are a
    speed trade-off not measured yet, and with ``warn_only`` every non-deterministic kernel would only warn.
    """
    import torch.utils.deterministic as det

    if on_accelerator(device):
        yield
        return

    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


def step_batch(batch: Mapping[str, torch.Tensor], cfg: GRPOConfig, update_sizes: Sequence[int] | None) -> tuple[Any, list[int]]:
    """A step's batch ready for its updates (every policy back-end's ``train`` starts here): a ``TensorDict`` copy of
    ``batch`` whose ``sample_mask`` also masks the sequences over ``loss.seq_logprob_error_threshold`` (NeMo-RL
    grpo_sync), and the rows of each update (``optim.train_global_batch_size`` rows each when ``update_sizes`` is None).

    Raises:
        ValueError: ``update_sizes`` do not add up to the batch's rows, or several updates without ``prev_logprobs``.
    """
    from tensordict import TensorDict

    td = batch if isinstance(batch, TensorDict) else TensorDict(dict(batch), batch_size=[batch["input_ids"].shape[0]])
    td = td.clone(recurse=False)  # sample_mask may be replaced below: not in the caller's batch
    n = int(td.batch_size[0])
    if update_sizes is None:
        gbs = max(min(cfg.optim.train_global_batch_size or n, n), 1)
        update_sizes = [min(gbs, n - g0) for g0 in range(0, n, gbs)] or [0]
    if sum(update_sizes) != n:
        msg = f"update_sizes {list(update_sizes)} add up to {sum(update_sizes)} rows, but the batch has {n}"
        raise ValueError(msg)
    if "prev_logprobs" not in td.keys() and len(update_sizes) != 1:
        msg = "prev_logprobs are missing but the step makes several optimizer updates; compute them (policy_logprobs)"
        raise ValueError(msg)
    threshold = cfg.loss.seq_logprob_error_threshold
    if threshold is not None:  # mask sequences whose generation logprobs disagree with pi_old (NeMo-RL grpo_sync)
        err = seq_mult_prob_error(td["generation_logprobs"], td["prev_logprobs"], td["token_mask"])  # [n]
        td["sample_mask"] = td["sample_mask"].bool() & (err <= threshold)
    return td, list(update_sizes)


def train_on_batch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    batch: Mapping[str, torch.Tensor],
    cfg: GRPOConfig,
    *,
    update_sizes: Sequence[int] | None = None,
) -> dict[str, float]:
    """Train on one step's batch: one optimizer update per entry of ``update_sizes``, each accumulated over
    micro-batches of ``train_micro_batch_size``; under data parallelism (``rl.distributed``) on this rank's shard.

    Each update's loss is normalized by the token and sequence counts of the whole global update, summed over the
    ranks (``rl.loss.clipped_pg_loss``; verl's ``agg_loss`` with ``dp_size``), and the ranks' gradients are summed
    (:func:`rl.distributed.all_reduce_gradients`) before clipping: N ranks make the update one rank makes on the
    concatenated shards, up to the order of float sums.

    Args:
        batch: padded tensors (n rows, width S), a ``tensordict.TensorDict`` with ``batch_size=[n]`` (a plain
            mapping is wrapped): ``input_ids`` [n, S] int64, ``input_lengths`` [n] int64, ``generation_logprobs``,
            ``prev_logprobs``, ``reference_policy_logprobs``, ``advantages`` [n, S] float32, ``token_mask`` [n, S]
            bool, ``sample_mask`` [n] bool. Without ``prev_logprobs`` the step must make one update (on-policy) and
            pi_old is the detached current forward.
        update_sizes: consecutive rows of ``batch`` per update (this rank's part of each global update, possibly
            0); None: ``optim.train_global_batch_size`` rows per update.

    Returns:
        metrics over the whole step, the same on every rank: ``loss`` (mean over updates of the globally
        normalized loss), ``grad_norm``, per-token means such as ``probs_ratio``, ``global_valid_toks``, ...

    Raises:
        ValueError: ``update_sizes`` do not add up to the batch's rows, or several updates without ``prev_logprobs``.
    """
    from rl import distributed

    td, update_sizes = step_batch(batch, cfg, update_sizes)
    n = int(td.batch_size[0])
    mbs = cfg.optim.train_micro_batch_size
    device = device_of(model)
    totals: dict[str, torch.Tensor] = {}  # metric sums, float64 on the device: read once, after the last update
    losses, norms, seq_errors = [], [], []  # per update / per micro-batch, on the device
    threshold = cfg.loss.seq_logprob_error_threshold
    with _reproducible_accumulation(device):  # bit-for-bit the same update at any thread count
        model.train()
        for rows in td.split(list(update_sizes)):
            mask = loss_mask(rows["token_mask"], rows["sample_mask"])  # host: the counts need no device sync
            counts = distributed.all_reduce(torch.stack([mask.sum().double(), rows["sample_mask"].double().sum()]))  # [2]
            global_toks, global_seqs = float(counts[0].clamp(min=1)), float(counts[1].clamp(min=1))
            optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), dtype=torch.float64, device=device)
            # micro-batches in row order: a rollout's groups stay together and share their prompt's forward (within a
            # rank's shard: token-balanced sharding spreads a group over the ranks)
            # (rl.backends.hf.logprobs.forward_logprobs); the global normalization makes the split irrelevant to the update
            # autocast: weights are cast to bf16 once per update, not per micro-batch
            with autocast(model, cfg.model.precision), _embedding_grads_by_row(model):
                for mb in rows.split(mbs) if rows.batch_size[0] else ():
                    width = int(mb["input_lengths"].max())
                    cut = mb.apply(lambda v: v[:, :width] if v.dim() == 2 else v)  # noqa: B023 (host; the loss copies its fields)
                    loss, sums, errors = _micro_batch_loss(model, cut, cfg, global_toks=global_toks, global_seqs=global_seqs)
                    loss.backward()
                    seq_errors.append((errors, cut["sample_mask"]))  # the mask stays on the host
                    step_loss = step_loss + loss.detach().double()
                    accumulate_on_device(totals, sums)
            distributed.all_reduce_gradients(model.parameters())  # sum over ranks: the whole update's gradient
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).to(device))  # a host 0 without gradients
            optimizer.step()
            scheduler.step()
            losses.append(step_loss)
        model.eval()
    optimizer.zero_grad(set_to_none=True)
    sums_, losses_, norms_, errors = _read_step(totals, losses, norms, seq_errors)  # the step's one device -> host copy
    local = (sums_, losses_, errors, n - int(td["sample_mask"].bool().sum()))
    metrics = combine_step_metrics(distributed.gather_objects(local), masking=threshold is not None)
    metrics.update(grad_norm=sum(norms_) / len(norms_), lr=float(scheduler.get_last_lr()[0]))
    return metrics


def _read_step(
    totals: dict[str, torch.Tensor], losses: list[torch.Tensor], norms: list[torch.Tensor], seq_errors: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[dict[str, float], list[float], list[float], torch.Tensor]:
    """A step's device-side metrics on the host, in one copy: metric sums, the loss and gradient norm of each update,
    and the [valid n] sequence errors of the samples that count (``seq_errors``: per micro-batch, [m] errors on the
    device and the [m] host sample mask)."""
    scalars = [*totals.values(), *losses, *(x.double().reshape(()) for x in norms)]
    errors = torch.cat([e.double() for e, _ in seq_errors]) if seq_errors else torch.zeros(0, dtype=torch.float64)
    valid = torch.cat([m.bool() for _, m in seq_errors]) if seq_errors else torch.zeros(0, dtype=torch.bool)
    flat = torch.cat([torch.stack(scalars).to(errors.device), errors]).cpu().tolist() if scalars else []
    k, u = len(totals), len(losses)
    sums = dict(zip(totals, flat[:k]))
    host_errors = torch.tensor(flat[k + 2 * u :], dtype=torch.float64)[valid]
    return sums, flat[k : k + u], flat[k + u : k + 2 * u], host_errors.float()


def combine_step_metrics(ranks: list[tuple[dict[str, float], list[float], torch.Tensor, int]], *, masking: bool) -> dict[str, float]:
    """The step's metrics from every rank's ``(metric sums, loss per update, [valid n] sequence errors, masked rows)``,
    in rank order: sums over all ranks' tokens divided by the global valid tokens, never a mean of rank means."""
    totals: dict[str, float] = {}
    for part, *_ in ranks:
        accumulate(totals, part)
    losses = [sum(r[1][g] for r in ranks) for g in range(len(ranks[0][1]))]  # each update's loss: globally normalized
    errors = torch.cat([r[2] for r in ranks])
    errors = errors if errors.numel() else torch.ones(1)
    toks = max(totals.pop("valid_toks", 0.0), 1.0)
    metrics = {k: v / toks for k, v in totals.items() if not k.endswith(("_max", "_min"))}
    metrics.update({k: v if math.isfinite(v) else math.nan for k, v in totals.items() if k.endswith(("_max", "_min"))})  # no valid token: nan
    metrics.update(
        max_seq_mult_prob_error=float(errors.max()),
        mean_seq_mult_prob_error=float(errors.mean()),
        min_seq_mult_prob_error=float(errors.min()),
        num_masked_by_seq_logprob_error=float(sum(r[3] for r in ranks)) if masking else 0.0,
        loss=sum(losses) / len(losses),
        global_valid_toks=toks,
    )
    return metrics

