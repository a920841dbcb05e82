"""The transformers generation back-end: our KV-cached decode loop (`rl.backends.hf.decode`) behind
:class:`rl.backends.interfaces.GenerationBackend`, with a model copy of its own that refits in place."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rl.backends.hf.decode import CUDA_LOOP, generate
from rl.backends.hf.model import load_model
from rl.backends.interfaces import Generated, GenerationBackend, PolicyVersion
from rl.config import GRPOConfig
from rl.lengths import MODEL_LIMIT, check_fits
from rl.precision import device_generator, device_of, resolve


class HFGeneration(GenerationBackend):
    """Generation with a Hugging Face causal LM on CPU or CUDA.

    The model is its own copy (not the trainer's module), so its weights stay at :attr:`weight_version` while a
    trainer in the same process moves on. On the CPU it is float32 and runs under bf16 autocast where the precision
    resolves to bf16; its parameters keep ``requires_grad``: torch's autocast caches the bf16 casts only of such
    weights, so a bf16 decode casts the weights once per call instead of once per token. On a GPU the copy is stored
    in the resolved precision (bf16 weights, half the memory and no casts, as vLLM serves them) with SDPA attention,
    and sampling draws from a generator on the GPU seeded by each call's seed.

    Args:
        cfg: the run's config (``generation`` sampling settings, ``model.precision``, storage options).
        tokenizer: the model's tokenizer (pad and eos ids).
        model_path: the base model folder: the architecture a warm :meth:`refit` copies weights into.
    """

    name = "transformers"

    def __init__(self, cfg: GRPOConfig, *, tokenizer: Any, model_path: str) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._model_path = model_path
        self._model: torch.nn.Module | None = None
        self._version: int | None = None
        self._kv: list | None = None  # the last call's rows' KV (keep_kv), for the next call's continues

    @property
    def weight_version(self) -> int | None:
        return self._version

    reuses_kv = True
    """:meth:`generate` takes ``continues`` and ``keep_kv`` (the multi-turn loop's prefix reuse, `rl.multi_turn`)."""

    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        continues: list[int | None] | None = None,
        keep_kv: bool = False,
        stop_strings: list[list[str] | None] | None = None,
    ) -> Generated:
        """See :meth:`GenerationBackend.generate`. ``keep_kv``: keep each row's KV cache after the call (until the next
        call or refit); ``continues`` ([len(prompts)], group_size 1): the row of the previous call each prompt
        continues (its tokens then start the prompt, which prefills only the rest), or None."""
        if self._model is None:
            msg = "the transformers generation back-end holds no weights yet: call refit(version) first"
            raise RuntimeError(msg)

        g = self._cfg.generation
        limit = getattr(self._model.config, "max_position_embeddings", None) or 1 << 30
        check_fits([len(p) for p in prompts], g.max_new_tokens, int(limit), MODEL_LIMIT)
        previous, self._kv = self._kv, None
        kv_in = None
        if continues is not None and previous is not None and group_size == 1:
            kv_in = [previous[c] if c is not None and 0 <= c < len(previous) else None for c in continues]
        kept: list | None = [] if keep_kv else None
        out = generate(
            self._model,
            self._tokenizer,
            [p for p in prompts for _ in range(group_size)],
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            greedy=greedy,
            batch_size=g.batch_size,
            precision=self._cfg.model.precision,
            generator=device_generator(device_of(self._model), seed),
            loop=self._loop(),
            kv_in=kv_in,
            kv_out=kept,
            stop_strings=None if stop_strings is None else [s for s in stop_strings for _ in range(group_size)],
        )
        self._kv = kept
        return out

    def _loop(self) -> str:
        """The decode loop (`rl.backends.hf.decode.LOOPS`): on CUDA ``graphs`` where ``generation.cuda_graphs`` is
        true, ``dynamic`` where false, :data:`rl.backends.hf.decode.CUDA_LOOP` where null; ``dynamic`` elsewhere."""
        if device_of(self._model).type != "cuda":
            return "dynamic"
        graphs = self._cfg.generation.cuda_graphs
        return CUDA_LOOP if graphs is None else "graphs" if graphs else "dynamic"

    def refit(self, version: PolicyVersion, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        from rl.checkpoint import local_folder
        from rl.lora import is_adapter_folder, merged_model

        if weights is None:
            dtype = self._dtype()
            so = self._cfg.dataplane.storage_options
            serving = "bfloat16" if dtype == torch.bfloat16 else None  # the checkpoint's bf16 copy where it has one
            with local_folder(
                version.path, so, require_complete=version.step > 0, weights_only=True, dtype=serving
            ) as folder:
                if is_adapter_folder(folder):  # a LoRA checkpoint: the base model with the adapter merged in
                    self._model = merged_model(self._model_path, folder, dtype=dtype)
                else:
                    self._model = load_model(folder, dtype=dtype)
        else:
            if self._model is None:
                self._model = load_model(self._model_path, dtype=self._dtype())
            copy_weights(self._model, weights)
        self._version, self._kv = version.step, None  # a kept KV belongs to the old weights

    def _dtype(self) -> torch.dtype:
        """bfloat16 on a GPU where ``model.precision`` resolves to it; float32 elsewhere (the CPU keeps float32 weights
        under autocast, which with the exact-logit LM head (`rl.backends.hf.lm_head`) matches the trainer's
        logprobs)."""

        if torch.cuda.is_available() and resolve(self._cfg.model.precision, "cuda") == "bfloat16":
            return torch.bfloat16
        return torch.float32

    def shutdown(self) -> bool:
        self._model, self._version, self._kv = None, None, None
        return True


def copy_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``weights`` (HF names) into ``model``'s tensors in place; every tensor of ``model`` must be given (a tied
    tensor, such as SmolLM2's shared embedding and LM head, under either of its names).

    Raises:
        KeyError: a name ``model`` does not have, or a tensor of ``model`` that ``weights`` left out.
    """
    own = model.state_dict()
    seen = set()
    with torch.no_grad():
        for name, value in weights:
            if name not in own:
                msg = f"refit weight {name!r} is not a tensor of {type(model).__name__}"
                raise KeyError(msg)
            own[name].copy_(value)  # casts to the engine's dtype and device
            seen.add(own[name].data_ptr())
    missing = sorted(k for k, v in own.items() if v.data_ptr() not in seen)  # a tied tensor counts once
    if missing:
        msg = f"refit left {len(missing)} tensors of {type(model).__name__} unset, e.g. {missing[:3]}"
        raise KeyError(msg)
