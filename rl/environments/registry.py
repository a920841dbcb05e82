"""Environments of a run from its config: ``env.tasks`` maps each task name to one environment spec, either
``{"reasoning_gym": {"dataset": str, "dataset_kwargs": {...}, "seed": int}}`` (each value defaulting to the run's
data settings) or ``{"reward_functions": [{"function": "module:fn", "weight": 1.0, "name": "..."}, ...]}``.

All environments of one ``build_environments`` call share one pool of reward worker processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rl.environments.interfaces import EnvironmentInterface, RewardConfigError
from rl.environments.reasoning_gym import SCORER, ReasoningGymEnvironment
from rl.environments.reward_functions import (
    RewardFunctionEnvironment,
    check_reward_function,
    source_hash,
    specs_from_config,
)
from rl.environments.workers import RewardWorkerPool, split_ref

KINDS = ("reasoning_gym", "reward_functions")
RG_KEYS = ("dataset", "dataset_kwargs", "seed")
RF_KEYS = ("function", "weight", "name")


def _err(where: str, problem: str, fix: str) -> RewardConfigError:
    return RewardConfigError(f"{where} {problem}. {fix}")


def check_environment_specs(
    specs: Mapping[str, Any], *, check_functions: bool = True, task_paths: Mapping[str, str] | None = None
) -> None:
    """Config-time check of ``env.tasks``: each task has exactly one known environment kind with well-typed values, and
    (with ``check_functions``) every reward function reference loads (``check_reward_function``).

    Args:
        specs: task name -> environment spec (module docstring).
        check_functions: also load every reward function (imports its module in this process).
        task_paths: task name -> where the user wrote its spec, for messages (default ``env.tasks.<task>``; e.g.
            ``{"default": "env"}`` for a spec made from ``env.reward_functions``).

    Raises:
        RewardConfigError: naming the entry (``env.tasks.<task>...``) and the fix.
    """
    if not isinstance(specs, Mapping):
        raise _err("env.tasks", f"is a {type(specs).__name__}", "Give a mapping: task name -> environment spec.")
    example = '{"reward_functions": [{"function": "rl.environments.rewards:math_verify_accuracy"}]}'
    for task, spec in specs.items():
        where = (task_paths or {}).get(task, f"env.tasks.{task}")
        if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            got = sorted(spec) if isinstance(spec, Mapping) else type(spec).__name__
            raise _err(where, f"is {got}", f"Give exactly one of {list(KINDS)}, e.g. {example}.")
        kind, body = next(iter(spec.items()))
        where = f"{where}.{kind}"
        if kind == "reasoning_gym":
            _check_reasoning_gym(where, body)
        else:
            _check_reward_functions(where, body, check_functions)


def _check_reasoning_gym(where: str, body: Any) -> None:
    body = {} if body is None else body
    if not isinstance(body, Mapping):
        raise _err(where, f"is a {type(body).__name__}", f"Give a mapping with keys among {list(RG_KEYS)} (or {{}}).")
    unknown = sorted(set(body) - set(RG_KEYS))
    if unknown:
        raise _err(where, f"has unknown keys {unknown}", f"Use only {list(RG_KEYS)}.")
    types = {"dataset": str, "dataset_kwargs": Mapping, "seed": int}
    for key, value in body.items():
        if not isinstance(value, types[key]) or isinstance(value, bool):
            raise _err(f"{where}.{key}", f"is {value!r}", f"Give a {types[key].__name__}.")


def _check_reward_functions(where: str, body: Any, check_functions: bool) -> None:
    if not isinstance(body, list) or not body:
        raise _err(where, f"is {body!r}", 'Give a non-empty list of {"function": "module:fn", "weight": 1.0}.')
    names: dict[str, int] = {}
    for i, entry in enumerate(body):
        at = f"{where}[{i}]"
        if isinstance(entry, str):
            entry = {"function": entry}
        if not isinstance(entry, Mapping) or "function" not in entry:
            raise _err(at, f"is {entry!r}", 'Give {"function": "package.module:function", "weight": 1.0, "name": ""}.')
        unknown = sorted(set(entry) - set(RF_KEYS))
        if unknown:
            raise _err(at, f"has unknown keys {unknown}", f"Use only {list(RF_KEYS)}.")
        ref = entry["function"]
        if not isinstance(ref, str):
            raise _err(f"{at}.function", f"is {ref!r}", "Give a string 'package.module:function'.")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise _err(f"{at}.weight", f"is {weight!r}", "Give a finite number.")
        name = entry.get("name", "")
        if not isinstance(name, str):
            raise _err(f"{at}.name", f"is {name!r}", "Give a string, or leave it out to use the function's name.")
        try:
            name = name or split_ref(ref)[1]
        except ValueError as err:
            raise _err(
                f"{at}.function", str(err), "Write 'package.module:function' or 'path/file.py:function'."
            ) from None
        if name in names:
            raise _err(
                f"{at}", f"has the reward name {name!r} of entry [{names[name]}]", "Give one of them a distinct name."
            )
        names[name] = i
        if check_functions:
            check_reward_function(ref, where=f"{at}.function")


def _normalize(specs: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    out = {}
    for task, spec in specs.items():
        kind, body = next(iter(spec.items()))
        if kind == "reward_functions":
            body = [{"function": e} if isinstance(e, str) else dict(e) for e in body]
        out[task] = (kind, body)
    return out


def _rg_settings(body: Mapping[str, Any] | None, defaults: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**dict(defaults), **dict(body or {})}
    missing = [k for k in RG_KEYS if k not in merged]
    if missing:
        raise RewardConfigError(f"reasoning_gym environment lacks {missing} and no default gives them; set them")
    return {"dataset": merged["dataset"], "dataset_kwargs": dict(merged["dataset_kwargs"]), "seed": int(merged["seed"])}


def build_environments(
    specs: Mapping[str, Any],
    *,
    num_workers: int,
    timeout_s: float,
    reasoning_gym_defaults: Mapping[str, Any],
) -> dict[str, EnvironmentInterface]:
    """``task_to_env``: one environment per task of ``specs`` (checked first), all on one shared worker pool that
    stops when the last of them is closed.

    Args:
        specs: task name -> environment spec (module docstring).
        num_workers: reward worker processes.
        timeout_s: seconds a reward function (or the reasoning-gym scorer) may take on one batch.
        reasoning_gym_defaults: ``dataset``, ``dataset_kwargs``, ``seed`` for values a reasoning_gym spec leaves out.

    Raises:
        RewardConfigError: a malformed spec. RewardError: a reward function fails to load in the workers.
    """
    check_environment_specs(specs)
    pool = RewardWorkerPool(num_workers, timeout_s)
    envs: dict[str, EnvironmentInterface] = {}
    pool.attach()  # held while building, so an environment failing half-way does not stop the pool under the others
    try:
        normalized = _normalize(specs)
        refs = [e["function"] for kind, body in normalized.values() if kind == "reward_functions" for e in body]
        has_rg = any(kind == "reasoning_gym" for kind, _ in normalized.values())
        # Every function and module up front: the pool starts once, not once per environment.
        pool.warm_up([*([SCORER] if has_rg else []), *refs], modules=["reasoning_gym"] if has_rg else [])
        for task, (kind, body) in normalized.items():
            if kind == "reasoning_gym":
                rg = _rg_settings(body, reasoning_gym_defaults)
                envs[task] = ReasoningGymEnvironment(**rg, num_workers=num_workers, timeout_s=timeout_s, pool=pool)
            else:
                envs[task] = RewardFunctionEnvironment(
                    specs_from_config(body), num_workers=num_workers, timeout_s=timeout_s, pool=pool
                )
    except BaseException:
        for env in envs.values():
            env.close()
        pool.shutdown()
        raise
    pool.close()
    return envs


def describe_environments(
    specs: Mapping[str, Any], *, reasoning_gym_defaults: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """MLflow params: ``"env.<task>.<reward name>"`` -> ``"<module:function> <sha256 of its source file>[:12]"``
    (a reasoning_gym task: the scorer's, followed by ``dataset=<name>``).

    Raises:
        FileNotFoundError: a reference's module or file does not exist (``check_environment_specs`` first).
    """
    out: dict[str, str] = {}
    for task, (kind, body) in _normalize(specs).items():
        if kind == "reasoning_gym":
            dataset = {**dict(reasoning_gym_defaults or {}), **dict(body or {})}.get("dataset", "?")
            out[f"env.{task}.{ReasoningGymEnvironment.reward_name}"] = (
                f"{SCORER} {source_hash(SCORER)[:12]} dataset={dataset}"
            )
        else:
            for spec in specs_from_config(body):
                out[f"env.{task}.{spec.reward_name}"] = f"{spec.function} {source_hash(spec.function)[:12]}"
    return out
