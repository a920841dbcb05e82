"""The Megatron-core back-end's side of the GRPO update (`rl.backends.engine`): its micro-batches through
megatron-core's pipeline schedule (`rl.backends.megatron.policy.MegatronPolicy.run_micro_batches`), the shared loss on
the last stage on this context-parallel rank's positions, and its gradient reduction and clipping over the data-,
context-, pipeline- and tensor-parallel groups. The loop, the loss and the optimizer are the engine's, shared with the
transformers back-end (`rl.backends.hf.train`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dataplane import fields as F
from rl import distributed
from rl.backends.engine import LossFn, MicroBatchLoss, TrainEngine
from rl.config import GRPOConfig
from rl.filters import seq_mult_prob_error

if TYPE_CHECKING:
    from rl.backends.megatron.policy import MegatronPolicy


class MegatronTrainEngine(TrainEngine):
    """:class:`rl.backends.megatron.policy.MegatronPolicy` as a :class:`rl.backends.engine.TrainEngine`: megatron-core's
    schedule runs the micro-batches; counts are summed over the data-parallel group; the last pipeline stage's first
    tensor-parallel rank reports the metrics, its first context-parallel rank the per-row ones."""

    def __init__(self, policy: MegatronPolicy) -> None:
        self.policy = policy
        self.device = policy.device

    @property
    def model_config(self) -> Any:
        return self.policy.hf_config

    def micro_batches(self, rows: Any, cfg: GRPOConfig) -> list[slice]:
        return self.policy.micro_batches(rows, None, train=True)

    def forward_backward(
        self, rows: Any, slices: Sequence[slice], loss_fn: LossFn
    ) -> list[tuple[slice, MicroBatchLoss]]:
        """The micro-batches through megatron-core's schedule, the shared loss on the last stage on this
        context-parallel rank's positions. A zero column in front makes the prediction-aligned fields (the policy's
        micro-batches: entry p belongs to the token at p + 1) the token-aligned [m, 1 + s] tensors the loss expects
        (it drops position 0). Under context parallelism each row's sequence error is computed from its whole row."""
        from megatron.core import parallel_state

        policy = self.policy

        def aligned(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x.new_zeros(x.shape[0], 1), x], 1)  # [m, 1 + s]

        def on_logits(logits: torch.Tensor, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
            lp = policy.token_logprobs(logits, mb)  # [m, s]
            fields = {
                k: aligned(mb[k].float())
                for k in (F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS, F.GENERATION_LOGPROBS, F.ADVANTAGES)
                if k in mb
            }
            fields[F.TOKEN_MASK] = aligned(mb[F.TOKEN_MASK]).bool()
            fields[F.SAMPLE_MASK] = mb[F.SAMPLE_MASK]
            result = loss_fn(aligned(lp), fields)
            return result.loss, {"result": result, "logprobs": lp.detach()}

        outs = policy.run_micro_batches(policy.model, rows, slices, on_logits, forward_only=False)
        if not outs:
            return []
        pairs = [(where, o["result"]) for where, o in zip(slices, outs, strict=True)]
        if parallel_state.get_context_parallel_world_size() > 1:  # each rank saw part of every row: whole-row errors
            prev = (
                rows[F.PREV_LOGPROBS]
                if F.PREV_LOGPROBS in rows.keys()
                else policy.assemble_logprobs(rows, [o["logprobs"] for o in outs])
            )
            errors = seq_mult_prob_error(rows[F.GENERATION_LOGPROBS], prev, rows[F.TOKEN_MASK]).to(self.device)  # [n]
            pairs = [(w, MicroBatchLoss(loss=r.loss, sums=r.sums, errors=errors[w])) for w, r in pairs]
        n = [w.stop - w.start for w, _ in pairs]
        return [
            (w, MicroBatchLoss(loss=r.loss, sums=r.sums, errors=r.errors[:k]))
            for (w, r), k in zip(pairs, n, strict=True)
        ]  # padding rows out

    def finish_gradients(self, max_norm: float) -> torch.Tensor:
        """After an update's last micro-batch: sum the gradients over the replicas and context-parallel ranks, the tied
        embedding's over the first and last stages, sequence-parallel layernorms' over the tensor-parallel ranks; clip
        to ``max_norm`` (inf: no clipping) by the model-parallel norm (megatron-core's ``get_grad_norm_fp32``). Returns
        the norm before clipping (0-dim float64, host)."""
        from megatron.core import parallel_state
        from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        policy = self.policy
        model, mcfg = policy.model, policy.megatron_cfg
        params = [p for p in model.parameters() if p.requires_grad]
        distributed.all_reduce_gradients(
            params, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        untouched = [p for p in params if p.grad is None]  # no replica gave them a gradient
        for p in untouched:
            p.grad = torch.zeros_like(p)  # every rank takes part in the collectives below
        if (
            policy.layout.tie_word_embeddings
            and mcfg.pipeline_model_parallel_size > 1
            and parallel_state.is_rank_in_embedding_group()
        ):
            shared = model.shared_embedding_or_output_weight()
            dist.all_reduce(shared.grad, group=parallel_state.get_embedding_group())
        if mcfg.sequence_parallel:
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=parallel_state.get_tensor_model_parallel_group())
        for p in untouched:  # still none from another stage or rank: AdamW skips them, as in the transformers back-end
            if not bool(p.grad.any()):  # type: ignore[union-attr]
                p.grad = None
        params = [p for p in params if p.grad is not None]
        counted = [p.grad for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        norm = float(get_grad_norm_fp32(counted, grad_stats_parallel_group=parallel_state.get_model_parallel_group()))
        scale = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ with that norm: scale by max / (norm + 1e-6) if < 1
        if scale < 1:
            torch._foreach_mul_([p.grad for p in params], scale)
        return torch.tensor(norm, dtype=torch.float64)

    def reports(self) -> bool:
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0

    def reports_rows(self) -> bool:
        from megatron.core import parallel_state

        return self.reports() and parallel_state.get_context_parallel_rank() == 0

    def count_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def train_mode(self, on: bool) -> None:
        self.policy.model.train(on)
