"""Scoring a rollout's completions with the environments of their tasks (NeMo-RL's ``task_to_env``): each sample
goes to the environment its problem's task names, as a message log with its metadata, and comes back with its
weighted reward and its named rewards.

Owns the mapping from problems and completions to environment calls, and the per-process environments of a config;
the environments themselves are :mod:`rl.environments`.
"""

from __future__ import annotations

import atexit
import json
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl.data import Problem
from rl.prompts import prompt_messages

if TYPE_CHECKING:
    from rl.config import GRPOConfig
    from rl.environments import EnvironmentInterface


@dataclass
class Scores:
    """What the environments said about N completions.

    Attributes:
        rewards: [N] the weighted sum of each sample's named rewards (``train/reward`` averages it).
        components: [N] each sample's named rewards, ``{name: value}`` over every reward name of the run (NaN where
            a reward does not apply: another task's, or a reward function that returned None).
        metrics: the environments' own metrics (``global_post_process_and_metrics``), ``{task}/{name}``.
    """

    rewards: list[float] = field(default_factory=list)
    components: list[dict[str, float]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def reward_names(cfg: GRPOConfig) -> dict[str, dict[str, float]]:
    """Task -> its named rewards and their weights, from the config alone (no environment is built): a reward
    function's ``name`` (default: the function's name in its ``module:function`` reference) and ``weight`` (default
    1); reasoning-gym's scorer is one reward, ``reasoning_gym``, of weight 1."""
    out: dict[str, dict[str, float]] = {}
    for task, spec in cfg.task_specs().items():
        if "reward_functions" in spec:
            out[task] = {
                str(f.get("name") or str(f["function"]).rsplit(":", 1)[-1]): float(f.get("weight", 1.0))
                for f in spec["reward_functions"]
            }
        elif "environment" in spec:
            out[task] = environment_class_rewards(task, spec["environment"])
        else:
            out[task] = {"reasoning_gym": 1.0}
    return out


def environment_class_rewards(task: str, spec: Any) -> dict[str, float]:
    """The named rewards of an environment class (``env.tasks.<task>.environment.class``): its class attribute
    ``reward_weights``, read without building it.

    Raises:
        rl.environments.RewardConfigError: the class cannot be loaded or declares no ``reward_weights`` mapping.
    """
    from rl.environments.registry import environment_class

    ref = spec.get("class") if isinstance(spec, dict) else None
    cls = environment_class(str(ref), where=f"env.tasks.{task}.environment.class")
    weights = cls.reward_weights  # checked there: a non-empty mapping
    return {str(k): float(v) for k, v in weights.items()}


def all_reward_names(cfg: GRPOConfig) -> list[str]:
    """Every named reward of the run, sorted: the fields of the ``reward_components`` column."""
    return sorted({name for names in reward_names(cfg).values() for name in names})


def score_completions(
    envs: dict[str, EnvironmentInterface],
    owners: list[Problem],
    responses: list[str],
    response_token_ids: list[list[int]],
    cfg: GRPOConfig,
) -> Scores:
    """Score N completions, task by task, each batch of a task in one ``step`` call of its environment.

    The message log of sample i is its prompt's messages (:func:`rl.prompts.prompt_messages`) and the assistant's
    ``{"role": "assistant", "content": response, "token_ids": [...]}``; its metadata is its problem's ``entry`` with
    ``prompt`` (the prompt as the dataset gave it), ``row_id``, ``task_name`` and, when ``data.answer_key`` names
    another column, ``answer``.

    Args:
        envs: task name -> environment (:func:`environments`).
        owners: [N] the problem of each completion.
        responses: [N] the completions' text.
        response_token_ids: [N] the completions' token ids.
        cfg: the run's config (``data.system_prompt``, ``data.apply_chat_template``, ``data.answer_key``).

    Raises:
        ValueError: a problem's task has no environment (naming the row and the known tasks).
        rl.environments.RewardError: a reward function failed (:mod:`rl.environments.workers`).
    """
    from rl.environments import weighted_total

    d = cfg.data
    names = all_reward_names(cfg)
    by_task: dict[str, list[int]] = {}
    for i, p in enumerate(owners):
        by_task.setdefault(p.task, []).append(i)
    out = Scores(rewards=[0.0] * len(owners), components=[{} for _ in owners])
    for task, rows in by_task.items():
        env = envs.get(task)
        if env is None:
            p = owners[rows[0]]
            msg = (
                f"row {p.row_id!r} has task {task!r}, which no environment scores (env.tasks has {sorted(envs)}); "
                "add it to env.tasks or fix the row's data.task_key column"
            )
            raise ValueError(msg)
        logs, metadata = [], []
        for i in rows:
            p = owners[i]
            messages = prompt_messages(p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
            reply = {"role": "assistant", "content": responses[i], "token_ids": list(response_token_ids[i])}
            logs.append([*messages, reply])
            metadata.append(episode_metadata(p, d.answer_key))
        ret = env.step(logs, metadata)
        total = weighted_total(ret.rewards, env.reward_weights, row_ids=[m["row_id"] for m in metadata])  # [rows]
        named = ret.rewards if isinstance(ret.rewards, dict) else {next(iter(env.reward_weights)): ret.rewards}
        for j, i in enumerate(rows):
            out.rewards[i] = float(total[j])
            out.components[i] = {n: float(named[n][j]) if n in named else math.nan for n in names}
        _, metrics = env.global_post_process_and_metrics({"rewards": total, "message_log": logs, "metadata": metadata})
        out.metrics.update({f"{task}/{k}": float(v) for k, v in metrics.items()})
    return out


def episode_metadata(p: Problem, answer_key: str | None) -> dict[str, Any]:
    """What an environment receives about a sample besides its messages: the problem's ``entry``, with ``prompt``
    (as the dataset gave it), ``row_id``, ``task_name`` and, where ``answer_key`` names a column, ``answer``."""
    meta = dict(p.entry)
    if answer_key is not None and "answer" not in meta:
        meta["answer"] = p.answer
    meta["prompt"] = [dict(m) for m in p.messages] if p.messages is not None else p.question
    meta["row_id"] = p.row_id
    meta["task_name"] = p.task
    return meta


_BUILT: dict[str, Future] = {}
_LOCK = threading.Lock()
_BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpoflow-environments")


def environments(cfg: GRPOConfig, *, wait: bool = True) -> dict[str, EnvironmentInterface] | None:
    """The config's environments (task -> environment, :func:`rl.environments.registry.build_environments`), built
    once per process and config, in a background thread, and closed when the process exits or asks for another
    config's (their worker processes with them).

    ``wait=False`` starts the build and returns None at once: the rollout calls it before generating, so that the
    reward workers start (and import the reward code) while the model generates; the scoring call then waits for them.

    Raises:
        what building them raises (:class:`rl.environments.RewardError`, ValueError), on the call that waits; a
            failed build is not kept, the next call tries again.
    """
    specs = cfg.task_specs()
    key = json.dumps([specs, cfg.env.num_workers, cfg.env.timeout_s], sort_keys=True, default=str)
    with _LOCK:
        future = _BUILT.get(key)
        stale = [] if future is not None else [_BUILT.pop(k) for k in list(_BUILT)]
        if future is None:
            future = _BUILT[key] = _BUILDER.submit(_build, cfg, specs)
    _close(stale)  # another config's: a process scores with one config at a time, its idle workers go
    if not wait:
        return None
    try:
        return future.result()
    except BaseException:
        with _LOCK:
            if _BUILT.get(key) is future:
                del _BUILT[key]
        raise


def _build(cfg: GRPOConfig, specs: dict[str, Any]) -> dict[str, EnvironmentInterface]:
    from rl.environments.registry import build_environments

    d = cfg.data
    return build_environments(
        specs,
        num_workers=cfg.env.num_workers,
        timeout_s=cfg.env.timeout_s,
        reasoning_gym_defaults={"dataset": d.dataset, "dataset_kwargs": dict(d.dataset_kwargs), "seed": d.seed},
    )


def close_environments() -> None:
    """Close every environment :func:`environments` built (idempotent)."""
    with _LOCK:
        futures = list(_BUILT.values())
        _BUILT.clear()
    _close(futures)


def _close(futures: list[Future]) -> None:
    for future in futures:
        try:
            envs = future.result()
        except BaseException:  # noqa: BLE001 - a build that failed has nothing to close; its caller saw the error
            continue
        for env in envs.values():
            env.close()


atexit.register(close_environments)
