"""Environments of a run from its config: ``env.tasks`` maps each task name to one environment spec, one of

- ``{"reasoning_gym": {"dataset": str, "dataset_kwargs": {...}, "seed": int}}`` (each value defaulting to the run's
  data settings);
- ``{"reward_functions": [{"function": "module:fn", "weight": 1.0, "name": "..."}, ...]}``;
- ``{"environment": {"class": "package.module:ClassName" or "path/to/file.py:ClassName", "kwargs": {...}}}``: an
  ``EnvironmentInterface`` subclass of your own (NeMo-RL's ``task_to_env`` entries are such instances), constructed
  as ``ClassName(**kwargs)`` in the process that builds the environments (not in a worker process).

All reward-function and reasoning-gym environments of one ``build_environments`` call share one pool of reward worker
processes; environment classes run their own code in the calling process.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Mapping
from typing import Any

from dataplane.urls import is_secret_key
from rl.environments.interfaces import EnvironmentInterface, RewardConfigError
from rl.environments.reasoning_gym import SCORER, ReasoningGymEnvironment
from rl.environments.reward_functions import (
    RewardFunctionEnvironment,
    check_reward_function,
    source_hash,
    specs_from_config,
)
from rl.environments.workers import RewardWorkerPool, load_function, module_source, split_ref

KINDS = ("reasoning_gym", "reward_functions", "environment")
RG_KEYS = ("dataset", "dataset_kwargs", "seed")
RF_KEYS = ("function", "weight", "name")
ENV_KEYS = ("class", "kwargs")
CLASS_FORMS = "'package.module:ClassName' or 'path/to/file.py:ClassName' (relative to the run's folder)"


def _err(where: str, problem: str, fix: str) -> RewardConfigError:
    return RewardConfigError(f"{where} {problem}. {fix}")


def check_environment_specs(
    specs: Mapping[str, Any], *, check_functions: bool = True, task_paths: Mapping[str, str] | None = None
) -> None:
    """Config-time check of ``env.tasks``: each task has exactly one known environment kind with well-typed values, and
    (with ``check_functions``) every reward function reference loads (``check_reward_function``) and every
    environment class loads, subclasses ``EnvironmentInterface`` with no abstract method left, declares its rewards
    in a class attribute ``reward_weights`` and takes its ``kwargs`` (``inspect.signature(cls).bind(**kwargs)``).

    Args:
        specs: task name -> environment spec (module docstring).
        check_functions: also load every reward function and environment class (imports its module in this
            process); without it only the shape of each spec is checked.
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
        elif kind == "environment":
            _check_environment_class(where, body, check_functions)
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


def _check_environment_class(where: str, body: Any, check_functions: bool) -> None:
    example = '{"class": "package.module:ClassName", "kwargs": {...}}'
    if not isinstance(body, Mapping) or "class" not in body:
        raise _err(where, f"is {body!r}", f"Give {example}.")
    unknown = sorted(set(body) - set(ENV_KEYS))
    if unknown:
        raise _err(where, f"has unknown keys {unknown}", f"Use only {list(ENV_KEYS)}.")
    ref, kwargs = body["class"], body.get("kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(ref, str):
        raise _err(f"{where}.class", f"is {ref!r}", f"Give a string {CLASS_FORMS}.")
    try:
        split_ref(ref)
    except ValueError:
        raise _err(f"{where}.class", f"is {ref!r}, not a class reference", f"Write {CLASS_FORMS}.") from None
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise _err(
            f"{where}.kwargs", f"is {kwargs!r}", "Give a mapping of keyword arguments for the class's __init__ (or {})."
        )
    if check_functions:
        environment_class(ref, where=f"{where}.class", kwargs=kwargs, kwargs_where=f"{where}.kwargs")


def environment_class(
    ref: str, *, where: str = "environment class", kwargs: Mapping[str, Any] | None = None, kwargs_where: str = ""
) -> type[EnvironmentInterface]:
    """Load an environment class reference and check it (imports its module, or executes its file, in this process).

    Loaded with the reward functions' loader (``rl.environments.workers.load_function``: a module is imported, a file
    is executed once per process as a module of its own).

    Args:
        ref: ``"package.module:ClassName"`` or ``"path/to/file.py:ClassName"``.
        where: the config entry, for messages (e.g. ``"env.tasks.puzzle.environment.class"``).
        kwargs: when given, checked to bind to the class's ``__init__`` (``inspect.signature(cls).bind(**kwargs)``).
        kwargs_where: the config entry of ``kwargs``, for messages (default: ``where``).

    Returns:
        The class.

    Raises:
        RewardConfigError: the reference is malformed, its module or file is missing or fails to import, it does not
            name an ``EnvironmentInterface`` subclass, the class leaves abstract methods unimplemented or has no
            class attribute ``reward_weights`` (a non-empty dict), or ``kwargs`` do not fit its ``__init__``; naming
            the entry and the fix.
    """
    fix = f"Point it at an EnvironmentInterface subclass, {CLASS_FORMS}."
    try:
        split_ref(ref)
        module_source(ref)
    except (ValueError, FileNotFoundError) as err:
        raise _err(where, f"{ref!r} cannot be found ({err})", fix) from None
    except Exception as err:  # noqa: BLE001 - a parent package's own import error, reported with its type
        raise _err(
            where, f"{ref!r} fails to import: {type(err).__name__}: {err}", "Fix the module so it imports."
        ) from None
    try:
        cls = load_function(ref)
    except (AttributeError, TypeError) as err:
        raise _err(where, f"{ref!r} does not name a class ({err})", fix) from None
    except Exception as err:  # noqa: BLE001 - the user module's own error, reported with its type
        raise _err(
            where, f"{ref!r} fails to import: {type(err).__name__}: {err}", "Fix the module so it imports."
        ) from None
    if not isinstance(cls, type) or not issubclass(cls, EnvironmentInterface):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise _err(
            where,
            f"{ref!r} is {what}, not a subclass of rl.environments.EnvironmentInterface",
            "Subclass rl.environments.EnvironmentInterface and implement step(message_log_batch, metadata) "
            "(docs/environments.md, 'The environment interface').",
        )
    if inspect.isabstract(cls):
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        raise _err(where, f"{ref!r} leaves the abstract methods {missing} unimplemented", "Implement them.")
    weights = getattr(cls, "reward_weights", None)
    if not isinstance(weights, dict) or not weights:
        raise _err(
            where,
            f"{ref!r} has the reward_weights {weights!r}, not a class attribute naming its rewards",
            'Give the class reward_weights = {"<reward name>": 1.0, ...} naming the rewards its step returns (the '
            "run's metrics and advantages read it from the config, before any environment is built).",
        )
    if kwargs is not None:
        try:
            sig = inspect.signature(cls).replace(return_annotation=inspect.Signature.empty)
        except (TypeError, ValueError):
            return cls  # no introspectable signature: the constructor itself will tell
        try:
            sig.bind(**kwargs)
        except TypeError as err:
            raise _err(
                kwargs_where or where,
                f"{dict(kwargs)!r} do not fit {cls.__name__}{sig} ({err})",
                f"Give only keyword arguments that {cls.__name__}.__init__ takes, and every one it requires.",
            ) from None
    return cls


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
        elif kind == "environment":
            body = {"class": body["class"], "kwargs": dict(body.get("kwargs") or {})}
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
    """``task_to_env``: one environment per task of ``specs`` (checked first), the reward-function and reasoning-gym
    ones on one shared worker pool that stops when the last of them is closed; an ``environment`` class is
    constructed here as ``cls(**kwargs)`` (its ``close`` is its own).

    Args:
        specs: task name -> environment spec (module docstring).
        num_workers: reward worker processes.
        timeout_s: seconds a reward function (or the reasoning-gym scorer) may take on one batch.
        reasoning_gym_defaults: ``dataset``, ``dataset_kwargs``, ``seed`` for values a reasoning_gym spec leaves out.

    Raises:
        RewardConfigError: a malformed spec, or an environment class whose constructor raises (chained to the cause).
        RewardError: a reward function fails to load in the workers.
    """
    check_environment_specs(specs)
    pool = RewardWorkerPool(num_workers, timeout_s)
    envs: dict[str, EnvironmentInterface] = {}
    pool.attach()  # held while building, so an environment failing half-way does not stop the pool under the others
    try:
        normalized = _normalize(specs)
        refs = [e["function"] for kind, body in normalized.values() if kind == "reward_functions" for e in body]
        has_rg = any(kind == "reasoning_gym" for kind, _ in normalized.values())
        if has_rg or refs:  # environment classes alone need no worker processes
            # Every function and module up front: the pool starts once, not once per environment.
            pool.warm_up([*([SCORER] if has_rg else []), *refs], modules=["reasoning_gym"] if has_rg else [])
        for task, (kind, body) in normalized.items():
            if kind == "environment":
                envs[task] = _construct(f"env.tasks.{task}.environment.class", body)
            elif kind == "reasoning_gym":
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


def _construct(where: str, body: Mapping[str, Any]) -> EnvironmentInterface:
    cls = environment_class(body["class"], where=where)
    try:
        env = cls(**body["kwargs"])
    except Exception as err:
        raise _err(
            where,
            f"{body['class']!r} raised {type(err).__name__}: {err} when constructed with kwargs {body['kwargs']!r}",
            "Fix the kwargs, or the class's __init__.",
        ) from err
    if not isinstance(getattr(env, "reward_weights", None), dict):
        env.close()
        raise _err(
            where,
            f"{body['class']!r} built an environment without a reward_weights dict",
            'Set self.reward_weights = {"<reward name>": 1.0} (a class attribute or in __init__).',
        )
    return env


def _redacted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): "***" if is_secret_key(str(k)) else _redacted(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def describe_environments(
    specs: Mapping[str, Any], *, reasoning_gym_defaults: Mapping[str, Any] | None = None
) -> dict[str, str]:
    """MLflow params: ``"env.<task>.<reward name>"`` -> ``"<module:function> <sha256 of its source file>[:12]"``
    (a reasoning_gym task: the scorer's, followed by ``dataset=<name>``); an environment class task:
    ``"env.<task>.environment"`` -> ``"<module:Class> <sha256 of its source file>[:12] kwargs=<JSON, keys sorted>"``
    (`` kwargs=...`` left out when there are none), where the value of every key that looks like a credential
    (``dataplane.urls.is_secret_key``: ``token``, ``api_key``, ``password``, ...) is ``"***"``, at any depth.

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
        elif kind == "environment":
            ref, kwargs = body["class"], body["kwargs"]
            shown = f" kwargs={json.dumps(_redacted(kwargs), sort_keys=True, default=str)}" if kwargs else ""
            out[f"env.{task}.environment"] = f"{ref} {source_hash(ref)[:12]}{shown}"
        else:
            for spec in specs_from_config(body):
                out[f"env.{task}.{spec.reward_name}"] = f"{spec.function} {source_hash(spec.function)[:12]}"
    return out
