"""The decode loop on a static KV cache, whose one-token step is captured once as a CUDA graph and replayed per token
(``generation.cuda_graphs``): on a small model the GPU otherwise waits for Python to launch each layer's kernels.

Owns the static-cache loop only; sampling, the prefill and the output buffers are `rl.backends.hf.sampling`'s, the
choice of this loop over the dynamic one `rl.backends.hf.decode.generate`'s.
"""

from __future__ import annotations

import torch

from rl.backends.hf import sampling
from rl.backends.hf.lm_head import LMHead, lm_head
from rl.backends.hf.logprobs import hidden_states
from rl.precision import autocast, device_of, runs_bf16, to_device


class OneTokenStep:
    """The forward of every row's next token at the next cache position, on inputs that stay at one address.

    Each call writes the current tokens (:attr:`ids`, [n, 1] at positions :attr:`positions`) into the static cache at
    :attr:`write` and returns ``(logits [n, V], hidden [n, H])``; the caller puts the next tokens in :attr:`ids`. With
    ``graph`` (CUDA), the first call runs eagerly on a side stream (the warm-up that a capture needs), then the step is
    captured (recorded, not run) and every later call replays it: one launch instead of a few hundred. A replay
    overwrites the tensors the previous one returned.

    Args:
        model: causal LM whose decoder takes ``past_key_values`` and a 4D attention mask.
        head: its LM head (:func:`rl.backends.hf.lm_head.lm_head`).
        cache: a ``transformers.StaticCache`` holding the prompts (all but their last token).
        ids, positions: [n, 1] int64, the last prompt token of each row and its position.
        keep: [n, L] bool, the cache positions each row attends to (its prompt's real tokens); L = cache length.
        write: the cache position of the first step's token.
        precision: as :func:`rl.precision.autocast`.
        graph: capture and replay (needs CUDA).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        head: LMHead,
        cache: object,
        *,
        ids: torch.Tensor,
        positions: torch.Tensor,
        keep: torch.Tensor,
        write: int,
        precision: str,
        graph: bool,
    ) -> None:
        self.model, self.head, self.cache, self.precision = model, head, cache, precision
        self.ids, self.positions, self.keep = ids.clone(), positions.clone(), keep.clone()
        self.write = torch.full((1,), write, dtype=torch.int64, device=ids.device)  # [1]
        self.graph = graph
        self._captured: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.keep.index_fill_(1, self.write, True)  # each row attends to its new token
        hidden = hidden_states(
            self.model,
            self.ids,
            sampling.one_token_mask(self.model, self.keep),
            precision=self.precision,
            position_ids=self.positions,
            past_key_values=self.cache,
            use_cache=True,
        )[:, -1]  # [n, H]
        self.write.add_(1)
        self.positions.add_(1)
        return self.head.logits(hidden), hidden

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graph:
            return self._step()
        if self._captured is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = self._step()
            torch.cuda.current_stream().wait_stream(side)
            self._captured = torch.cuda.CUDAGraph()
            # thread-local: a trainer thread beside an async run's collector may call CUDA during the capture
            with torch.cuda.graph(self._captured, capture_error_mode="thread_local"):
                self._out = self._step()
            return first
        self._captured.replay()
        assert self._out is not None
        return self._out


def stored_in_compute_dtype(model: torch.nn.Module, precision: str) -> bool:
    """Whether ``model`` runs without autocast casting its weights (`rl.precision.runs_bf16`): bf16 weights, or a
    precision that keeps the weights' own dtype."""
    return not runs_bf16(model, precision) or next(model.parameters()).dtype == torch.bfloat16


def decode_static(
    model: torch.nn.Module,
    prompts: list[list[int]],
    settings: sampling.DecodeSettings,
    *,
    graph: bool,
    group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode ``prompts`` on a static KV cache of prompt + ``settings.max_new_tokens`` positions; returns, on the
    host, :meth:`rl.backends.hf.sampling.Completions.to_host`.

    Each distinct prompt is prefilled once (``prompts`` in runs of ``group`` identical ones) and its KV written into
    the static cache ``group`` times. Unlike the dynamic loop (`rl.backends.hf.decode`), every row stays in the batch
    to the end, finished or not (their tokens discarded): the step's shapes never change, so one graph serves every
    token. The open rows are read every :data:`rl.backends.hf.sampling.SYNC_EVERY` tokens, to stop once all have
    produced eos. ``graph`` (CUDA only) captures the step (:class:`OneTokenStep`).

    Raises:
        ValueError: ``model`` would run under autocast (float32 weights, ``precision`` resolving to bf16): the static
            cache takes one dtype, and a captured step must not cast weights; store the model in its compute dtype.
    """
    from transformers import DynamicCache, StaticCache

    precision = settings.precision
    if not stored_in_compute_dtype(model, precision):
        msg = (
            "a static-cache decode needs the model stored in its compute dtype; it is "
            f"{next(model.parameters()).dtype} under precision {precision!r}"
        )
        raise ValueError(msg)
    device = device_of(model)
    n, t_max = len(prompts), settings.max_new_tokens
    ids, attn, pos = sampling.left_pad(prompts, settings.pad_id)  # [n, P] each, host
    width = ids.shape[1]  # P
    keep = torch.cat([attn[:, :-1].bool(), torch.zeros(n, t_max, dtype=torch.bool)], 1)  # [n, P - 1 + T]
    ids, attn, pos, keep = (to_device(x, device) for x in (ids, attn, pos, keep))
    out = sampling.Completions(n, t_max, pad_id=settings.pad_id, eos_id=settings.eos_id, device=device)
    head = lm_head(model, precision)
    with torch.no_grad(), autocast(model, precision):
        cache = StaticCache(config=model.config, max_cache_len=width - 1 + t_max)
        if group > 1 and width > 1:  # each distinct prompt once, its KV written for every row of its group
            shared = DynamicCache(config=model.config)
            sampling.prefill(model, ids[::group], attn[::group], pos[::group], shared, precision)
            at = {"cache_position": torch.arange(width - 1, device=device)}
            for i, layer in enumerate(shared.layers):
                cache.update(layer.keys.repeat_interleave(group, 0), layer.values.repeat_interleave(group, 0), i, at)
            del shared
        else:
            sampling.prefill(model, ids, attn, pos, cache, precision)
        step = OneTokenStep(
            model,
            head,
            cache,
            ids=ids[:, -1:],
            positions=pos[:, -1:],
            keep=keep,
            write=width - 1,
            precision=precision,
            graph=graph,
        )
        rows = torch.arange(n, device=device)  # [n]
        live = torch.ones(n, dtype=torch.bool, device=device)  # [n] rows still open
        for t in range(t_max):
            logits, hidden = step()
            nxt, lp = sampling.next_tokens(head, hidden, logits, settings)
            live = out.record(rows, t, nxt, lp, live)
            if (t + 1) % sampling.SYNC_EVERY == 0 and not bool(live.any()):  # waits for the device
                break
            step.ids.copy_(nxt[:, None])
    return out.to_host()
