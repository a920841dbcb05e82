"""A rollout's samples grouped by problem, before they become data-plane columns: what the single-turn rollout
(`rl.rollout`) and the multi-turn loop (`rl.multi_turn`) both produce."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl.data import Problem


@dataclass
class Groups:
    """Completions grouped by problem, row-major (group-contiguous), before they become columns."""

    problems: list[Problem] = field(default_factory=list)
    input_ids: list[torch.Tensor] = field(default_factory=list)
    generation_logprobs: list[torch.Tensor] = field(default_factory=list)
    token_mask: list[torch.Tensor] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward_components: list[dict[str, float]] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    """The model's tokens of each sample (every turn's, in a multi-turn episode)."""
    turns: list[int] = field(default_factory=list)
    """Assistant turns of each sample (1 single-turn)."""
    turns_at_max_new_tokens: list[int] = field(default_factory=list)
    """Of those, the turns that ended at ``generation.max_new_tokens`` with neither EOS nor a stop string (a reply cut
    short: the environment saw it unfinished); single-turn: 1 for a truncated completion."""
    environment_tokens: list[int] = field(default_factory=list)
    """Tokens of each sample's environment turns (``token_mask`` 0; none single-turn)."""
    truncated_by: list[str] = field(default_factory=list)
    """Multi-turn: why a truncated episode ended, ``"turns"`` or ``"length"``; ``""`` otherwise."""
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The environments' own metrics (``global_post_process_and_metrics``), ``{task}/{name}``; of the last batch
    scored when groups are joined."""

    def take(self, groups: list[int], g: int) -> Groups:
        rows = [b * g + i for b in groups for i in range(g)]
        out = Groups(problems=[self.problems[b] for b in groups], env_metrics=dict(self.env_metrics))
        for name in (
            "input_ids",
            "generation_logprobs",
            "token_mask",
            "responses",
            "rewards",
            "reward_components",
            "truncated",
            "prompt_lengths",
            "response_lengths",
            "turns",
            "turns_at_max_new_tokens",
            "environment_tokens",
            "truncated_by",
        ):
            values = getattr(self, name)
            setattr(out, name, [values[r] for r in rows] if values else [])  # a field nobody filled stays empty
        return out

    def extend(self, other: Groups) -> None:
        for name, value in vars(other).items():
            if name == "env_metrics":
                self.env_metrics.update(value)
            else:
                getattr(self, name).extend(value)
