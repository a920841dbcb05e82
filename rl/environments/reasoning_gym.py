"""The default environment: a reasoning-gym dataset scores each completion with its own ``score_answer``.

The reward is exactly ``rl.data.score``'s, ``float(ds.score_answer(answer=extract_answer(completion), entry=entry))``,
computed in the reward worker processes like any user reward function, so the default run pays what a user's run pays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl.data import _dataset, extract_answer
from rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, RewardError, single_turn_return
from rl.environments.reward_functions import completion_text
from rl.environments.workers import RewardWorkerPool

SCORER = "rl.environments.reasoning_gym:score_completions"
"""The worker-side scoring function's reference."""

NOT_ENTRY = ("prompt", "row_id", "task_name")
"""Metadata keys the rollout adds to a reasoning-gym entry."""


def score_completions(
    completions: list[str], entries: list[dict], *, dataset: str, dataset_kwargs: Mapping[str, Any], seed: int, **kwargs
) -> list[float]:
    """``[B]`` rewards in [0, 1]: ``ds.score_answer(answer=extract_answer(c), entry=e)`` per completion (runs in a
    worker; ``ds`` is the dataset ``rl.data`` builds for ``dataset``, ``dataset_kwargs``, ``seed``)."""
    ds = _dataset(dataset, tuple(sorted(dataset_kwargs.items())), seed)
    return [
        float(ds.score_answer(answer=extract_answer(c), entry=e)) for c, e in zip(completions, entries, strict=True)
    ]


class ReasoningGymEnvironment(EnvironmentInterface):
    """Scores completions of reasoning-gym problems; ``reward_weights == {"reasoning_gym": 1.0}``; single-turn.

    ``metadata[i]`` is the reasoning-gym entry (``question``, ``answer``, ``metadata``) plus ``prompt``, ``row_id``
    and ``task_name``, which are dropped before scoring.

    Args:
        dataset, dataset_kwargs, seed: the reasoning-gym dataset (as ``data.dataset``, ``data.dataset_kwargs``,
            ``seed`` of the run).
        num_workers: worker processes (when no ``pool`` is given).
        timeout_s: seconds the scorer may take on one batch.
        pool: a shared ``RewardWorkerPool`` to use instead of starting one.
        warm_up: start the workers and import reasoning-gym in them now.

    Raises:
        ValueError: not a valid reasoning-gym dataset (from ``rl.data``).
    """

    reward_name = "reasoning_gym"

    def __init__(
        self,
        dataset: str,
        dataset_kwargs: dict,
        seed: int,
        *,
        num_workers: int,
        timeout_s: float,
        pool: RewardWorkerPool | None = None,
        warm_up: bool = True,
    ) -> None:
        self.dataset, self.dataset_kwargs, self.seed = dataset, dict(dataset_kwargs), int(seed)
        _dataset(dataset, tuple(sorted(self.dataset_kwargs.items())), self.seed)  # a bad dataset fails here, clearly
        self.reward_weights = {self.reward_name: 1.0}
        self.timeout_s = float(timeout_s)
        self._pool = (pool or RewardWorkerPool(num_workers, timeout_s)).attach()
        self._attached = True
        if warm_up:
            try:
                self._pool.warm_up([SCORER], modules=["reasoning_gym"])
            except BaseException:
                self.close()
                raise

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """Rewards ``[B]`` float32 in [0, 1]; answers: the extracted answers.

        Raises:
            ValueError: the batch and metadata differ in length or a log does not end with the assistant's message.
            RewardError: the scorer failed (timeout, crash, exception).
        """
        import torch

        if not self._attached:
            raise RewardError("this ReasoningGymEnvironment is closed; build a new one")
        if len(message_log_batch) != len(metadata):
            raise ValueError(f"{len(message_log_batch)} message logs but {len(metadata)} metadata; give one per sample")
        completions = [completion_text(log, i)[0] for i, log in enumerate(message_log_batch)]
        entries = [{k: v for k, v in md.items() if k not in NOT_ENTRY} for md in metadata]
        n = len(metadata)
        values = self._pool.run(
            SCORER,
            {"completions": completions, "entries": entries},
            n,
            shared=self._shared(),
            row_ids=[md.get("row_id") for md in metadata],
            timeout_s=self.timeout_s,
        )
        rewards = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32).reshape(n)
        return single_turn_return(rewards, metadata, [extract_answer(c) for c in completions])

    def _shared(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "dataset_kwargs": self.dataset_kwargs, "seed": self.seed}

    def close(self) -> None:
        """Detach from the worker pool (stopping it when no other environment uses it); idempotent."""
        if self._attached:
            self._attached = False
            self._pool.close()
