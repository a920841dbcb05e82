"""The transformers policy back-end: shared-prompt logprobs, the packed LM head and the micro-batched GRPO update
(`rl.backends.hf.logprobs`, `.lm_head`, `.train`) behind :class:`rl.backends.interfaces.PolicyBackend`; the loading,
version and optimizer bookkeeping is :class:`rl.backends.policy_base.TrainablePolicy`'s."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from dataplane import fields as F
from rl import checkpoint, lora
from rl.backends.hf import train as hf_train
from rl.backends.hf.lm_head import lm_head
from rl.backends.hf.logprobs import batched_logprobs, hidden_states
from rl.backends.hf.model import load_model
from rl.backends.interfaces import TopkLogits
from rl.backends.micro_batch import micro_batch_limits
from rl.backends.policy_base import TrainablePolicy
from rl.precision import autocast, device_of, resolve, to_device


class HFPolicy(TrainablePolicy):
    """A Hugging Face causal LM with AdamW, and the base model as the reference policy.

    Nothing is loaded at construction: the policy weights on :meth:`load_checkpoint`, the optimizer only when
    training asks for it, the reference policy on the first reference-logprob call. So a task that needs only
    the reference policy (a reference-logprob pod) never loads the policy, and one that only reads logprobs
    never builds an optimizer.

    With ``policy.lora`` (`rl.lora`) the policy is the base model with a peft LoRA adapter injected: only the adapter
    trains (its gradients and AdamW state, nothing else), the reference policy is the same module with the adapter
    disabled (a base model loaded earlier for reference logprobs becomes the policy's base: one model in memory),
    checkpoints hold the adapter, and :meth:`named_weights` gives the merged weights under the base model's names.

    Args:
        cfg: the run's config (``model.precision``, ``optim``, ``loss``, ``generation.temperature``).
        tokenizer: the model's tokenizer (saved into every checkpoint).
        reference_path: the base model folder, i.e. the reference policy.
    """

    name = "transformers"
    _peft: Any = None
    """The peft wrapper of the held policy under ``policy.lora`` (its base model is :attr:`model`); else None."""

    # ------------------------------------------------------------------------------------------ state
    def _load_weights(self, folder: str) -> torch.nn.Module:
        settings = self._cfg.policy.lora
        if settings is None:
            return load_model(folder)
        base = self._reference  # the reference policy loaded earlier in this process: the adapter's base now
        if base is None:
            base = load_model(self._reference_path, dtype=self._reference_dtype())
        self._reference = None  # from now on the reference is the policy with its adapter disabled
        self._peft = lora.load_policy(base, folder, settings, seed=self._cfg.grpo.seed)
        return self._peft.get_base_model()

    def _drop_weights(self) -> None:
        super()._drop_weights()
        self._peft = None

    def save_checkpoint(self, url: str, *, trainer_state: Any | None = None, serving_dtype: str | None = None) -> str:
        with_state = trainer_state is not None
        return checkpoint.save(
            url,
            model=self._peft if self._peft is not None else self.model,  # a LoRA checkpoint: the adapter only
            tokenizer=self._tokenizer,
            optimizer=self._optimizer if with_state else None,
            scheduler=self._scheduler if with_state else None,
            state=trainer_state,
            storage_options=self._cfg.dataplane.storage_options,
            serving_dtype=serving_dtype if self._peft is None else None,  # generation merges base and adapter
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self._peft is not None:
            return lora.merged_weights(self._peft)
        return self.model.state_dict().items()

    # ------------------------------------------------------------------------------------ forward passes
    def load_reference_policy(self) -> None:
        if self._reference is None and self._peft is None:  # under LoRA a held policy is its own reference
            self._reference = load_model(self._reference_path, dtype=self._reference_dtype())
            self._reference.requires_grad_(False)

    def get_reference_policy_logprobs(
        self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        if self._peft is not None:  # LoRA: the policy's base weights, adapter disabled
            with lora.adapter_disabled(self._peft):
                return self._logprobs(self.model, batch, micro_batch_size)
        return super().get_reference_policy_logprobs(batch, micro_batch_size=micro_batch_size)

    def _reference_dtype(self) -> torch.dtype:
        """bfloat16 on CUDA where ``model.precision`` resolves to bfloat16: the frozen reference needs no float32
        master copy (half the memory, and no per-forward weight cast: autocast caches casts only of weights that
        require grad). float32 on the CPU, where its logprobs stay those of the float32 base model."""

        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return (
            torch.bfloat16
            if device.type == "cuda" and resolve(self._cfg.model.precision, device) == "bfloat16"
            else torch.float32
        )

    def _logprobs(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None
    ) -> torch.Tensor:
        rows, tokens = micro_batch_limits(self._cfg, model.config, device_of(model), train=False)
        if micro_batch_size is not None:  # the caller's row count, alone
            rows, tokens = micro_batch_size, None
        return batched_logprobs(
            model,
            batch[F.INPUT_IDS],
            batch[F.INPUT_LENGTHS],
            batch[F.TOKEN_MASK],
            batch_size=rows,
            max_tokens=tokens,
            precision=self._cfg.model.precision,
            temperature=self._cfg.generation.temperature,
        )  # [N, S]

    def get_topk_logits(
        self, batch: Mapping[str, torch.Tensor], k: int, *, micro_batch_size: int | None = None
    ) -> TopkLogits:
        """Top-k of the raw logits (no temperature) at every position that predicts a real token.

        The LM head runs in ``model.precision``; under bf16 its ``EXACT_TOP_K`` largest logits per position are
        exact float32 (`rl.backends.hf.lm_head`), the rest bf16-rounded.
        """

        model, precision = self.model, self._cfg.model.precision
        ids, lengths = batch[F.INPUT_IDS], batch[F.INPUT_LENGTHS]
        n, s = ids.shape
        vocab = model.get_output_embeddings().weight.shape[0]
        if not 1 <= k <= vocab:
            msg = f"get_topk_logits: k={k} must be between 1 and the vocabulary size {vocab}"
            raise ValueError(msg)
        device = device_of(model)
        values = torch.zeros(n, max(s - 1, 0), k, device=device)  # [N, S-1, k]
        indices = torch.zeros(n, max(s - 1, 0), k, dtype=torch.int64, device=device)  # [N, S-1, k]
        mbs = micro_batch_size or self._cfg.optim.logprob_batch_size or 8
        with torch.no_grad(), autocast(model, precision):
            head = lm_head(model, precision)
            for a in range(0, n, mbs):
                rows = slice(a, min(a + mbs, n))
                width = int(lengths[rows].max())
                attn = (torch.arange(width)[None, :] < lengths[rows, None]).long()  # [m, W]
                hidden = hidden_states(
                    model, to_device(ids[rows, :width], device), to_device(attn, device), precision=precision
                )  # [m, W, H]
                live = torch.arange(width - 1)[None, :] < (lengths[rows, None] - 1)  # [m, W-1] predicts a real token
                r, t = (to_device(x, device) for x in live.nonzero(as_tuple=True))  # [T] each
                top = head.logits(hidden[r, t]).topk(k, -1)  # [T, k] each
                values[a + r, t] = top.values.float()
                indices[a + r, t] = top.indices
        values, indices = values.cpu(), indices.cpu()
        return TopkLogits(topk_logits=values, topk_indices=indices)

    # ------------------------------------------------------------------------------------------ training
    def _update(self, batch: Mapping[str, torch.Tensor], update_sizes: Sequence[int] | None) -> dict[str, float]:
        return hf_train.train_on_batch(
            self.model, self._optimizer, self._scheduler, batch, self._cfg, update_sizes=update_sizes
        )
