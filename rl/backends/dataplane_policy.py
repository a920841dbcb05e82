"""The data-plane entry points of a policy: read a step's rows named by a :class:`KVBatchMeta`, run a
:class:`PolicyBackend` on them, write logprob columns back.

The policy back-end stays tensors in, tensors out; this wrapper owns the data plane, the data-parallel sharding and
the rank synchronisation. Mirrors NeMo-RL's ``TQPolicy`` (``reference/seeds/tq_policy.txt``):
``get_logprobs_from_meta``, ``get_reference_policy_logprobs_from_meta`` and ``train_from_meta`` return what the tensor
methods return, for a meta instead of a batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from dataplane import fields as F
from dataplane.meta import KVBatchMeta
from dataplane.sharding import shard_meta_for_dp, shard_updates_for_dp

if TYPE_CHECKING:  # torch is imported where it is used: tasks import modules that import this one at compile time
    import torch

    from dataplane.client import DataPlane
    from rl.backends.interfaces import PolicyBackend


class DataPlanePolicy:
    """A :class:`PolicyBackend` fed from, and writing to, one :class:`DataPlane`.

    Attributes:
        policy: the tensor-level back-end that computes logprobs and trains.
        dataplane: where the rows of a meta are read from and the logprob columns are written to.
    """

    def __init__(self, policy: PolicyBackend, dataplane: DataPlane) -> None:
        self.policy = policy
        self.dataplane = dataplane

    def get_logprobs_from_meta(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Read ``LP_SEED_FIELDS`` of ``meta``, write ``prev_logprobs`` back as a delta column; returns the new meta."""
        return self._logprobs_from_meta(meta, self.policy.get_logprobs, F.PREV_LOGPROBS, "prev_lp")

    def get_reference_policy_logprobs_from_meta(self, meta: KVBatchMeta) -> KVBatchMeta:
        """Read ``LP_SEED_FIELDS`` of ``meta``, write ``reference_policy_logprobs`` back; returns the new meta."""
        return self._logprobs_from_meta(
            meta, self.policy.get_reference_policy_logprobs, F.REFERENCE_POLICY_LOGPROBS, "ref_lp"
        )

    def train_from_meta(
        self, meta: KVBatchMeta, *, fields: Iterable[str], rows_per_update: int | None = None
    ) -> dict[str, float]:
        """Read this rank's shard of ``fields`` (``DP_TRAIN_FIELDS``, less ``prev_logprobs`` on-policy) of ``meta``
        and :meth:`PolicyBackend.train` on it, between ``prepare_for_training`` and ``finish_training``.

        Under data parallelism (``rl.distributed``: N ranks) each optimizer update's ``rows_per_update`` rows are
        split token-balanced across the ranks (``dataplane.sharding.shard_updates_for_dp``), every rank reads only
        its rows, padded to the step's one ``global_forward_pad_seqlen``, and the update is the one a single rank
        makes on the whole batch.

        Args:
            meta: the step's rows.
            fields: the columns to read.
            rows_per_update: the global batch of one optimizer update; None: the whole of ``meta`` (one update).

        Returns:
            the training metrics, with ``total_num_tokens`` (prompt + response tokens of the whole step, summed over
            the ranks that write outputs).
        """
        from rl import distributed

        policy = self.policy
        dp_rank, dp_size = policy.data_parallel()
        shard, update_sizes = shard_updates_for_dp(
            meta, dp_world=dp_size, rank=dp_rank, rows_per_update=rows_per_update or meta.size()
        )
        batch = self.dataplane.read_batch(shard, list(fields), pad_value_dict={F.INPUT_IDS: policy.pad_token_id})
        policy.prepare_for_training()
        try:
            metrics = policy.train(batch, update_sizes=update_sizes)
        finally:
            policy.finish_training()
        tokens = distributed.sum_scalars(
            {"total_num_tokens": float(batch[F.INPUT_LENGTHS].sum()) if policy.writes_outputs() else 0.0}
        )
        return {**metrics, **tokens}

    def _logprobs_from_meta(
        self,
        meta: KVBatchMeta,
        compute: Callable[[Mapping[str, torch.Tensor]], torch.Tensor],
        field: str,
        task_name: str,
    ) -> KVBatchMeta:
        """This rank's token-balanced shard of ``meta`` (``dataplane.sharding.shard_meta_for_dp``), read padded to the
        step's ``global_forward_pad_seqlen``, goes through ``compute`` ([n, S] float32 logprobs); the rank writes its
        rows' ``field`` under their own sample ids in one delta write (its id hashes the field and those ids, so a
        retried task replaces it). Ranks that share a replica's shard (``PolicyBackend.data_parallel``) all compute,
        and one of them (``PolicyBackend.writes_outputs``) writes. Every rank waits for all writes before the meta
        naming ``field`` is returned.

        Raises:
            RuntimeError: ``compute`` returned a tensor whose shape is not that of the batch's ``input_ids``.
        """
        from dataplane.codec import to_nested_by_length
        from rl import distributed

        policy = self.policy
        dp_rank, dp_size = policy.data_parallel()
        shard = shard_meta_for_dp(meta, dp_world=dp_size)[0][dp_rank]
        if shard.size():
            batch = self.dataplane.read_batch(
                shard, list(F.LP_SEED_FIELDS), pad_value_dict={F.INPUT_IDS: policy.pad_token_id}
            )
            logprobs = compute(batch)  # [n, S]
            if policy.writes_outputs():
                if logprobs.shape != batch[F.INPUT_IDS].shape:
                    msg = (
                        f"{policy.name} back-end returned logprobs of shape {tuple(logprobs.shape)} for input_ids "
                        f"{tuple(batch[F.INPUT_IDS].shape)}"
                    )
                    raise RuntimeError(msg)
                self.dataplane.write_columns(
                    shard, {field: to_nested_by_length(logprobs, batch[F.INPUT_LENGTHS])}, task_name=task_name
                )
        distributed.barrier()
        return dataclasses.replace(meta, fields=list(dict.fromkeys([*(meta.fields or []), field])), task_name=task_name)
