"""Test-only: run megatron-core 0.16.1's GPT model and pipeline schedules on a CPU-only torch, so that CI (no GPU)
checks the megatron back-end's maths against the transformers back-end. Nothing here changes what is computed; it moves
megatron-core's hard-coded CUDA placements to the CPU:

- attention forks the CUDA RNG tracker for its dropout (0 here): the inference tracker, whose fork does nothing;
- RoPE moves ``inv_freq`` to ``torch.cuda.current_device()`` (``RotaryEmbedding.get_emb``), and the tied-embedding
  all-reduce between the first and last pipeline stage moves the weight with ``.cuda()``: both stay on the CPU;
- the default causal mask, the schedules' token counter, the gradient norm's buffers and the pipeline's
  ``torch.cuda.synchronize`` are made with ``device="cuda"``: made on the CPU, the synchronize skipped;
- the back-end's own refusal to run without CUDA (``rl.backends.registry``) and its device (``MegatronPolicy.device``).

The GPU tests (``tests/gpu/test_megatron.py``) run the same back-end on CUDA without any of this.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from unittest import mock

import torch


def _on_cpu(fn):
    @functools.wraps(fn)
    def placed(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return placed


def _torch_on_cpu() -> types.ModuleType:
    """A stand-in for the ``torch`` module seen by a few megatron-core modules: tensor factories place on the CPU."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    for name in ("zeros", "ones", "empty", "tensor", "full", "arange"):
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    return proxy


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Inside this block megatron-core's GPT model, its schedules and the ``megatron`` policy back-end run on the
    CPU."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.utils as mcore_utils
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from rl.backends.megatron.policy import MegatronPolicy

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    proxy = _torch_on_cpu()
    with contextlib.ExitStack() as stack:
        for target, name, value in [
            (torch.Tensor, "cuda", lambda self, *a, **k: self),
            (torch.cuda, "current_device", lambda: "cpu"),
            (torch.cuda, "synchronize", lambda *a, **k: None),
            (fused_softmax, "get_default_causal_mask", lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()),
            (schedules, "torch", proxy),
            (clip_grads, "torch", proxy),
            (mcore_utils, "torch", proxy),
            (MegatronPolicy, "device", property(lambda self: torch.device("cpu"))),
            (MegatronPolicy, "_check_installed", lambda self: None),
        ]:
            stack.enter_context(mock.patch.object(target, name, value))
        yield
