"""The environment interface: what scores a batch of rollouts of one task, and the errors of reward code.

After NeMo-RL's ``nemo_rl/environments/interfaces.py`` (``EnvironmentInterface``, ``EnvironmentReturn``). Named
rewards and their weighted total follow TRL's ``GRPOTrainer`` (``reward_weights``, ``None`` rewards as NaN summed with
``nansum``), except that a sample with no applicable reward at all is an error here, never a silent 0.

torch is imported inside the functions that build tensors, so worker processes that import this module for its errors
stay free of it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RewardError(RuntimeError):
    """A reward could not be computed: the reward code hung, crashed, raised or returned something that is not a
    reward, or a sample has no applicable reward. The message names the reward function, the first offending sample
    (its index in the batch and its ``row_id``) and the fix."""


class RewardConfigError(ValueError):
    """An environment or reward-function entry of the config is malformed or cannot be loaded; the message names the
    entry (``env.tasks.<task>...``) and the fix."""


@dataclass
class EnvironmentReturn:
    """What ``EnvironmentInterface.step`` returns for a batch of ``B`` samples.

    Attributes:
        observations: ``[B]`` the next message per sample (``{"role": "environment", "content": ""}`` single-turn).
        metadata: ``[B]`` carried to the next turn (None when the sample is done).
        next_stop_strings: ``[B]`` stop strings for the next generation turn, or None.
        rewards: ``[B]`` float32, or named ``[B]`` float32 tensors (NaN: that reward does not apply to the sample).
        terminateds: ``[B]`` bool, all True single-turn.
        answers: ``[B]`` the answer extracted from each completion, for logs (None where there is none).
    """

    observations: list[dict[str, str]]
    metadata: list[dict | None]
    next_stop_strings: list[list[str] | None]
    rewards: torch.Tensor | dict[str, torch.Tensor]
    terminateds: torch.Tensor
    answers: list[str | None]


class EnvironmentInterface(abc.ABC):
    """Scores the rollouts of one task; NeMo-RL's ``EnvironmentInterface``.

    ``step`` receives per sample the message log (the prompt messages, then the assistant's message
    ``{"role": "assistant", "content": str, "token_ids": list[int]}``) and the metadata (the row's columns except the
    prompt, plus ``"prompt"``, ``"row_id"`` and ``"task_name"``). Environments that run reward code in worker
    processes stop them in ``close`` (idempotent); an environment is also a context manager that closes on exit.

    Attributes:
        reward_weights: reward name -> weight of that reward in the total (``weighted_total``); a single-reward
            environment has ``{"<its name>": 1.0}``.
    """

    reward_weights: dict[str, float]

    @abc.abstractmethod
    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """Score one turn of ``B`` samples (``len(message_log_batch) == len(metadata) == B``)."""

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict[str, float]]:
        """Once per rollout, after the last turn: the batch (possibly changed) and metrics to log; default: as is."""
        return batch, {}

    def close(self) -> None:  # noqa: B027 - environments without workers have nothing to stop
        """Stop worker processes, if any; idempotent."""

    def __enter__(self) -> EnvironmentInterface:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def single_turn_return(
    rewards: torch.Tensor | dict[str, torch.Tensor], metadata: list[dict], answers: list[str | None]
) -> EnvironmentReturn:
    """The ``EnvironmentReturn`` of a single-turn environment: empty environment messages, every sample terminated."""
    import torch

    n = len(metadata)
    return EnvironmentReturn(
        observations=[{"role": "environment", "content": ""} for _ in range(n)],
        metadata=list(metadata),
        next_stop_strings=[None] * n,
        rewards=rewards,
        terminateds=torch.ones(n, dtype=torch.bool),
        answers=list(answers),
    )


def _sample(i: int, row_ids: Sequence[str | None] | None) -> str:
    row = row_ids[i] if row_ids is not None and i < len(row_ids) else None
    return f"sample {i} of the batch" + (f" (row_id {row!r})" if row is not None else "")


def weighted_total(
    rewards: torch.Tensor | Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    *,
    row_ids: Sequence[str | None] | None = None,
) -> torch.Tensor:
    """The scalar reward per sample, ``[B]`` float32.

    A tensor ``[B]`` passes through (as float32). Named rewards give ``sum_k w_k * r_k`` over the names whose reward
    is not NaN for that sample (TRL ``GRPOTrainer``: ``nansum(rewards_per_func * reward_weights)``).

    Args:
        rewards: ``[B]`` tensor, or reward name -> ``[B]`` tensor (NaN: does not apply).
        weights: reward name -> weight; must name exactly the rewards of a dict.
        row_ids: ``[B]`` optional, to name a failing sample by its dataset row.

    Raises:
        RewardError: a tensor reward is NaN, or every named reward of a sample is NaN (TRL warns and gives 0 there),
            naming the first such sample; or the names of ``rewards`` and ``weights`` differ.
    """
    import torch

    if isinstance(rewards, torch.Tensor):
        total = rewards.to(torch.float32)
        bad = torch.isnan(total).nonzero().flatten()
        if len(bad):
            msg = (
                f"the reward of {_sample(int(bad[0]), row_ids)} is NaN ({len(bad)} of {len(total)} samples). A "
                "single-reward environment must give every sample a number; return named rewards to mark rewards "
                "that do not apply."
            )
            raise RewardError(msg)
        return total
    if set(rewards) != set(weights):
        msg = (
            f"the environment returned rewards {sorted(rewards)} but its reward_weights name {sorted(weights)}; "
            "give every reward exactly one weight."
        )
        raise RewardError(msg)
    if not rewards:
        raise RewardError("the environment returned no rewards at all; configure at least one reward function.")
    names = sorted(rewards)
    stacked = torch.stack([rewards[k].to(torch.float32) for k in names], dim=1)  # [B, K]
    w = torch.tensor([float(weights[k]) for k in names], dtype=torch.float32)
    none_apply = torch.isnan(stacked).all(dim=1).nonzero().flatten()
    if len(none_apply):
        msg = (
            f"no reward applies to {_sample(int(none_apply[0]), row_ids)}: every one of {names} returned None for it "
            f"({len(none_apply)} of {len(stacked)} samples alike). Make at least one reward function return a number "
            "for every sample (None means 'does not apply'), or drop such rows from the dataset."
        )
        raise RewardError(msg)
    return torch.nansum(stacked * w, dim=1)
