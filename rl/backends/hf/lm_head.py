"""The LM head (output embedding) as grpoflow runs it: logits for sampling and per-token logprobs for training,
computed only for the positions asked for, with the [T, V] matmul in the compute dtype.

In bfloat16 a [T, 576] x [576, 49152] head matmul is ~3.3x faster than in float32 on an AVX-512 BF16 CPU, but its
bf16 *output* rounds a logit near 20 by up to 0.06 nats. So the head runs in bf16 and then the logits that decide
a logprob are recomputed exactly in float32: the target token's logit, and the ``EXACT_TOP_K`` largest logits of
each row (they carry most of the softmax mass, hence most of log-sum-exp's rounding error). Measured on SmolLM2's
own rollouts (bf16 trunk): mean |logprob error| vs a float32 head 0.023 nats for a plain bf16 head, 0.0018 with
this correction, below the 0.014 that the bf16 trunk itself puts between the KV-cached decode and a full forward.

Owns the head maths only; the trunk and its precision are `rl.precision`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from rl.precision import autocast_off, runs_bf16

EXACT_TOP_K = 8
_LOW_WEIGHTS_KEPT = 3
"""Low-precision head weights cached: the policy's, the reference's and the generation model's."""
_LOW_WEIGHTS: dict[int, tuple[tuple, torch.Tensor]] = {}
_LOW_WEIGHTS_LOCK = threading.Lock()  # an async run's collector thread generates beside the trainer


@dataclass(frozen=True)
class LMHead:
    """A bias-free output embedding ``logits = hidden @ weight.T``.

    Attributes:
        weight: [V, H] master weights (float32 in training; may require grad, may be tied to the input embedding).
        compute_dtype: dtype of the [T, V] matmul (bfloat16 under mixed precision, else the weight's dtype).
    """

    weight: torch.Tensor
    compute_dtype: torch.dtype

    @property
    def corrected(self) -> bool:
        return self.compute_dtype != self.weight.dtype

    def low_weight(self) -> torch.Tensor:
        """[V, H] ``weight`` in ``compute_dtype``, cast once per weight version (an optimizer step bumps it)."""
        w = self.weight
        if not self.corrected:
            return w.detach()
        with _LOW_WEIGHTS_LOCK:
            key = (id(w), w.data_ptr(), w._version, self.compute_dtype)
            hit = _LOW_WEIGHTS.get(id(w))
            if hit is None or hit[0] != key:
                while hit is None and len(_LOW_WEIGHTS) >= _LOW_WEIGHTS_KEPT:  # a new head: the oldest goes
                    _LOW_WEIGHTS.pop(next(iter(_LOW_WEIGHTS)))
                hit = _LOW_WEIGHTS[id(w)] = (key, w.detach().to(self.compute_dtype))
            return hit[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V] float32 (or the weight's wider dtype) logits of ``hidden`` [T, H], the top-k entries exact.

        Runs with autocast off (inside an autocast block the exact einsum would otherwise run in bf16).
        """
        with autocast_off(self.weight.device):
            return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight
        out = hidden.to(self.compute_dtype) @ self.low_weight().T  # [T, V]
        out = out.to(torch.promote_types(w.dtype, torch.float32))
        if self.corrected and out.shape[0]:
            top = out.topk(min(EXACT_TOP_K, out.shape[1]), -1).indices  # [T, k]
            exact = torch.einsum("th,tkh->tk", hidden.to(w.dtype), w[top])  # [T, k]
            out.scatter_(1, top, exact.to(out.dtype))
        return out

    def target_logits(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[T] exact logits of ``targets`` [T] int64 (``hidden`` [T, H]), in the weight's dtype."""
        with autocast_off(self.weight.device):
            return (hidden.to(self.weight.dtype) * self.weight[targets]).sum(-1)

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """log softmax(logits / temperature)[target] per row, differentiable w.r.t. ``hidden`` and ``weight``.

        ``= target_logit / temperature - logsumexp(logits / temperature)`` with :meth:`logits` and the exact
        :meth:`target_logits` (generation uses the same formula, so the two agree to float noise). The backward
        pass runs its two [T, V] matmuls in ``compute_dtype`` (as autocast does for every other linear layer).

        Args:
            hidden: [T, H] float, final hidden states of the positions that predict ``targets``.
            targets: [T] int64 token ids.
            temperature: > 0, the sampling temperature.

        Returns:
            [T] float32 (float64 for a float64 head) logprobs, nats.
        """
        return _TokenLogprobs.apply(hidden, self.weight, targets, temperature, self)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, head):  # noqa: ARG004 (weight is head.weight, passed for autograd)
        logits = head.logits(hidden)  # [T, V]
        if temperature != 1.0:
            logits.div_(temperature)
        logp = logits.log_softmax(-1)  # [T, V], one fused pass (torch.logsumexp is ~2x slower on CPU)
        lse = logits[:, 0] - logp[:, 0]  # [T]
        del logits
        out = head.target_logits(hidden, targets).to(logp.dtype) / temperature - lse  # [T]
        ctx.save_for_backward(hidden, logp, targets)
        ctx.head, ctx.temperature = head, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, logp, targets = ctx.saved_tensors
        head, temperature = ctx.head, ctx.temperature
        # d out / d logits_v = (1[v = target] - softmax_v) / temperature, times the incoming gradient
        grad = logp.exp_().mul_(-grad_out[:, None] / temperature)  # [T, V], in the saved tensor (backward runs once)
        grad.scatter_add_(1, targets[:, None], (grad_out / temperature)[:, None].to(grad.dtype))
        low = grad.to(head.compute_dtype)  # [T, V]
        del grad
        grad_hidden = (low @ head.low_weight()).to(hidden.dtype) if ctx.needs_input_grad[0] else None  # [T, H]
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (low.T @ hidden.to(head.compute_dtype)).to(head.weight.dtype)  # [V, H]
        return grad_hidden, grad_weight, None, None, None


def lm_head(model: torch.nn.Module, precision: str) -> LMHead:
    """The LM head of a Hugging Face causal LM, run in ``precision`` (see :func:`rl.precision.autocast`).

    Raises:
        ValueError: the model's output layer is not a bias-free linear map on the final hidden states (a head
            with a bias, or logit soft-capping as in Gemma 2): such models are not supported.
    """
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or softcap:
        msg = (
            f"{type(model).__name__}'s output layer ({type(head).__name__}, "
            f"bias={getattr(head, 'bias', None) is not None}, "
            f"final_logit_softcapping={softcap}) is not a bias-free linear map; grpoflow supports decoder LMs whose "
            "logits are hidden @ W.T (Llama, Qwen, SmolLM, Mistral)"
        )
        raise ValueError(msg)
    return LMHead(
        weight=head.weight, compute_dtype=torch.bfloat16 if runs_bf16(model, precision) else head.weight.dtype
    )
