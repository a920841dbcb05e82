"""How ``pyflyte run`` takes a config input (``--cfg``): read as `rl.config.load_config` reads it (inline JSON, or a
YAML or JSON file at a path or any fsspec URL; every error one paragraph, naming the file) and documented in a page
of help instead of flytekit's JSON schema. Only the command-line option: the registered interface stays flytekit's.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any

from dataplane.urls import redact, redact_json
from rl.config import GRPOConfig, config_from_dict
from rl.config.checks import usage_error
from rl.config.descriptions import field_docs, one_line
from rl.config.loading import read_config_source

_RUN_MODULE = "flytekit.clis.sdk_in_container.run"
RUN_COMMAND = "pyflyte run workflows/grpo.py grpo"
"""The command that runs the ``grpo`` workflow locally (README: Quick start); :func:`run_command` extends it."""


def install_config_options() -> None:
    """Make ``pyflyte run``'s option of every config input (a `GRPOConfig` or subclass, e.g. ``RunConfig``) read its
    value with `load_config`'s reader and print a short help; a no-op unless pyflyte's ``run`` module is imported.
    Idempotent.

    Why here: flytekit builds the option of each workflow input in ``run.to_click_option``. For a dataclass it appends
    ``json.dumps`` of the input's literal type metadata to the help (mashumaro's JSON schema: ~700 lines for
    ``RunConfig`` with its field descriptions), shows the whole default config as JSON, and parses the value with
    ``JsonParamType`` (``json.loads``, else a local file read as is: a missing file reads as bad JSON, ``file://`` is no
    file, duplicate keys are kept silently). That metadata must stay: it is what registration sends (also ``pyflyte run
    --remote``, from the same interface objects in the same process) and what the console's launch form renders,
    descriptions included. So nothing changes at the type (a custom TypeTransformer, or the metadata, would change what
    is registered): this wraps ``to_click_option`` and replaces, on the option it returns for a config input, its
    ``help`` (`config_help`: it names the keys in which the default differs), its ``type`` (`config_param_type`), and
    turns off the display of its default (the whole config as JSON). Every other input and option is flytekit's own.

    Every ``pyflyte`` command imports the ``run`` module before it loads a workflow file, so the import of
    ``tasks.run_config`` installs the wrapper in time; elsewhere (a task pod, Python) nothing of the CLI is
    imported. If a flytekit release renames ``to_click_option``, the help is flytekit's again and
    ``tests/unit/test_cli.py`` fails.
    """
    run = sys.modules.get(_RUN_MODULE)
    original = getattr(run, "to_click_option", None)
    if original is None or getattr(original, "config_options", False):
        return

    @functools.wraps(original)
    def to_click_option(
        ctx: Any, flyte_ctx: Any, input_name: str, literal_var: Any, python_type: Any, default_val: Any, required: bool
    ) -> Any:
        option = original(ctx, flyte_ctx, input_name, literal_var, python_type, default_val, required)
        if isinstance(python_type, type) and issubclass(python_type, GRPOConfig):
            option.help = config_help(python_type, literal_var.description, option.default)
            option.type = config_param_type()(python_type)
            option.show_default = False  # flytekit's is the whole config as JSON; the help names what differs
        return option

    to_click_option.config_options = True  # type: ignore[attr-defined]
    run.to_click_option = to_click_option  # type: ignore[union-attr]


def config_help(root: type[GRPOConfig], description: str = "", default: Any = None) -> str:
    """The help of a config option: what it takes, the sections with their one-line descriptions, where every key is
    documented (docs/config.md), and the keys in which ``default`` (the option's default as flytekit passes it: a config
    as JSON) differs from ``root()`` (credentials in URLs redacted). ``description``: the workflow's own words on the
    input, put first. Paragraphs are split by a blank line, and ``\\b`` keeps the line breaks of one (click's and
    rich-click's rule)."""
    sections = "\n".join(f"{name}: {one_line(doc).rstrip('.')}" for name, doc in field_docs(root).items())
    changed = _changed_keys(root, default)
    paragraphs = [
        (
            f'{description.strip()} Inline JSON (\'{{"grpo": {{"max_num_steps": 2}}}}\') or a .yaml, .yml or .json '
            "file, a path or a URL (configs/quick.yaml, file:///abs/x.yaml, s3://bucket/x.yaml). Give only "
            "the keys you change; the rest keep their defaults."
        ),
        f"\b\nSections:\n{sections}",
        "Every key, its type and default: docs/config.md.",
        *([f"Default here (the keys it changes): {redact(json.dumps(changed))}"] if changed else []),
    ]
    return "\n\n".join(paragraphs).strip()


def run_command(cfg: GRPOConfig, *, resume_run_id: str | None = None) -> str:
    """The command that runs the ``grpo`` workflow locally with the settings of ``cfg``: ``pyflyte run
    workflows/grpo.py grpo --cfg '<json>'``, the JSON holding the keys in which ``cfg`` differs from its class's
    defaults (:func:`changed_keys`), plus ``checkpointing.resume_run_id`` when given (README: Resume: the run then
    continues from its newest complete checkpoint).

    Credentials are redacted (`dataplane.urls.redact_json`: URLs' userinfo, strings under secret-named keys such as
    ``dataplane.storage_options.secret``): a run that had any needs them given again in place of ``***``. A single
    quote inside a value is escaped for POSIX shells."""
    changed = changed_keys(cfg)
    if resume_run_id is not None:
        changed.setdefault("checkpointing", {})["resume_run_id"] = resume_run_id
    text = json.dumps(redact_json(changed)).replace("'", "'\\''")
    return f"{RUN_COMMAND} --cfg '{text}'"


def changed_keys(cfg: GRPOConfig) -> dict[str, Any]:
    """The keys of ``cfg`` (nested, as in a config file) whose values differ from ``type(cfg)()``'s."""
    return _changed_keys(type(cfg), json.dumps(cfg.to_dict()))


def _changed_keys(root: type[GRPOConfig], default: Any) -> dict[str, Any]:
    """The keys of ``default`` (a config as JSON) whose values differ from ``root()``'s, nested; {} where none or
    where ``default`` is no JSON config."""

    def changed(value: Any, base: Any) -> Any:
        if not (isinstance(value, dict) and isinstance(base, dict)):
            return value
        return {k: changed(v, base.get(k)) for k, v in value.items() if v != base.get(k)}

    try:
        out = changed(json.loads(default), root().to_dict()) if isinstance(default, str) else {}
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


@functools.cache
def config_param_type() -> type:
    """The click parameter type of a config option (click is imported on first use)."""
    import click

    class ConfigParamType(click.ParamType):
        """A config from inline JSON or a YAML/JSON file at a path or any fsspec URL (`rl.config.load_config`'s
        reader), or from a mapping (``--inputs-file``); an error is click's usage error (``Invalid value for
        '--cfg': ...``), one paragraph."""

        name = "json or file"

        def __init__(self, root: type[GRPOConfig]) -> None:
            self.root = root

        def convert(self, value: Any, param: Any, ctx: Any) -> Any:
            """The config: ``value`` read as `load_config` reads it, then built by ``root.from_json`` as flytekit's
            ``JsonParamType`` builds it (so a check the config class adds there still runs)."""
            if not isinstance(value, (str, dict)):  # already a config, or flytekit's ArtifactQuery
                return value
            try:
                data = value if isinstance(value, dict) else read_config_source(value)
                try:
                    text = json.dumps(data)
                except (TypeError, ValueError):  # a YAML date or binary: config_from_dict names its key
                    return config_from_dict(data, self.root)
                return self.root.from_json(text)
            except click.BadParameter:
                raise
            except ValueError as err:
                raise usage_error(str(err)) from None

    return ConfigParamType
