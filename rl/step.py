"""One GRPO step on one page, without Flyte: rollout, logprobs, advantages and update, each stage reading and writing
the step's partition of the data plane through a `KVBatchMeta`. ``workflows/grpo.py`` runs the stages as tasks, which
add placement, retries, timing and metrics around these calls; ``bench/step.py`` times them.

Reference: NeMo-RL ``grpo_train_sync`` (``reference/seeds/grpo_sync.txt``; ``reference/NEMO_RL_DIGEST.md``, "One
sync step"). Deviations:

1) No driver carry: the rewards are a column of the rollout's put, and each stage reads what it needs from the data
   plane, so the stages run in processes of their own and the two logprob passes side by side.
2) Dynamic sampling and the overlong filter run inside the rollout, before the put (``rl.rollout.sample_step``): a
   dropped group never reaches the data plane, and dynamic sampling keeps or drops whole groups (``rl.filters``).
3) On-policy (one optimizer update per step, ``GRPOConfig.on_policy``) there is no ``prev_logprobs`` pass: pi_old is
   the update's own forward pass, detached.
4) The sequence-logprob-error mask (``loss.seq_logprob_error_threshold``) is applied in the update
   (``rl.backends.engine.step_batch``); the advantages were computed with the rollout's ``sample_mask``.
5) A step's problems and sampling seeds are functions of its number (``rl.rollout.sample_step``), not the state of a
   dataloader, and the update is seeded from it too: a retried or resumed step draws the same completions and makes
   the same update.
6) Clearing the partition and syncing the new weights to the generator are the caller's: the train task clears after
   its save (async, it keeps the partitions a resume needs: ``rl.async_grpo.partitions_to_clear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dataplane import fields as F
from dataplane import paths
from dataplane.codec import nested_from_values
from dataplane.meta import KVBatchMeta
from rl.advantages import StepAdvantages, advantages_for_step
from rl.async_grpo import trajectory_age
from rl.config import GRPOConfig
from rl.prompts import prompt_source
from rl.rollout import sample_step, to_columns
from rl.scoring import reward_names
from rl.seeding import seed_all, step_seed

if TYPE_CHECKING:
    from dataplane.client import DataPlane
    from rl.backends.dataplane_policy import DataPlanePolicy
    from rl.backends.interfaces import GenerationBackend


def grpo_step(
    cfg: GRPOConfig, *, generator: GenerationBackend, tokenizer: Any, policy: DataPlanePolicy, step: int
) -> tuple[KVBatchMeta, dict[str, float]]:
    """Step ``step``: the five tasks of ``workflows/grpo.py`` ``grpo_step`` as plain calls in this process.

    Args:
        cfg: the run's config.
        generator: the generation back-end, holding the weights to sample with (the policy after step - 1 when
            synchronous).
        tokenizer: the base model's tokenizer (prompts in, responses out).
        policy: the policy after step - 1 with its optimizer state and the reference policy loaded, and the data
            plane the step's partition lives in.
        step: the step, from 1.

    Returns:
        ``(train_meta, metrics)``: the meta naming every column the update read (its ``extra_info`` holds the
        rollout's metrics, ``rollout/*``), and the update's metrics (:meth:`DataPlanePolicy.train_from_meta`).
    """
    # 1 rollout: G completions per prompt by the generator, scored, first put of the step partition
    rollout_meta = rollout_to_batch(generator, tokenizer, cfg, dataplane=policy.dataplane, step=step)
    # 2 pi_old logprobs (off-policy only: on-policy, pi_old is the update's own forward) and
    # 3 reference-policy logprobs: independent delta writes to the same rows
    with_prev_logprobs = rollout_meta if cfg.on_policy else policy.get_logprobs_from_meta(rollout_meta)
    with_reference_logprobs = policy.get_reference_policy_logprobs_from_meta(rollout_meta)
    # 4 advantages from the group rewards
    with_advantages, _, _ = write_advantages(cfg, policy.dataplane, rollout_meta)
    # 5 update: clipped PG + KL on every column written above
    train_meta = with_advantages.join(with_prev_logprobs, with_reference_logprobs)
    return train_meta, update(cfg, policy, train_meta, step=step)


def rollout_to_batch(
    generator: GenerationBackend, tokenizer: Any, cfg: GRPOConfig, *, dataplane: DataPlane, step: int
) -> KVBatchMeta:
    """Generate and score the B groups of ``step`` with the weights ``generator`` holds, put them as the first write of
    the step partition (``dataplane.fields.STEP_SCHEMA``; every row carries the generator's ``weight_version``), and
    seal it, so that a later process finds the batch (``DataPlane.sealed``).

    Returns:
        the batch's meta: N = B * G rows, group-contiguous, ``global_forward_pad_seqlen`` fixed, and in ``extra_info``
        the rollout's metrics (``rollout/*`` of :func:`rl.rollout.sample_step`, ``rollout/avg_trajectory_age``,
        ``rollout/weight_version``).

    Raises:
        RuntimeError: dynamic sampling found too few informative groups (:func:`rl.rollout.sample_step`).
    """
    g = cfg.grpo.num_generations_per_prompt
    version = generator.weight_version
    assert version is not None
    source = prompt_source(cfg, root=dataplane.root_url, run_id=dataplane.run_id)  # reasoning-gym or the run's copy
    groups, sample_mask, metrics = sample_step(generator, tokenizer, cfg, step=step, source=source)  # [N] bool
    columns = to_columns(groups, sample_mask, group_size=g, weight_version=version)  # input_ids [N, L_i] jagged, ...
    partition = paths.step_partition(step)
    dataplane.register_partition(partition, fields=F.STEP_SCHEMA)
    meta = dataplane.put(partition, columns, group_size=g, task_name="rollout", id_key="rollout")
    info = {f"rollout/{k}": v for k, v in metrics.items()}
    info["rollout/avg_trajectory_age"] = float(trajectory_age(step, version))
    info["rollout/weight_version"] = float(version)
    meta = meta.with_extra_info(**info).stamp_pad_seqlen()
    dataplane.seal(meta)
    return meta


def write_advantages(
    cfg: GRPOConfig, dataplane: DataPlane, meta: KVBatchMeta
) -> tuple[KVBatchMeta, torch.Tensor, StepAdvantages]:
    """Per-sample advantages of the step's rewards (``grpo.reward_shaping``, then ``grpo.adv_estimator``:
    :func:`rl.advantages.advantages_for_step`), written as ``advantages`` with the sample's A on each of its tokens.

    Returns:
        ``(meta, rewards, advantages)``: the meta naming ``advantages``, each row tagged with its ``baseline`` and
        ``std``; the rewards read, [N] float32; and the :class:`StepAdvantages` written.
    """
    gdpo = cfg.grpo.adv_estimator == "gdpo"
    named = [F.TASK_NAME, F.REWARD_COMPONENTS] if gdpo else []
    cols = dataplane.read(meta, [F.REWARDS, F.SAMPLE_MASK, F.INPUT_LENGTHS, F.PROMPT_LENGTHS, *named])
    rewards, lengths = cols[F.REWARDS], cols[F.INPUT_LENGTHS]  # [N] float32, [N] int64
    components = weights = None
    if gdpo:  # [N, K] float32 each: the named rewards (NaN: does not apply) and each sample's task's weights
        components, weights = named_rewards(cfg, cols[F.TASK_NAME], cols[F.REWARD_COMPONENTS])
    adv = advantages_for_step(
        rewards,
        cols[F.SAMPLE_MASK],
        lengths - cols[F.PROMPT_LENGTHS],
        cfg,
        reward_components=components,
        reward_weights=weights,
    )  # [N] each
    per_token = nested_from_values(torch.repeat_interleave(adv.advantages, lengths), lengths)  # [N, L_i] jagged
    out = dataplane.write_columns(meta, {F.ADVANTAGES: per_token}, task_name="advantages")
    return out.stamp_tags({"baseline": adv.baseline.tolist(), "std": adv.std.tolist()}), rewards, adv


def named_rewards(
    cfg: GRPOConfig, tasks: list[str], components: list[dict[str, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``reward_components`` column as ``(components, weights)``, each [N, K] float32 over the run's reward names
    (:func:`rl.scoring.all_reward_names`, sorted): a sample's value of each named reward (NaN where it does not apply)
    and that reward's weight in the sample's task (0 where the task has no such reward)."""
    per_task = reward_names(cfg)
    names = sorted({n for task in per_task.values() for n in task})
    values = torch.tensor(
        [[float("nan") if c.get(n) is None else float(c[n]) for n in names] for c in components], dtype=torch.float32
    )
    weights = torch.tensor([[per_task.get(t, {}).get(n, 0.0) for n in names] for t in tasks], dtype=torch.float32)
    return values.reshape(len(components), len(names)), weights.reshape(len(tasks), len(names))


def train_fields(cfg: GRPOConfig) -> list[str]:
    """The columns the update reads: ``DP_TRAIN_FIELDS``, less ``prev_logprobs`` on-policy (none were written)."""
    return [f for f in F.DP_TRAIN_FIELDS if not (f == F.PREV_LOGPROBS and cfg.on_policy)]


def update(cfg: GRPOConfig, policy: DataPlanePolicy, train_meta: KVBatchMeta, *, step: int) -> dict[str, float]:
    """The optimizer updates of step ``step`` on the rows of ``train_meta`` (``optim.train_global_batch_size`` rows
    each), seeded by the step (``step_seed(grpo.seed, step, "train")``) so that the trainer's RNG state after it is a
    function of the step.

    Returns:
        the update's metrics (:meth:`DataPlanePolicy.train_from_meta`: ``loss``, ``kl_penalty``, ...,
        ``total_num_tokens``).
    """
    seed_all(step_seed(cfg.grpo.seed, step, "train"))
    return policy.train_from_meta(train_meta, fields=train_fields(cfg), rows_per_update=cfg.global_batch_size)
