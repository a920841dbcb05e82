"""What every config value goes through: its field's type (the right type or a clear error naming the dotted key,
never a silent coercion), the error style (``config {where}: {problem}; {fix}``), the dotted names of the sections,
and the checks that relate one section's values to another's. Pure functions, no I/O; the sections of
`rl.config.sections` call them in their ``__post_init__``.

flytekit's dataclass transformer decodes a task input with mashumaro, whose decoders coerce silently
(``bool("no")`` is True, ``int(3.5)`` is 3, ``dict[str, str]`` values become ``str(value)``), and only then calls
the constructor. `Section.Config` turns that coercion off, so a wrong value that reaches a task (a literal built
from a dict, the console's launch form) is refused there too. A mapping field is annotated as bare ``dict``:
mashumaro passes its JSON values through untouched, while ``dict[str, Any]`` would make flytekit log a spurious
"PickleFile" warning whenever a workflow is loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar
from urllib.parse import urlsplit

from mashumaro.helper import pass_through

from dataplane.urls import credential_parts, is_secret_key, redact

if TYPE_CHECKING:
    from rl.config.sections import GRPOConfig

T = TypeVar("T")


def fail(where: str, problem: str, fix: str) -> NoReturn:
    """Raise ``ValueError("config {where}: {problem}; {fix}")``."""
    msg = f"config {where}: {problem}; {fix}"
    raise ValueError(msg)


@functools.cache
def _usage_error_type() -> type[ValueError]:
    import click

    class ConfigUsageError(click.BadParameter, ValueError):
        """A config error that click reports as a bad option value, without a traceback."""

    return ConfigUsageError


def usage_error(message: str) -> ValueError:
    """A ValueError with ``message`` that is also a ``click.BadParameter``: pyflyte prints any other exception
    raised while it parses ``--cfg`` with a full traceback, a click error as one paragraph (``Error: Invalid value
    for '--cfg': {message}``). A plain ValueError where click is not installed."""
    try:
        return _usage_error_type()(message)
    except ImportError:
        return ValueError(message)


class _StrictDecoding:
    """mashumaro options of the config dataclasses: hand scalars to the constructor as they arrive."""

    serialization_strategy = {bool: pass_through, int: pass_through, float: pass_through, str: pass_through}


class Section:
    """Base of the config dataclasses (no fields): the mashumaro ``Config`` that flytekit's decoders read."""

    Config = _StrictDecoding


def describe(value: Any) -> str:
    """A value as an error message shows it: ``the string 'no'``, ``the number 3.5``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if dataclasses.is_dataclass(value):
        return f"a {type(value).__name__}"
    return f"a {type(value).__name__} ({str(value)[:40]!r})"


def _conform_json(value: Any, where: str) -> Any:
    """A JSON value (null, bool, number, string, list, string-keyed mapping), checked all the way down."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            fail(
                where,
                f"expected a finite number, got {describe(value)}",
                "JSON has no NaN or infinity: use a finite value",
            )
        return value
    if isinstance(value, dict):
        return _conform_mapping(value, Any, where)
    if isinstance(value, (list, tuple)):
        return [_conform_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    fail(
        where,
        f"expected a JSON value (null, true/false, a number, a string, a list or a mapping), got {describe(value)}",
        "write it as JSON",
    )


def _conform_mapping(value: Any, value_type: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        fail(where, f"expected a mapping, got {describe(value)}", "write it as {key: value, ...}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            fail(where, f"key {k!r} is {describe(k)}, not a string", "quote the key")
        out[k] = conform(v, value_type, f"{where}.{k}")
    return out


def _expected(hint: Any) -> str:
    if hint is bool:
        return "true or false"
    if hint is int:
        return "a whole number"
    if hint is float:
        return "a finite number"
    if hint is str:
        return "a string"
    return getattr(hint, "__name__", str(hint))


def conform(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the annotation ``hint`` and normalized (``3.0`` -> ``3`` for an int, ``1`` and
    ``'1e-5'`` -> floats for a float); a value of another type raises ValueError naming ``where``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) != 1:
            msg = f"config {where}: unsupported annotation {hint}"
            raise TypeError(msg)
        inner = options[0]
        if inner not in (bool, int, float, str):
            return conform(value, inner, where)
        try:
            return conform(value, inner, where)
        except ValueError:
            fail(
                where,
                f"expected {_expected(inner)} or null, got {describe(value)}",
                f"write {_expected(inner)}, or null to leave it unset",
            )
    if hint is Any:
        return _conform_json(value, where)
    if hint is bool:
        if not isinstance(value, bool):
            fail(where, f"expected true or false, got {describe(value)}", "write true or false, unquoted")
        return value
    if hint is int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            fail(where, f"expected a whole number, got {describe(value)}", "write an integer such as 3, unquoted")
        return value
    if hint is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 (PyYAML) reads `1e-5` as a string: a number without a '.'
            try:
                number = float(value.strip())
            except ValueError:
                fail(where, f"expected a finite number, got {describe(value)}", "write a number such as 0.5 or 1e-5")
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(where, f"expected a finite number, got {describe(value)}", "write a number such as 0.5 or 1e-5")
        if not math.isfinite(number):
            fail(
                where,
                f"expected a finite number, got {describe(value)}",
                "NaN and infinity are not valid settings: use a finite value",
            )
        return float(number)
    if hint is str:
        if not isinstance(value, str):
            fail(where, f"expected a string, got {describe(value)}", "quote it")
        return value
    if hint is dict or origin is dict:
        return _conform_mapping(value, args[1] if args else Any, where)
    if hint is list or origin is list:
        if not isinstance(value, (list, tuple)):
            fail(where, f"expected a list, got {describe(value)}", "write it as [a, b, ...]")
        return [conform(v, args[0] if args else Any, f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            fail(
                where,
                f"expected a {hint.__name__} section, got {describe(value)}",
                "build nested sections from a mapping with config_from_dict",
            )
        return value
    msg = f"config {where}: unsupported annotation {hint}"
    raise TypeError(msg)


@functools.cache
def field_hints(cls: type) -> dict[str, Any]:
    """Resolved annotations (the module has postponed annotations) of ``cls``'s init fields."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def check_fields(obj: Any) -> None:
    """Check every field of the config dataclass ``obj`` against its annotation and store the normalized value.

    Raises:
        ValueError: a field holds a value of the wrong type; the message names its dotted key (`section_name`).
    """
    section = section_name(type(obj))
    for name, hint in field_hints(type(obj)).items():
        value = getattr(obj, name)
        conformed = conform(value, hint, f"{section}.{name}" if section else name)
        if conformed is not value:
            object.__setattr__(obj, name, conformed)


# ---------------------------------------------------------------- sections and their dotted names

_ROOTS: list[type] = []


def config_root(cls: type[T]) -> type[T]:
    """Class decorator of the root dataclass of a config tree: `rl.config.GRPOConfig`, and
    `tasks.run_config.RunConfig`, which adds the cluster's ``resources`` to it. Error messages name the sections of
    every registered tree by their dotted path from its root."""
    _ROOTS.append(cls)
    _section_names.cache_clear()
    return cls


def section_type(hint: Any) -> type | None:
    """The dataclass of a section field annotated ``hint``: ``S`` for ``S`` (a section that is always there) and for
    ``S | None`` (an optional section, null where unset, such as ``policy.lora``); None for any other field."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = options[0] if len(options) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def sections(root: type) -> list[tuple[str, type]]:
    """``(dotted name, dataclass)`` of every section under the config dataclass ``root``, optional ones (``S | None``)
    included, depth-first in field order (``("generation", GenerationConfig), ("generation.vllm_cfg", VLLMConfig),
    ...``)."""
    out: list[tuple[str, type]] = []

    def walk(cls: type, prefix: str) -> None:
        for name, hint in field_hints(cls).items():
            if (section := section_type(hint)) is not None:
                out.append((f"{prefix}{name}", section))
                walk(section, f"{prefix}{name}.")

    walk(root, "")
    return out


@functools.cache
def _section_names() -> dict[type, str]:
    out: dict[type, str] = {}
    for root in _ROOTS:
        out.setdefault(root, "")
        for name, cls in sections(root):
            out.setdefault(cls, name)
    return out


def section_name(cls: type, default: str | None = None) -> str:
    """The dotted name of the config section ``cls`` (``VLLMConfig`` -> ``generation.vllm_cfg``, a root -> ""), or
    ``default`` (else the class's name) for a class in no `config_root` tree."""
    return _section_names().get(cls, cls.__name__ if default is None else default)


# ---------------------------------------------------------------- credentials

_CREDENTIALS_FIX = (
    "set them in the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) "
    "or a credentials file (~/.aws/credentials, AWS_PROFILE) instead"
)


def refuse_credentials(options: Any, where: str) -> None:
    """Refuse credential-named keys (``secret``, ``key``, ``token``, ``password``, ``headers``, ...) anywhere in
    ``options``, nested mappings and lists included, and string values that hold credentials
    (`dataplane.urls.credential_parts`): a ``user:password@`` part (``https://AKIA...:secret@host``), or a
    secret-named query or connection-string parameter with a value (``?X-Amz-Signature=...``, ``&password=...``,
    ``;AccountKey=...``).

    Raises:
        ValueError: naming the dotted key and what in its value is a credential (the value redacted).
    """
    if isinstance(options, dict):
        for k, v in options.items():
            here = f"{where}.{k}"
            if is_secret_key(str(k)):
                fail(here, "holds credentials: the config travels in Flyte's task inputs", _CREDENTIALS_FIX)
            refuse_credentials(v, here)
    elif isinstance(options, list):
        for i, v in enumerate(options):
            refuse_credentials(v, f"{where}[{i}]")
    elif isinstance(options, str) and (parts := credential_parts(options)):
        fail(
            where,
            f"{redact(options)!r} holds credentials ({' and '.join(parts)}): the config travels in Flyte's task inputs",
            f"drop them and {_CREDENTIALS_FIX}",
        )


# ---------------------------------------------------------------- MLflow tracking URIs

# The URI schemes of MLflow's own tracking stores (``mlflow.tracking._tracking_service.utils``); a scheme with a
# ``+`` names a SQLAlchemy dialect and driver (``postgresql+psycopg2``).
_MLFLOW_SCHEMES = frozenset(
    {"file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc"}
)
_MLFLOW_NAMES = frozenset({"databricks", "databricks-uc", "uc"})  # URIs without a colon that name a store
_URI_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]+):")  # two or more letters: `C:` is a Windows drive
_URI_FIX = (
    "use e.g. 'sqlite:///runs/mlflow.db', 'http://host:5000', 'postgresql://host/db' or a folder such as './mlruns'"
)


def _plugin_schemes() -> set[str]:
    """Schemes of tracking stores that installed MLflow plugins register.

    Read from the entry point group ``mlflow.tracking_store``.
    """
    return {ep.name.lower() for ep in entry_points(group="mlflow.tracking_store")}


def check_tracking_uri(uri: str) -> None:
    """Refuse an MLflow tracking URI that MLflow would read as something else than meant, or not at all.

    MLflow reads any string without a scheme as a folder of its file store, so a typo becomes a new folder and
    the run's metrics go there. Accepted: a URI whose scheme one of MLflow's stores (or an installed plugin's)
    reads (``sqlite:///runs/mlflow.db``, ``http(s)://host:port``, ``postgresql+psycopg2://...``,
    ``file:///abs/mlruns``), ``databricks``, and a folder path (``mlruns``, ``runs/mlruns``, ``/abs/my runs``).

    Raises:
        ValueError: an unknown scheme (``htp://host``); a bare name with spaces (``not a uri``: write a folder as
            ``./not a uri``); a bare path to a ``.db``/``.sqlite`` file (write ``sqlite:///...``); a port that is
            not a whole number from 1 to 65535 (``http://host:notaport``); ``http(s)://`` without a host; a SQLite
            URI with a host (``sqlite://rel.db``: write ``sqlite:///rel.db``). Credentials in the URI are redacted in
            the message.
    """
    where = "tracking.uri"
    m = _URI_SCHEME.match(uri)
    if m:
        scheme = m["scheme"].lower()
        if scheme.split("+")[0] not in _MLFLOW_SCHEMES and scheme not in _plugin_schemes():
            fail(
                where, f"{redact(uri)!r} has the scheme {m['scheme']!r}, which no MLflow tracking store reads", _URI_FIX
            )
        _check_authority(uri, scheme.split("+")[0])
        return
    if uri in _MLFLOW_NAMES:
        return
    if uri.lower().endswith((".db", ".sqlite", ".sqlite3")):
        fail(
            where,
            f"{uri!r} is a path to a database file, which MLflow would read as a folder of that name",
            f"write 'sqlite:///{uri}'",
        )
    if any(c.isspace() for c in uri) and not uri.startswith(("/", "./", "../", "~")):
        fail(
            where,
            f"{uri!r} is neither a URI (scheme:...) nor a folder path, and MLflow would make a folder of that name",
            f"{_URI_FIX}; write a folder with spaces as './{uri}'",
        )


def _check_authority(uri: str, scheme: str) -> None:
    """The ``//host:port`` part of a tracking URI with scheme ``scheme`` (lowercase, without a ``+driver``): a port
    from 1 to 65535, a host for ``http(s)``, and no host in a SQLite URI (SQLAlchemy reads ``sqlite://rel.db`` as
    the host ``rel.db`` and fails when the run starts: the file comes after the third slash, ``sqlite:///rel.db``
    relative to the current folder, ``sqlite:////abs/x.db`` absolute)."""
    if "://" not in uri:
        return
    parts = urlsplit(uri)
    if scheme == "sqlite" and parts.netloc:
        path = redact(parts.netloc) + parts.path
        fail(
            "tracking.uri",
            f"{redact(uri)!r} names the host {redact(parts.netloc)!r}, but SQLAlchemy reads a SQLite file after the "
            "third slash",
            f"write 'sqlite:///{path}' (a path relative to the current folder) or 'sqlite:////abs/{path}' (an "
            "absolute one)",
        )
    host_port = parts.netloc.rpartition("@")[2]
    if ":" in host_port.rpartition("]")[2]:  # a port is given (an IPv6 host is bracketed)
        given = host_port.rpartition(":")[2]
        if not (given.isdigit() and 1 <= int(given) <= 65535):
            fail(
                "tracking.uri",
                f"{redact(uri)!r} has the port {given!r}, not a whole number from 1 to 65535",
                "write e.g. 'http://host:5000', or leave the port out for the scheme's default",
            )
    if scheme in ("http", "https") and not parts.hostname:
        fail("tracking.uri", f"{redact(uri)!r} names no host", "write the tracking server as e.g. 'http://host:5000'")


# ---------------------------------------------------------------- across sections


def check_across_sections(cfg: GRPOConfig) -> None:
    """The rules that relate one section's values to another's (each section checks its own values when built).

    Raises:
        ValueError: naming the key to change.
    """
    if cfg.policy.megatron_cfg.context_parallel_size > 1 and cfg.loss.loss_type == "grpo":
        fail(
            "loss.loss_type",
            "is 'grpo' (a mean per sequence) with policy.megatron_cfg.context_parallel_size > 1",
            "use a loss summed over tokens ('dapo', 'dr_grpo' or 'cispo'): each context-parallel rank sees only part "
            "of every sequence",
        )
    shaping = cfg.grpo.reward_shaping
    if shaping.enabled and shaping.overlong_buffer_length > cfg.generation.max_new_tokens:
        fail(
            "grpo.reward_shaping.overlong_buffer_length",
            f"{shaping.overlong_buffer_length} is longer than "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}",
            f"use at most {cfg.generation.max_new_tokens} tokens, e.g. {max(1, cfg.generation.max_new_tokens // 5)}",
        )
    if cfg.grpo.max_trajectory_age_steps > 0 and not cfg.loss.use_importance_sampling_correction:
        fail(
            "loss.use_importance_sampling_correction",
            f"is false with grpo.max_trajectory_age_steps {cfg.grpo.max_trajectory_age_steps}",
            "set it to true: trajectories of older weights need the off-policy correction (or set "
            "max_trajectory_age_steps 0)",
        )
    g = cfg.grpo
    if g.max_rollout_turns > 1 and shaping.enabled:
        fail(
            "grpo.reward_shaping.enabled",
            f"is true with grpo.max_rollout_turns {g.max_rollout_turns}: the overlong punishment measures one "
            "completion against generation.max_new_tokens, and an episode has several",
            "turn reward shaping off, or use one turn",
        )
    if g.max_rollout_turns > 1 and g.max_total_sequence_length <= cfg.generation.max_new_tokens:
        fail(
            "grpo.max_total_sequence_length",
            f"{g.max_total_sequence_length} leaves no room for a prompt and a turn of "
            f"generation.max_new_tokens={cfg.generation.max_new_tokens}",
            "raise it (a whole episode's tokens), e.g. 2048",
        )
    if (
        g.max_rollout_turns > 1
        and cfg.generation.backend == "vllm"
        and g.max_total_sequence_length > cfg.generation.vllm_cfg.max_model_len
    ):
        fail(
            "grpo.max_total_sequence_length",
            f"{g.max_total_sequence_length} is longer than generation.vllm_cfg.max_model_len="
            f"{cfg.generation.vllm_cfg.max_model_len}, which vLLM would refuse mid-episode",
            "lower it to at most max_model_len, or raise max_model_len",
        )
    _check_tasks(cfg)
    n = cfg.samples_per_step
    gbs = cfg.optim.train_global_batch_size
    if gbs is not None and n % gbs:
        fail(
            "optim.train_global_batch_size",
            f"{gbs} does not divide the step's {n} samples",
            "use a divisor of num_prompts_per_step * num_generations_per_prompt",
        )


def _check_tasks(cfg: GRPOConfig) -> None:
    """The prompts' tasks against the environments that score them (``data`` and ``env``)."""
    d, e = cfg.data, cfg.env
    if d.from_files and not (e.tasks or e.reward_functions):
        fail(
            "env",
            f"has no reward for the prompts of data.train={redact(d.train or '')!r}",
            "name your reward functions, e.g. env.reward_functions: [{function: "
            "'rl.environments.rewards:math_verify_accuracy'}] (or 'my_rewards.py:my_reward'), or give env.tasks",
        )
    if d.task_key is not None and not e.tasks:
        fail(
            "data.task_key",
            f"is {d.task_key!r} but env.tasks is empty",
            "map each value of that column to its environment under env.tasks, or set data.task_key to null",
        )
    if len(e.tasks) > 1 and d.task_key is None:
        fail(
            "data.task_key",
            f"is null with {len(e.tasks)} tasks in env.tasks ({sorted(e.tasks)})",
            "name the column that holds each row's task, e.g. data.task_key: task",
        )
    if e.tasks and not d.from_files and d.dataset not in e.tasks:
        fail(
            "env.tasks",
            f"has no entry for the reasoning-gym dataset {d.dataset!r} (the task of its problems)",
            f"add env.tasks.{d.dataset}, or set data.train to your own prompts",
        )
    from rl.environments.registry import check_environment_specs

    specs = cfg.task_specs()
    paths = {} if e.tasks else {task: "env" for task in specs}  # the run's one task: its spec is env.*
    try:
        check_environment_specs(specs, task_paths=paths)
    except ValueError as err:  # one paragraph, as every config error: "config <key>: <problem>. <fix>"
        raise ValueError(f"config {err}") from None
