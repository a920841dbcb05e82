"""Environments made of user reward functions written to TRL's ``GRPOTrainer`` signature, and their config checks.

A reward function is called exactly as TRL 1.x ``GRPOTrainer._calculate_rewards`` calls one::

    fn(prompts=[...], completions=[...], completion_ids=[[int, ...], ...], **{column: [value per sample]})

``prompts``: each sample's prompt as the dataset gave it (a str, or a list of ``{"role", "content"}`` messages);
``completions``: the completion text for a text prompt, ``[{"role": "assistant", "content": text}]`` for a messages
prompt (TRL's conversational format); ``completion_ids``: the completion's token ids; then every other column of the
row (``answer``, ``task_name``, ``row_id``, ...) as a list over the batch, and TRL's ``log_extra`` / ``log_metric``
callables (here they discard what they get; ``trainer_state`` is not passed). It returns one float per completion,
or None where the reward does not apply (TRL turns None into NaN, and so do we). Unlike TRL, the function runs in a
worker process (``rl.environments.workers``) and a sample that no reward applies to is an error (``weighted_total``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import inspect
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rl.environments.interfaces import (
    EnvironmentInterface,
    EnvironmentReturn,
    RewardConfigError,
    RewardError,
    single_turn_return,
)
from rl.environments.workers import RewardWorkerPool, discard_log, load_function, module_source, split_ref

__all__ = [
    "RewardConfigError",
    "RewardFunctionEnvironment",
    "RewardFunctionSpec",
    "check_reward_function",
    "importable_in_pod",
    "source_hash",
]

LOGGERS = {"log_extra": discard_log, "log_metric": discard_log}
"""TRL's logging callables, accepted and discarded (TRL's ``trainer_state`` is not passed)."""

RESERVED = ("prompts", "completions", "completion_ids", *LOGGERS)
"""Keyword arguments the trainer itself passes; a dataset column may not have these names."""


@dataclass(frozen=True)
class RewardFunctionSpec:
    """One reward function of an environment.

    Attributes:
        function: ``"package.module:function"`` or ``"path/to/file.py:function"`` (relative to the current directory).
        weight: its weight in the total reward.
        name: the reward's name in metrics and ``reward_weights``; defaults to the function's name (TRL's
            ``reward_func_names``).
    """

    function: str
    weight: float = 1.0
    name: str = ""

    @property
    def reward_name(self) -> str:
        """``name``, or the function's name when empty."""
        return self.name or split_ref(self.function)[1]


def _fail(ref: str, where: str, problem: str, fix: str) -> RewardConfigError:
    return RewardConfigError(f"{where}: reward function {ref!r} {problem}. {fix}")


def check_reward_function(ref: str, *, where: str = "reward function") -> None:
    """Config-time check that a reference loads: the module or file exists and imports, and the attribute is a
    callable taking ``**kwargs`` (TRL passes every dataset column as a keyword).

    Imports the module (or executes the file) in this process.

    Args:
        ref: ``"package.module:function"`` or ``"path/to/file.py:function"``.
        where: the config entry, for the message (e.g. ``"env.tasks.math.reward_functions[0].function"``).

    Raises:
        RewardConfigError: naming the entry, what is wrong and the fix.
    """
    fix = (
        "Point it at a function 'package.module:function' or 'path/to/file.py:function' (relative to the run's folder)."
    )
    try:
        split_ref(ref)
        module_source(ref)
    except (ValueError, FileNotFoundError) as err:
        raise _fail(ref, where, f"cannot be found ({err})", fix) from None
    except Exception as err:  # noqa: BLE001 - a parent package's own import error, reported with its type
        raise _fail(
            ref, where, f"fails to import: {type(err).__name__}: {err}", "Fix the module so it imports."
        ) from None
    try:
        fn = load_function(ref)
    except (AttributeError, TypeError) as err:
        raise _fail(ref, where, f"does not name a function ({err})", fix) from None
    except Exception as err:  # noqa: BLE001 - the user module's own error, reported with its type
        raise _fail(
            ref, where, f"fails to import: {type(err).__name__}: {err}", "Fix the module so it imports."
        ) from None
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing more to check
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise _fail(
            ref,
            where,
            "does not accept **kwargs",
            "Give it TRL's signature, e.g. def reward(completions, **kwargs): every dataset column, prompts and "
            "completion_ids are passed as keyword arguments.",
        )


def importable_in_pod(ref: str, project_root: str) -> str | None:
    """Whether a cluster pod could load the reference: None if so, else the reason.

    pyflyte's fast registration ships the project folder only, so a file must be a relative path inside
    ``project_root``, and a module must live under ``project_root`` or be installed (a distribution's top-level
    package, or the standard library).
    """
    root = Path(project_root).resolve()
    try:
        left, _, is_file = split_ref(ref)
    except ValueError as err:
        return str(err)
    if is_file:
        if Path(left).is_absolute():
            return f"{left} is an absolute path; give a path relative to the project folder {root}"
        path = Path(left).resolve()
        if not path.is_relative_to(root):
            return f"{path} is outside the project folder {root}, which is all that fast registration ships"
        return None
    top = left.split(".")[0]
    if (root / f"{top}.py").is_file() or (root / top).is_dir():
        return None
    if top in sys.stdlib_module_names or top in importlib.metadata.packages_distributions():
        return None
    spec = importlib.util.find_spec(top)
    found = f"found at {spec.origin or list(spec.submodule_search_locations or [])}" if spec else "not found"
    return (
        f"module {top!r} is neither under the project folder {root} nor an installed package ({found}); move it "
        "into the project folder or install it in the image"
    )


def source_hash(ref: str) -> str:
    """SHA-256 hex digest of the source file of the module (or the file) that defines the function.

    Raises:
        FileNotFoundError: no such file or module.
    """
    return hashlib.sha256(module_source(ref).read_bytes()).hexdigest()


def completion_text(message_log: list[dict], i: int) -> tuple[str, list[int]]:
    """The assistant's completion (its text and token ids): the last message of a sample's log.

    Raises:
        ValueError: the last message is not the assistant's.
    """
    last = message_log[-1] if message_log else {}
    if last.get("role") != "assistant" or not isinstance(last.get("content"), str):
        msg = (
            f"message log {i} of the batch does not end with an assistant message {{'role': 'assistant', 'content': "
            f"str, 'token_ids': [...]}} (its last message: {last!r}); the rollout must append the completion."
        )
        raise ValueError(msg)
    return last["content"], [int(t) for t in last.get("token_ids", [])]


def trl_arguments(message_log_batch: list[list[dict]], metadata: list[dict]) -> dict[str, list]:
    """The keyword arguments TRL's ``GRPOTrainer`` gives a reward function for this batch (see the module docstring).

    Raises:
        ValueError: the batch and metadata differ in length, a metadata lacks ``"prompt"``, samples have different
            columns, or a column is named like a trainer argument (``prompts``, ``completions``, ``completion_ids``).
    """
    if len(message_log_batch) != len(metadata):
        raise ValueError(f"{len(message_log_batch)} message logs but {len(metadata)} metadata; give one per sample")
    prompts, completions, ids = [], [], []
    for i, (log, md) in enumerate(zip(message_log_batch, metadata, strict=True)):
        if "prompt" not in md:
            raise ValueError(f"metadata {i} of the batch has no 'prompt' (its keys: {sorted(md)}); the rollout sets it")
        text, token_ids = completion_text(log, i)
        prompt = md["prompt"]
        prompts.append(prompt)
        completions.append(text if isinstance(prompt, str) else [{"role": "assistant", "content": text}])
        ids.append(token_ids)
    keys = [k for k in metadata[0] if k != "prompt"] if metadata else []
    for i, md in enumerate(metadata):
        if set(md) - {"prompt"} != set(keys):
            msg = (
                f"metadata {i} of the batch has columns {sorted(set(md) - {'prompt'})} but metadata 0 has "
                f"{sorted(keys)}; every sample of one task must come with the same columns"
            )
            raise ValueError(msg)
    clash = [k for k in keys if k in RESERVED]
    if clash:
        msg = (
            f"dataset column(s) {clash} have the name of an argument the trainer passes to reward functions "
            f"({', '.join(RESERVED)}); rename the column(s)"
        )
        raise ValueError(msg)
    out: dict[str, list] = {"prompts": prompts, "completions": completions, "completion_ids": ids}
    out.update({k: [md[k] for md in metadata] for k in keys})
    return out


class RewardFunctionEnvironment(EnvironmentInterface):
    """A single-turn environment whose named rewards are TRL-signature reward functions run in worker processes.

    Args:
        functions: the reward functions; their reward names must be distinct.
        num_workers: worker processes (when no ``pool`` is given).
        timeout_s: seconds one function may take on one batch.
        pool: a shared ``RewardWorkerPool`` to use instead of starting one (the environment attaches to it).
        warm_up: start the workers and load every function now (else on the first ``step``).

    Raises:
        RewardConfigError: no functions, duplicate reward names, or a non-finite weight.
        RewardError: a function fails to load in a worker (with ``warm_up``).
    """

    def __init__(
        self,
        functions: list[RewardFunctionSpec],
        *,
        num_workers: int,
        timeout_s: float,
        pool: RewardWorkerPool | None = None,
        warm_up: bool = True,
    ) -> None:
        if not functions:
            raise RewardConfigError("RewardFunctionEnvironment needs at least one reward function; add one")
        names = [f.reward_name for f in functions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise RewardConfigError(f"reward names {dupes} appear more than once; give each function a distinct name")
        for f in functions:
            if not math.isfinite(float(f.weight)):
                raise RewardConfigError(f"reward {f.reward_name!r} has weight {f.weight}; give a finite number")
        self.functions = list(functions)
        self.reward_weights = {f.reward_name: float(f.weight) for f in functions}
        self.timeout_s = float(timeout_s)
        self._pool = (pool or RewardWorkerPool(num_workers, timeout_s)).attach()
        self._attached = True
        if warm_up:
            try:
                self._pool.warm_up([f.function for f in functions])
            except BaseException:
                self.close()
                raise

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """Rewards ``{name: [B] float32}`` (NaN where a function returned None); single-turn.

        Raises:
            ValueError: malformed batch (see ``trl_arguments``). RewardError: a reward function failed.
        """
        import torch

        if not self._attached:
            raise RewardError("this RewardFunctionEnvironment is closed; build a new one")
        kwargs = trl_arguments(message_log_batch, metadata)
        n = len(metadata)
        row_ids = [md.get("row_id") for md in metadata]
        rewards = {}
        for f in self.functions:
            values = self._pool.run(f.function, kwargs, n, shared=LOGGERS, row_ids=row_ids, timeout_s=self.timeout_s)
            rewards[f.reward_name] = torch.tensor(
                [math.nan if v is None else v for v in values], dtype=torch.float32
            ).reshape(n)
        return single_turn_return(rewards, metadata, [None] * n)

    def close(self) -> None:
        """Detach from the worker pool (stopping it when no other environment uses it); idempotent."""
        if self._attached:
            self._attached = False
            self._pool.close()


def specs_from_config(entries: Sequence[dict]) -> list[RewardFunctionSpec]:
    """``[{"function": ..., "weight": ..., "name": ...}]`` -> specs (shape already checked by the registry)."""
    return [RewardFunctionSpec(e["function"], float(e.get("weight", 1.0)), str(e.get("name", ""))) for e in entries]
