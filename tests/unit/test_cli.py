"""What a new user sees from the command line: ``pyflyte run workflows/grpo.py grpo --cfg ...`` errors and help, the
run's last line, and the Flyte client config files (flyte.yaml, flyte-sandbox.yaml) as flytekit reads them."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.cli import config_param_type, install_config_options
from tasks.run_config import RunConfig
from tasks.types import RunSummary
from tests.helpers import put_config_on_s3

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flytekit's import of click.__version__


@pytest.fixture(scope="module")
def pyflyte():
    """``pyflyte(*args)`` -> (exit code, output with rich's boxes and line wrapping undone; as printed with
    ``raw=True``), run in this process. pyflyte imports its ``run`` module before it loads a workflow file, whose
    ``tasks.run_config`` then installs the ``--cfg`` option (`tasks.cli`); in this process an earlier test may have
    imported ``tasks.run_config`` first, so it is installed here too (it is idempotent)."""
    from click.testing import CliRunner
    from flytekit.clis.sdk_in_container.pyflyte import main

    install_config_options()
    runner = CliRunner()

    def run(*args: str, raw: bool = False) -> tuple[int, str]:
        result = runner.invoke(main, list(args))
        return result.exit_code, result.output if raw else " ".join(result.output.replace("│", " ").split())

    return run


# ---------------------------------------------------------------- pyflyte run --cfg


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            '{"grpo": {"max_num_steps": "four"}}',
            "config grpo.max_num_steps: expected a whole number, got the string 'four'; write an integer such as 3, "
            "unquoted",
        ),
        (
            '{"optim": {"lr": "fast"}}',
            "config optim.lr: expected a finite number, got the string 'fast'; write a number such as 0.5 or 1e-5",
        ),
        (
            '{"optim": {"lr_typo": 1}}',
            "config optim: unknown keys ['lr_typo']; use only ['deterministic', 'logprob_batch_size',",
        ),
        ('{"grpo": {"max_num_steps": 0}}', "config grpo.max_num_steps: is 0; use at least 1"),
        ('{"grpo": {"val_at_start": "no"}}', "config grpo.val_at_start: expected true or false, got the string 'no'"),
    ],
)
def test_a_bad_cfg_is_one_paragraph_without_a_traceback(pyflyte, cfg, message):
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", cfg)
    assert code == 2  # click's usage error, before anything runs
    assert f"Invalid value for '--cfg': {message}" in out
    assert "Traceback" not in out and "rl/config/" not in out


def test_a_bad_cfg_file_is_one_paragraph_without_a_traceback(pyflyte, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("optim:\n  lr: fast\n")
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", str(cfg))
    assert code == 2
    assert "Invalid value for '--cfg': config optim.lr: expected a finite number, got the string 'fast'" in out
    assert "Traceback" not in out


def _cfg_file(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return path


def test_a_missing_cfg_file_says_it_does_not_exist(pyflyte, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", "nope.yaml")
    assert code == 2
    assert "Invalid value for '--cfg': config file 'nope.yaml': does not exist (looked for " in out
    # rich wraps a long path at any character: compare without whitespace
    expected = f"{tmp_path / 'nope.yaml'}); check the path (a relative path starts at the current folder)"
    assert "".join(expected.split()) in "".join(out.split())
    assert "Expecting value" not in out and "json object" not in out and "Traceback" not in out


def test_a_cfg_file_url_is_read(pyflyte, tmp_path):
    bad = _cfg_file(tmp_path, "bad.yaml", "grpo:\n  max_num_steps: 0\n")
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", bad.as_uri())  # file:///...
    assert code == 2
    assert "Invalid value for '--cfg': config grpo.max_num_steps: is 0; use at least 1" in out
    good = _cfg_file(tmp_path, "good.yaml", "grpo:\n  max_num_steps: 3\n")
    assert config_param_type()(RunConfig).convert(good.as_uri(), None, None).grpo.max_num_steps == 3


def test_a_cfg_file_on_s3_is_read_with_the_flyte_environment(pyflyte, s3_server, monkeypatch):
    url = put_config_on_s3(s3_server, monkeypatch, "configs/zero.yaml", b"grpo:\n  max_num_steps: 0\n")
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", url)
    assert code == 2 and "Invalid value for '--cfg': config grpo.max_num_steps: is 0" in out
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", "s3://grpoflow/configs/nope.yaml")
    assert code == 2 and "config file 's3://grpoflow/configs/nope.yaml': does not exist; check" in out


_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{k}: &{k} [{', '.join([f'*{j}'] * 10)}]\n" for j, k in zip("abcde", "bcdef")
)
"""Six levels of ten-fold aliases: 1.1 million values once expanded (a 'billion laughs' in small)."""


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("run.yaml", bytes(range(128, 256)), "is not a text file; give a YAML or JSON config file"),
        (
            "run.yaml",
            "grpo: &a [*a]\n",
            "grpo[0] is an alias of 'grpo' inside 'grpo' itself (a structure that contains itself)",
        ),
        ("run.yaml", _LAUGHS, "e expands to more than 100000 values (YAML aliases repeated inside one another)"),
        ("run.yaml", "[" * 5000 + "]" * 5000, "nests too deeply to read"),
        (
            "run.yaml",
            "grpo:\n  max_num_steps: 2\n  max_num_steps: 3\n",
            "gives the key 'grpo.max_num_steps' twice (lines 2 and 3); keep one",
        ),
        (
            "run.json",
            '{"grpo": {"max_num_steps": 2, "max_num_steps": 3}}',
            "gives the key 'grpo.max_num_steps' twice; keep one",
        ),
    ],
    ids=["random-bytes", "alias-cycle", "alias-laughs", "deep-nesting", "duplicate-yaml-key", "duplicate-json-key"],
)
def test_a_cfg_file_that_cannot_be_read_is_named(pyflyte, tmp_path, monkeypatch, name, content, problem):
    monkeypatch.chdir(tmp_path)
    _cfg_file(tmp_path, name, content)
    code, out = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", name)
    assert code == 2
    assert f"Invalid value for '--cfg': config file '{name}': {problem}" in out
    assert "Traceback" not in out


def test_help_is_a_page_naming_the_sections_and_the_reference(pyflyte):
    """flytekit would append the JSON schema of RunConfig (about 760 lines of help): tasks/cli.py replaces it."""
    code, raw = pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--help", raw=True)
    assert code == 0
    assert len(raw.splitlines()) < 60, raw
    out = " ".join(raw.replace("│", " ").split())
    cfg_help = out[out.index("--cfg") : out.index("--inputs-file")]
    assert (
        "JSON OR FILE" in cfg_help
        and "Inline JSON" in cfg_help
        and "file:///abs/x.yaml, s3://bucket/x.yaml" in cfg_help
    )
    for section in (f.name for f in dataclasses.fields(RunConfig)):
        assert f" {section}: " in cfg_help, section
    assert "optim: AdamW, warmup, gradient clipping and batch sizes" in cfg_help
    assert "Every key, its type and default: docs/config.md." in cfg_help
    assert '"type"' not in out and "[default:" not in cfg_help  # no schema, no 40-line default


def test_the_console_still_gets_the_schema_with_descriptions(pyflyte):
    """The short help is the command line's only: the interface registered with the workflow (what the console's
    launch form renders) keeps flytekit's JSON schema, descriptions included."""
    from google.protobuf.json_format import MessageToDict

    from workflows.grpo import grpo

    pyflyte("run", str(ROOT / "workflows/grpo.py"), "grpo", "--help")
    idl = grpo.interface.to_flyte_idl().inputs.variables["cfg"]
    schema = MessageToDict(idl.type.metadata)
    assert schema["title"] == "RunConfig"
    assert schema["properties"]["optim"]["properties"]["lr"]["description"] == "AdamW learning rate after warmup."
    assert schema["properties"]["resources"]["description"].startswith("Images and resources of each class of tasks")


@pytest.mark.slow
def test_help_of_the_real_command_is_short():
    """As a user runs it: pyflyte imports its run module, then the workflow file, which installs the option."""
    pyflyte = Path(sys.executable).with_name("pyflyte")
    out = subprocess.run(
        [str(pyflyte), "run", "workflows/grpo.py", "grpo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert 20 < len(out.stdout.splitlines()) < 60 and "docs/config.md" in out.stdout


def test_from_json_errors_are_click_usage_errors_and_value_errors():
    import click
    from flytekit.interaction.click_types import JsonParamType

    with pytest.raises(click.BadParameter) as err:
        JsonParamType(RunConfig).convert('{"grpo": {"max_num_steps": "four"}}', None, None)
    assert isinstance(err.value, ValueError)
    assert (
        str(err.value)
        == "config grpo.max_num_steps: expected a whole number, got the string 'four'; write an integer such as "
        "3, unquoted"
    )
    with pytest.raises(
        ValueError,
        match=r"^config: not valid JSON \(Expecting value: line 1 column 1 \(char 0\)\); write a JSON object",
    ):
        RunConfig.from_json("four")


# ---------------------------------------------------------------- the run's last line


def test_run_summary_prints_as_one_short_line():
    summary = RunSummary(
        run_id="grpo-20260101-abc",
        mlflow_run_id="0123456789abcdef",
        tracking_uri="http://alice:pw@mlflow:5000",
        final_step=4,
        last_checkpoint="s3://AKIA:hush@bucket/runs/grpo-20260101-abc/checkpoints/step_000004",
        validation_accuracy=0.5625,
        metrics={f"train/metric_{i}": float(i) for i in range(60)},
    )
    expected = (
        "RunSummary(run_id='grpo-20260101-abc', final_step=4, validation_accuracy=0.562, "
        "mlflow_run_id='0123456789abcdef', "
        "last_checkpoint='s3://***@bucket/runs/grpo-20260101-abc/checkpoints/step_000004')"
    )
    assert str(summary) == repr(summary) == expected
    assert "validation_accuracy=none" in str(dataclasses.replace(summary, validation_accuracy=-1.0))
    assert [f.name for f in dataclasses.fields(RunSummary)] == [
        "run_id",
        "mlflow_run_id",
        "tracking_uri",
        "final_step",
        "last_checkpoint",
        "validation_accuracy",
        "metrics",
    ]
    assert summary.metrics["train/metric_59"] == 59.0  # the metrics stay on the object, out of the line


# ---------------------------------------------------------------- flyte.yaml, flyte-sandbox.yaml

_FLYTE_ENV = (
    "FLYTECTL_CONFIG",
    "FLYTE_PLATFORM_URL",
    "FLYTE_PLATFORM_INSECURE",
    "FLYTE_PLATFORM_CONSOLE_ENDPOINT",
    "FLYTE_CREDENTIALS_AUTH_MODE",
    "FLYTE_AWS_ENDPOINT",
    "FLYTE_AWS_ACCESS_KEY_ID",
    "FLYTE_AWS_SECRET_ACCESS_KEY",
)


@pytest.fixture
def no_flyte_env(monkeypatch):
    for name in _FLYTE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "endpoint", "insecure", "console", "s3_endpoint", "s3_key"),
    [
        ("flyte.yaml", "flyte.example.com", False, "https://flyte.example.com", None, None),
        ("flyte-sandbox.yaml", "localhost:30080", True, "http://localhost:30080", "http://localhost:30002", "minio"),
    ],
)
def test_flyte_config_files_parse_as_flytekit_reads_them(
    no_flyte_env, name, endpoint, insecure, console, s3_endpoint, s3_key
):
    from flytekit.configuration import Config

    cfg = Config.auto(config_file=str(ROOT / name))
    assert cfg.platform.endpoint == endpoint
    assert cfg.platform.insecure is insecure
    assert cfg.platform.auth_mode == "Pkce"
    assert cfg.platform.console_endpoint == console
    assert cfg.data_config.s3.endpoint == s3_endpoint
    assert cfg.data_config.s3.access_key_id == s3_key
    assert cfg.data_config.s3.secret_access_key == ("miniostorage" if s3_key else None)


def _yaml_keys(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _yaml_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


@pytest.mark.parametrize("name", ["flyte.yaml", "flyte-sandbox.yaml"])
def test_flyte_config_files_hold_only_keys_flytekit_reads(name):
    """A misspelt key (``storage.connection.access_key``, flytectl's ``storage.type``) would be silently ignored."""
    from flytekit.configuration import internal
    from flytekit.configuration.file import ConfigEntry

    read = {
        entry.yaml_entry.switch
        for section in vars(internal).values()
        if isinstance(section, type)
        for entry in vars(section).values()
        if isinstance(entry, ConfigEntry) and entry.yaml_entry is not None
    }
    keys = set(_yaml_keys(yaml.safe_load((ROOT / name).read_text())))
    assert keys <= read, sorted(keys - read)
    assert {"admin.endpoint", "admin.insecure", "admin.authType", "console.endpoint"} <= keys


def test_flyte_config_keys_yield_to_the_environment(no_flyte_env):
    """The overrides the files' comments document."""
    from flytekit.configuration import Config

    no_flyte_env.setenv("FLYTE_PLATFORM_URL", "flyte.acme.com")
    no_flyte_env.setenv("FLYTE_PLATFORM_INSECURE", "false")
    no_flyte_env.setenv("FLYTE_AWS_ENDPOINT", "http://minio.acme.com:9000")
    cfg = Config.auto(config_file=str(ROOT / "flyte-sandbox.yaml"))
    assert cfg.platform.endpoint == "flyte.acme.com" and cfg.platform.insecure is False
    assert cfg.data_config.s3.endpoint == "http://minio.acme.com:9000"
    assert cfg.data_config.s3.access_key_id == "minio"  # not overridden: from the file
