"""The transformers back-end's side of the GRPO update (`rl.backends.engine`): the forward and backward of its
micro-batches through the shared-prompt forward (`rl.backends.hf.logprobs`), its gradient reduction and clipping.
The loop, the loss and the optimizer are the engine's, shared with the Megatron-core back-end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dataplane import fields as F
from dataplane.fields import LOSS_FIELDS
from rl import distributed
from rl.backends.engine import (  # noqa: F401 (re-exported: the update's public names)
    LossFn,
    MicroBatchLoss,
    TrainEngine,
    combine_step_metrics,
    make_optimizer,
    step_batch,
)
from rl.backends.hf.logprobs import forward_logprobs
from rl.config import GRPOConfig
from rl.precision import autocast, device_of, on_accelerator, to_device


class HFTrainEngine(TrainEngine):
    """A Hugging Face causal LM as a :class:`rl.backends.engine.TrainEngine`: each micro-batch cut to its longest row,
    its logprobs from :func:`rl.backends.hf.logprobs.forward_logprobs` (shared-prompt KV cache, packed LM head), its
    loss fields copied to the device once; gradients summed over the data-parallel ranks
    (`rl.distributed.all_reduce_gradients`) and clipped by torch's ``clip_grad_norm_``."""

    def __init__(self, model: torch.nn.Module, cfg: GRPOConfig) -> None:
        self.model, self.cfg = model, cfg
        self.device = device_of(model)

    @property
    def model_config(self) -> Any:
        return self.model.config

    def compute(self) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        stack.enter_context(autocast(self.model, self.cfg.model.precision))
        stack.enter_context(_embedding_grads_by_row(self.model))
        return stack

    def train_mode(self, on: bool) -> None:
        self.model.train(on)

    def forward_backward(
        self, rows: Any, slices: Sequence[slice], loss_fn: LossFn
    ) -> list[tuple[slice, MicroBatchLoss]]:
        out = []
        for where in slices:
            mb = rows[where]
            width = int(mb[F.INPUT_LENGTHS].max())
            # host; the loss copies its fields
            cut = mb.apply(lambda v: v[:, :width] if v.dim() == 2 else v)  # noqa: B023
            logprobs = forward_logprobs(
                self.model,
                cut[F.INPUT_IDS],
                cut[F.INPUT_LENGTHS],
                precision=self.cfg.model.precision,
                temperature=self.cfg.generation.temperature,
                token_mask=cut[F.TOKEN_MASK],
            )  # [m, w] on the device
            fields = {k: to_device(cut[k], self.device) for k in LOSS_FIELDS if k in cut.keys()}
            result = loss_fn(logprobs, fields)
            result.loss.backward()
            out.append((where, result))
        return out

    def finish_gradients(self, max_norm: float) -> torch.Tensor:
        distributed.all_reduce_gradients(self.model.parameters())  # sum over ranks: the whole update's gradient
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).to(
            self.device
        )  # a host 0 without gradients


def train_on_batch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    batch: Mapping[str, torch.Tensor],
    cfg: GRPOConfig,
    *,
    update_sizes: Sequence[int] | None = None,
) -> dict[str, float]:
    """:meth:`rl.backends.engine.TrainEngine.train_batch` on a Hugging Face model (:class:`HFTrainEngine`): same
    arguments, metrics and errors."""
    return HFTrainEngine(model, cfg).train_batch(optimizer, scheduler, batch, cfg, update_sizes=update_sizes)


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
    if (
        type(emb) is not torch.nn.Embedding
        or not emb.weight.requires_grad  # frozen (a LoRA policy's base): no gradient to accumulate
        or emb.max_norm is not None
        or emb.scale_grad_by_freq
        or on_accelerator(emb.weight.device)
    ):
        yield  # an embedding with its own semantics keeps torch's backward
        return
    emb.forward = lambda ids: _EmbeddingRows.apply(ids, emb.weight, emb.padding_idx)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del emb.forward
