"""What the policy back-ends share: one trainable model with its AdamW state, a frozen reference policy, the version
bookkeeping between them and the order of loading, training and dropping them.

A back-end (:class:`rl.backends.hf.policy.HFPolicy`, :class:`rl.backends.megatron.policy.MegatronPolicy`) subclasses
:class:`TrainablePolicy` and supplies how its model is built from a checkpoint folder, its logprob forward and its
update (its own :class:`rl.backends.engine.TrainEngine`'s ``train_batch``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rl.backends.interfaces import PolicyBackend, PolicyVersion

if TYPE_CHECKING:  # torch is imported by the back-ends that subclass this
    import torch

    from rl.config import GRPOConfig


class TrainablePolicy(PolicyBackend):
    """A policy back-end that loads lazily: the policy weights on :meth:`load_checkpoint`, the optimizer only when it
    is asked for, the reference policy on :meth:`load_reference_policy` (or the first reference call).

    Invariants: :attr:`weight_version` is the step of the held weights (None: none held); the optimizer state belongs
    to them exactly when ``_optimizer_version == _version`` (:meth:`has_optimizer_state`); a failed :meth:`train`
    drops the weights and the optimizer (they may be half-updated), so nothing uses them as any version.

    Args:
        cfg: the run's config.
        tokenizer: the model's tokenizer (saved into every checkpoint; its ``pad_token_id`` pads ``input_ids``).
        reference_path: the base model folder, i.e. the reference policy.
    """

    def __init__(self, cfg: GRPOConfig, *, tokenizer: Any, reference_path: str) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._reference_path = reference_path
        self._model: torch.nn.Module | None = None
        self._reference: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._version: int | None = None
        self._optimizer_version: int | None = None

    # ----------------------------------------------------------------------------------- what a back-end supplies
    @abc.abstractmethod
    def _load_weights(self, folder: str) -> torch.nn.Module:
        """The policy module (this rank's shard of it) with the weights of the local HF folder ``folder``."""

    def _optimizer_shard(self) -> str | None:
        """The name of this rank's optimizer state in a checkpoint (``rl.checkpoint.load_trainer_state``'s
        ``shard``); None: one unsplit optimizer."""
        return None

    @abc.abstractmethod
    def _logprobs(
        self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor], micro_batch_size: int | None
    ) -> torch.Tensor:
        """[N, S] float32 logprobs of ``batch`` under ``model`` (the policy or the reference), without gradients."""

    @abc.abstractmethod
    def _update(self, batch: Mapping[str, torch.Tensor], update_sizes: Sequence[int] | None) -> dict[str, float]:
        """The optimizer updates of :meth:`train` on the held model and optimizer; the version bookkeeping is
        :meth:`train`'s."""

    def _drop_optimizer(self) -> None:
        """Forget the optimizer state (and whatever a back-end derives from the held weights)."""
        self._optimizer = self._scheduler = self._optimizer_version = None

    def _drop_weights(self) -> None:
        """Forget the policy weights and their optimizer state; the reference policy stays."""
        self._model = self._version = None
        self._drop_optimizer()

    # ------------------------------------------------------------------------------------------------ state
    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def pad_token_id(self) -> int:
        return int(self._tokenizer.pad_token_id)

    @property
    def model(self) -> torch.nn.Module:
        """The policy module this process holds (this rank's shard under model parallelism), for benchmarks and tests
        that look inside.

        Raises:
            RuntimeError: no weights loaded yet.
        """
        if self._model is None:
            msg = f"the {self.name} policy holds no weights yet: call load_checkpoint(version) first"
            raise RuntimeError(msg)
        return self._model

    def has_optimizer_state(self, version: PolicyVersion) -> bool:
        return self._optimizer is not None and self._version == version.step and self._optimizer_version == version.step

    def load_checkpoint(self, version: PolicyVersion, *, with_optimizer: bool) -> None:
        from rl import checkpoint
        from rl.backends.engine import make_optimizer

        so = self._cfg.dataplane.storage_options
        if with_optimizer:
            checkpoint.require_trainer_state(version.path, version.step, so)
        with checkpoint.local_folder(
            version.path, so, require_complete=version.step > 0, weights_only=not with_optimizer
        ) as folder:
            if self._model is None or self._version != version.step:
                self._model = self._load_weights(folder)
                self._drop_optimizer()
                self._version = version.step
            if with_optimizer:
                self._optimizer, self._scheduler = make_optimizer(self._model, self._cfg)
                if version.step != 0:
                    checkpoint.load_trainer_state(
                        folder, self._optimizer, self._scheduler, shard=self._optimizer_shard()
                    )
                self._optimizer_version = version.step

    # --------------------------------------------------------------------------------------------- forward passes
    def get_logprobs(self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None) -> torch.Tensor:
        return self._logprobs(self.model, batch, micro_batch_size)

    def get_reference_policy_logprobs(
        self, batch: Mapping[str, torch.Tensor], *, micro_batch_size: int | None = None
    ) -> torch.Tensor:
        self.load_reference_policy()
        assert self._reference is not None
        return self._logprobs(self._reference, batch, micro_batch_size)

    # --------------------------------------------------------------------------------------------------- training
    def _require_optimizer(self, what: str) -> None:
        """Raise RuntimeError, naming ``what`` asked, unless the optimizer state belongs to the held weights."""
        if self._optimizer is None or self._optimizer_version != self._version:
            msg = f"{what}: no optimizer state for the held weights; call load_checkpoint(version, with_optimizer=True)"
            raise RuntimeError(msg)

    def prepare_for_training(self) -> None:
        self._require_optimizer("prepare_for_training")
        self.model.train()

    def finish_training(self) -> None:
        if self._model is not None:
            self._model.eval()
            self._model.zero_grad(set_to_none=True)

    def train(
        self, batch: Mapping[str, torch.Tensor], *, update_sizes: Sequence[int] | None = None
    ) -> dict[str, float]:
        self._require_optimizer("train")
        assert self._version is not None
        try:
            metrics = self._update(batch, update_sizes)
        except BaseException:
            self._drop_weights()  # the weights may be half-updated: nothing may use them as any version
            raise
        self._version += 1
        self._optimizer_version = self._version
        return metrics

    def shutdown(self) -> bool:
        self._drop_weights()
        self._reference = None
        return True
