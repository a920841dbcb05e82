"""The GRPO update, written once for every policy back-end (verl's ``workers/engine`` split).

`TrainEngine.train_batch` owns the loop: a step's batch into optimizer updates, each update into micro-batches
(`rl.backends.micro_batch`: consecutive rows under a row cap and a padded-token budget), the global token and sequence
counts reduced over the data-parallel ranks, the shared loss of each micro-batch (`micro_batch_loss`, `rl.loss`),
metric sums kept on the device, gradient clipping, the AdamW step (`make_optimizer`) and one device -> host copy of
the step's metrics. A back-end (:class:`TrainEngine`) supplies only what differs: the forward and backward of a list of
micro-batches (transformers: our shared-prompt forward; Megatron-core: its pipeline schedule), its parameters, and
its gradient reduction and norm.

Reproducibility and speed switches of the update live here too: torch's deterministic algorithms
(`update_settings`, ``optim.deterministic``) and TF32 matmuls (``model.tf32``).
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.deterministic as det

from dataplane import fields as F
from dataplane.fields import LOSS_FIELDS  # noqa: F401 (re-exported: the fields the loss reads)
from rl import distributed
from rl.backends.micro_batch import micro_batch_limits, micro_batch_slices
from rl.config import GRPOConfig
from rl.filters import seq_mult_prob_error
from rl.loss import (
    LossInputs,
    accumulate,
    accumulate_on_device,
    clipped_pg_loss_with,
    loss_mask,
    per_sequence_metrics,
)


# --------------------------------------------------------------------------------------------------- the optimizer
def make_optimizer(params: Any, cfg: GRPOConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (betas 0.9/0.999, eps 1e-8; fused into one kernel per parameter group on CUDA, torch's ``fused=True``)
    and a linear warmup from lr/10 to lr over ``warmup_steps``, then constant (NeMo-RL grpo_math_1B's LinearLR warmup
    + ConstantLR).

    Args:
        params: the parameters to train (a module's ``parameters()`` or a list); a module is accepted too. Those
            that do not require grad (a LoRA policy's frozen base) are left out: they get no AdamW state.
    """
    params = [p for p in (params.parameters() if isinstance(params, torch.nn.Module) else params) if p.requires_grad]
    fused = bool(params) and all(
        p.device.type == "cuda" and p.dtype in (torch.float32, torch.bfloat16, torch.float16) for p in params
    )
    opt = torch.optim.AdamW(
        params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, betas=(0.9, 0.999), eps=1e-8, fused=fused or None
    )
    warm = cfg.optim.warmup_steps

    def factor(step: int) -> float:
        return 1.0 if warm == 0 or step >= warm else 0.1 + 0.9 * step / warm

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ---------------------------------------------------------------------------------------------------- the loss
LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], "MicroBatchLoss"]


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss and what the step reports of it, all on the device.

    Attributes:
        loss: 0-dim, with grad: this micro-batch's share of the update's globally normalized loss.
        sums: metric sums (0-dim each; `rl.loss.clipped_pg_loss`), detached.
        errors: [m] float, each row's ``seq_mult_prob_error`` (`rl.filters`), detached.
    """

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    errors: torch.Tensor


def micro_batch_loss(
    logprobs: torch.Tensor,
    fields: Mapping[str, torch.Tensor],
    cfg: GRPOConfig,
    *,
    global_toks: float,
    global_seqs: float,
) -> MicroBatchLoss:
    """The GRPO loss of one micro-batch (`rl.loss.clipped_pg_loss_with`, NeMo-RL's ClippedPGLossFn) on its device.

    Args:
        logprobs: [m, S] float32, the current policy's logprobs, token-aligned (entry t is log p(token t | < t)),
            with grad.
        fields: on the same device, token-aligned: ``reference_policy_logprobs``, ``generation_logprobs``,
            ``advantages`` [m, S] float, ``token_mask`` [m, S] bool, ``sample_mask`` [m] bool, and
            ``prev_logprobs`` [m, S] (absent: pi_old is the detached current forward, one on-policy update).
        global_toks, global_seqs: the whole update's valid tokens and sequences, over every rank (>= 1).
    """
    prev = fields[F.PREV_LOGPROBS] if F.PREV_LOGPROBS in fields else logprobs.detach()
    inputs = LossInputs(
        logprobs=logprobs,
        prev_logprobs=prev,
        reference_policy_logprobs=fields[F.REFERENCE_POLICY_LOGPROBS],
        generation_logprobs=fields[F.GENERATION_LOGPROBS],
        advantages=fields[F.ADVANTAGES],
        token_mask=fields[F.TOKEN_MASK],
        sample_mask=fields[F.SAMPLE_MASK],
    )
    loss, sums = clipped_pg_loss_with(
        inputs,
        cfg.loss,
        global_valid_toks=global_toks,
        global_valid_seqs=global_seqs,
        max_response_tokens=cfg.generation.max_new_tokens,
    )
    errors = seq_mult_prob_error(fields[F.GENERATION_LOGPROBS], prev, fields[F.TOKEN_MASK])  # [m]
    return MicroBatchLoss(loss=loss, sums={k: v.detach() for k, v in sums.items()}, errors=errors.detach())


# ------------------------------------------------------------------------------------------------- the back-end
class TrainEngine(abc.ABC):
    """What a policy back-end gives the shared update: the forward and backward of micro-batches, its parameters,
    and its gradient reduction and clipping. The optimizer and scheduler are :func:`make_optimizer`'s."""

    device: torch.device

    @abc.abstractmethod
    def forward_backward(
        self, rows: Any, slices: Sequence[slice], loss_fn: LossFn
    ) -> list[tuple[slice, MicroBatchLoss]]:
        """Forward and backward of ``rows[s]`` for each micro-batch slice ``s`` (host ``TensorDict`` rows), calling
        ``loss_fn(logprobs, fields)`` on each and back-propagating its loss. Returns the (slice, loss) pairs this rank
        reports (:meth:`reports`), in order."""

    @abc.abstractmethod
    def finish_gradients(self, max_norm: float) -> torch.Tensor:
        """After an update's last micro-batch: sum the gradients over the replicas (and whatever else the back-end
        splits), clip them to ``max_norm`` (inf: no clipping) by the global norm, and return the norm before clipping
        (0-dim float, on the device or the host)."""

    def micro_batches(self, rows: Any, cfg: GRPOConfig) -> list[slice]:
        """The update's micro-batches (`rl.backends.micro_batch`: ``micro_batch_slices`` with
        ``micro_batch_limits``)."""
        max_rows, max_tokens = self.limits(cfg)
        return micro_batch_slices(rows[F.INPUT_LENGTHS], max_rows=max_rows, max_tokens=max_tokens)

    def limits(self, cfg: GRPOConfig) -> tuple[int | None, int | None]:
        return micro_batch_limits(cfg, self.model_config, self.device, train=True)

    @property
    @abc.abstractmethod
    def model_config(self) -> Any:
        """The model's Hugging Face config (hidden size, layers, vocabulary: the memory estimate reads them)."""

    def reports(self) -> bool:
        """Whether this rank holds whole logprobs and reports metrics (every rank without model parallelism)."""
        return True

    def reports_rows(self) -> bool:
        """Whether this reporting rank also reports the per-row metrics (sequence errors, masked rows): one rank per
        row (the first context-parallel rank where sequences are split)."""
        return self.reports()

    def count_group(self) -> Any:
        """The process group over which the update's token and sequence counts are summed (None: all ranks)."""
        return None

    def compute(self) -> contextlib.AbstractContextManager:
        """A block around an update's micro-batches (autocast, ...)."""
        return contextlib.nullcontext()

    def train_mode(self, on: bool) -> None:
        """Switch the model(s) to training (``on``) or evaluation mode."""

    def train_batch(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        batch: Mapping[str, torch.Tensor],
        cfg: GRPOConfig,
        *,
        update_sizes: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """Train on one step's batch: one optimizer update per entry of ``update_sizes``, each accumulated over the
        engine's micro-batches; under data parallelism (``rl.distributed``) on this rank's shard. The template method
        of every back-end's update (verl's ``BaseEngine.train_batch``): a back-end overrides the steps it calls.

        Each update's loss is normalized by the token and sequence counts of the whole global update, summed over the
        ranks (``rl.loss.clipped_pg_loss``; verl's ``agg_loss`` with ``dp_size``), and the ranks' gradients are summed
        (:meth:`finish_gradients`) before clipping: N ranks make the update one rank makes on the concatenated shards,
        up to the order of float sums.

        Args:
            batch: padded host tensors (n rows, width S), a ``tensordict.TensorDict`` with ``batch_size=[n]`` (a plain
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
            ValueError: ``update_sizes`` do not add up to the batch's rows, or several updates without
                ``prev_logprobs``.
        """

        td, update_sizes = step_batch(batch, cfg, update_sizes)
        device = self.device
        totals: dict[str, torch.Tensor] = {}  # metric sums, float64 on the device: read once, after the last update
        losses, norms, seq_errors = [], [], []  # per update / per micro-batch, on the device
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        responding = td[F.TOKEN_MASK].bool().any(1)  # [n] host: a sample without response tokens has no sequence error
        counted = (
            torch.stack([torch.as_tensor(batch[F.SAMPLE_MASK]).bool(), td[F.SAMPLE_MASK].bool()]) & responding
        )  # [2, n]: before, after the error mask
        starts = [sum(update_sizes[:u]) for u in range(len(update_sizes))]
        with update_settings(cfg, device):
            self.train_mode(True)
            for start, rows in zip(starts, td.split(list(update_sizes))):
                mask = loss_mask(rows[F.TOKEN_MASK], rows[F.SAMPLE_MASK])  # host: the counts need no device sync
                counts = distributed.all_reduce(
                    torch.stack([mask.sum().double(), rows[F.SAMPLE_MASK].double().sum()]), group=self.count_group()
                )  # [2]
                global_toks, global_seqs = float(counts[0].clamp(min=1)), float(counts[1].clamp(min=1))

                def loss_fn(
                    logprobs: torch.Tensor,
                    fields: Mapping[str, torch.Tensor],
                    toks: float = global_toks,
                    seqs: float = global_seqs,
                ) -> MicroBatchLoss:
                    return micro_batch_loss(logprobs, fields, cfg, global_toks=toks, global_seqs=seqs)

                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), dtype=torch.float64, device=device)
                if rows.batch_size[0]:
                    with self.compute():  # autocast: weights are cast to bf16 once per update, not per micro-batch
                        for where, out in self.forward_backward(rows, self.micro_batches(rows, cfg), loss_fn):
                            seq_errors.append(
                                (out.errors, counted[:, start + where.start : start + where.stop])
                            )  # the masks stay on the host
                            step_loss = step_loss + out.loss.detach().double()
                            accumulate_on_device(totals, out.sums)
                norms.append(self.finish_gradients(max_norm))
                optimizer.step()
                scheduler.step()
                losses.append(step_loss)
            self.train_mode(False)
        optimizer.zero_grad(set_to_none=True)
        sums, losses_, norms_, errors = read_step(
            totals, losses, norms, seq_errors, device
        )  # the step's one device -> host copy
        masked = int(
            (torch.as_tensor(batch[F.SAMPLE_MASK]).bool() & ~td[F.SAMPLE_MASK].bool()).sum()
        )  # by the error threshold
        if not self.reports_rows():
            errors, masked = (errors[0][:0], errors[1][:0]), 0
        local = (sums, losses_, errors, masked) if self.reports() else None
        parts = [p for p in distributed.gather_objects(local) if p is not None]
        metrics = combine_step_metrics(
            parts, masking=cfg.loss.seq_logprob_error_threshold is not None, per_sequence=per_sequence_metrics(cfg.loss)
        )
        metrics.update(grad_norm=sum(norms_) / len(norms_), lr=float(scheduler.get_last_lr()[0]))
        return metrics


# -------------------------------------------------------------------------------------------------- the settings
def resolve_deterministic(cfg: GRPOConfig, device: torch.device | str) -> bool:
    """``optim.deterministic``, a null resolved from the device: True on the CPU (measured free there,
    ``bench/reproducible_update.py``), False on CUDA (see ``docs/gpu.md``)."""
    setting = cfg.optim.deterministic
    return torch.device(device).type == "cpu" if setting is None else bool(setting)


@contextlib.contextmanager
def update_settings(cfg: GRPOConfig, device: torch.device | str) -> Iterator[None]:
    """The process-wide torch settings of an update, restored on exit.

    Deterministic (:func:`resolve_deterministic`): torch's deterministic algorithms, so that an update is the same
    bit for bit at any thread count. On a CPU with more than one thread, ``index_put_(accumulate=True)`` on 32,768 or
    more elements (the backward of ``x[idx]`` with repeated indices: the prefix KV-cache select, ``weight[targets]``
    in the LM head) adds with unordered atomics, so two identical runs of the default job ended ~1 ulp apart after a
    few steps; deterministic mode makes that kernel serial. Uninitialized memory is not filled (nothing reads it).
    On CUDA it also needs ``CUBLAS_WORKSPACE_CONFIG`` before cuBLAS starts (set here if unset: effective in a fresh
    process); ``warn_only``: a kernel without a deterministic version warns instead of raising.

    TF32 (``model.tf32``, CUDA only, and not in deterministic mode): float32 matmuls and convolutions on TF32 tensor
    cores (``torch.backends.cuda.matmul.allow_tf32``), 10-bit mantissa inputs with float32 accumulation.
    """

    deterministic = resolve_deterministic(cfg, device)
    cuda = torch.device(device).type == "cuda"
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    if deterministic:
        if cuda:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = False
    if cuda and cfg.model.tf32 and not deterministic:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before[3], before[4]


# ---------------------------------------------------------------------------------------------------- the loop
def step_batch(
    batch: Mapping[str, torch.Tensor], cfg: GRPOConfig, update_sizes: Sequence[int] | None
) -> tuple[Any, list[int]]:
    """A step's batch ready for its updates: a ``TensorDict`` copy of ``batch`` whose ``sample_mask`` also masks the
    sequences over ``loss.seq_logprob_error_threshold`` (NeMo-RL grpo_sync), and the rows of each update
    (``optim.train_global_batch_size`` rows each when ``update_sizes`` is None).

    Raises:
        ValueError: ``update_sizes`` do not add up to the batch's rows, or several updates without ``prev_logprobs``.
    """
    from tensordict import TensorDict

    td = batch if isinstance(batch, TensorDict) else TensorDict(dict(batch), batch_size=[batch[F.INPUT_IDS].shape[0]])
    td = td.clone(recurse=False)  # sample_mask may be replaced below: not in the caller's batch
    n = int(td.batch_size[0])
    if update_sizes is None:
        gbs = max(min(cfg.optim.train_global_batch_size or n, n), 1)
        update_sizes = [min(gbs, n - g0) for g0 in range(0, n, gbs)] or [0]
    if sum(update_sizes) != n:
        msg = f"update_sizes {list(update_sizes)} add up to {sum(update_sizes)} rows, but the batch has {n}"
        raise ValueError(msg)
    if F.PREV_LOGPROBS not in td.keys() and len(update_sizes) != 1:
        msg = "prev_logprobs are missing but the step makes several optimizer updates; compute them (policy_logprobs)"
        raise ValueError(msg)
    threshold = cfg.loss.seq_logprob_error_threshold
    if threshold is not None:  # mask sequences whose generation logprobs disagree with pi_old (NeMo-RL grpo_sync)
        err = seq_mult_prob_error(td[F.GENERATION_LOGPROBS], td[F.PREV_LOGPROBS], td[F.TOKEN_MASK])  # [n]
        td[F.SAMPLE_MASK] = td[F.SAMPLE_MASK].bool() & (err <= threshold)
    return td, list(update_sizes)


def read_step(
    totals: dict[str, torch.Tensor],
    losses: list[torch.Tensor],
    norms: list[torch.Tensor],
    seq_errors: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> tuple[dict[str, float], list[float], list[float], tuple[torch.Tensor, torch.Tensor]]:
    """A step's device-side metrics on the host, in one copy: metric sums, the loss and gradient norm of each update,
    and the sequence errors of the samples that count before and after the error mask (``seq_errors``: per
    micro-batch, [m] errors on the device and the [2, m] host masks of the rows to count)."""
    scalars = [
        *totals.values(),
        *(x.to(device) for x in losses),
        *(torch.as_tensor(x).double().reshape(()).to(device) for x in norms),
    ]
    errors = (
        torch.cat([e.double() for e, _ in seq_errors])
        if seq_errors
        else torch.zeros(0, dtype=torch.float64, device=device)
    )
    counted = torch.cat([m for _, m in seq_errors], 1) if seq_errors else torch.zeros(2, 0, dtype=torch.bool)  # [2, n]
    flat = torch.cat([torch.stack(scalars).to(errors.device), errors]).cpu().tolist() if scalars else []
    k, u = len(totals), len(losses)
    sums = dict(zip(totals, flat[:k]))
    host_errors = torch.tensor(flat[k + 2 * u :], dtype=torch.float64)
    return (
        sums,
        flat[k : k + u],
        flat[k + u : k + 2 * u],
        (host_errors[counted[0]].float(), host_errors[counted[1]].float()),
    )


def combine_step_metrics(
    ranks: list[tuple[dict[str, float], list[float], tuple[torch.Tensor, torch.Tensor], int]],
    *,
    masking: bool,
    per_sequence: frozenset[str] = frozenset(),
) -> dict[str, float]:
    """The step's metrics from every reporting rank's ``(metric sums, loss per update, sequence errors before and after
    the error mask, rows masked by it)``, in rank order: sums over all ranks' tokens divided by the global valid tokens
    (those in ``per_sequence`` by the valid sequences), never a mean of rank means.

    The sequence errors (NeMo-RL ``compute_and_apply_seq_logprob_error_masking``) are over valid samples with at least
    one response token: ``{max,mean,min}_seq_mult_prob_error`` before ``loss.seq_logprob_error_threshold`` masks any,
    and, when it is set, the same ``_after_mask`` and ``num_masked_seqs_by_logprob_error``."""
    totals: dict[str, float] = {}
    for part, *_ in ranks:
        accumulate(totals, part)
    losses = [sum(r[1][g] for r in ranks) for g in range(len(ranks[0][1]))]  # each update's loss: globally normalized
    toks = max(totals.pop("valid_toks", 0.0), 1.0)
    seqs = max(totals.pop("valid_seqs", 0.0), 1.0)
    metrics = {
        k: v / (seqs if k in per_sequence else toks) for k, v in totals.items() if not k.endswith(("_max", "_min"))
    }
    metrics.update(
        {k: v if math.isfinite(v) else math.nan for k, v in totals.items() if k.endswith(("_max", "_min"))}
    )  # no valid token: nan
    for i, suffix in enumerate(("", "_after_mask") if masking else ("",)):
        errors = torch.cat([r[2][i] for r in ranks])
        errors = errors if errors.numel() else torch.ones(1)
        metrics.update(
            {
                f"max_seq_mult_prob_error{suffix}": float(errors.max()),
                f"mean_seq_mult_prob_error{suffix}": float(errors.mean()),
                f"min_seq_mult_prob_error{suffix}": float(errors.min()),
            }
        )
    if masking:
        metrics["num_masked_seqs_by_logprob_error"] = float(sum(r[3] for r in ranks))
    metrics.update(loss=sum(losses) / len(losses), global_valid_toks=toks)
    return metrics
