"""Config inputs that used to hang, leak or fail late: a config path that is a FIFO, a link to ``/dev/zero`` or a
file over 1 MiB; credentials in values (URL userinfo, image references, secret query parameters, secret-named keys at
any depth) in MLflow params and the credential check; tracking URIs with a bad port or a SQLite host; and prompts
longer than vLLM's ``max_model_len`` leaves room for."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from dataplane.urls import credential_parts, redact, redact_json
from rl.config import config_from_dict, load_config
from rl.config.loading import MAX_CONFIG_BYTES
from rl.data import Problem
from rl.prompts import fits_checker, prepare_prompts
from tasks.run_config import run_config_from_dict

REPO = Path(__file__).resolve().parents[3]
RF = {"reward_functions": [{"function": "tests.rewards:earnable"}]}


# ---------------------------------------------------------------- config files that are no regular files


def _limit_memory() -> None:  # in the child: reading /dev/zero without end fails at 2 GiB, not at the machine's RAM
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _load_in_child(path: Path) -> str:
    """`load_config(path)`'s error in a child process that may take 20 s at most (a FIFO blocked the read forever)."""
    code = (
        "import sys\nfrom rl.config import load_config\n"
        "try:\n    load_config(sys.argv[1])\nexcept ValueError as err:\n    print(err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=REPO,
        preexec_fn=_limit_memory,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    return done.stdout.strip()


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    assert _load_in_child(fifo) == (
        f"config file '{fifo}': is a named pipe (FIFO), not a regular file; give the path of a YAML or JSON file "
        "(write the config to a file first), or inline JSON starting with '{'"
    )


def test_a_link_to_dev_zero_is_refused_naming_its_target(tmp_path):
    link = tmp_path / "cfg.yaml"
    link.symlink_to("/dev/zero")
    assert _load_in_child(link) == (
        f"config file '{link}': is a character device (a link to '/dev/zero'), not a regular file; give the path "
        "of a YAML or JSON file (write the config to a file first), or inline JSON starting with '{'"
    )


def test_a_config_file_over_1_mib_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_CONFIG_BYTES // 10) + "grpo: {max_num_steps: 2}\n")
    assert big.stat().st_size > MAX_CONFIG_BYTES == 1 << 20
    with pytest.raises(ValueError) as err:
        load_config(str(big))
    assert str(err.value) == (
        f"config file '{big}': is larger than 1048576 bytes (1 MiB), the most a config file may hold; give the "
        "config file itself (a config is a few kilobytes; put data in data.train)"
    )
    exact = tmp_path / "exact.yaml"
    exact.write_text("grpo: {max_num_steps: 2}\n" + "#" * (MAX_CONFIG_BYTES - 26) + "\n")
    assert exact.stat().st_size == MAX_CONFIG_BYTES
    assert load_config(str(exact)).grpo.max_num_steps == 2  # 1 MiB itself is read


# ---------------------------------------------------------------- credentials in values


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("alice:pw@ghcr.io/acme/grpoflow:v1", "***@ghcr.io/acme/grpoflow:v1"),
        ("https://AKIAXYZ:s3cret@minio:9000", "https://***@minio:9000"),
        (
            "https://host/b?X-Amz-Credential=AKIA&X-Amz-Signature=abc&x=1",
            "https://host/b?X-Amz-Credential=***&X-Amz-Signature=***&x=1",
        ),
        ("postgresql://db/mlflow?user=u&password=pw", "postgresql://db/mlflow?user=u&password=***"),
        ("AccountName=acct;AccountKey=abc==;EndpointSuffix=x", "AccountName=acct;AccountKey=***;EndpointSuffix=x"),
        # image references without credentials stay as they are, a digest included
        ("ghcr.io/acme/grpoflow:v1@sha256:0123", "ghcr.io/acme/grpoflow:v1@sha256:0123"),
        ("grpoflow:v1@sha256:0123", "grpoflow:v1@sha256:0123"),
        ("localhost:5000/grpoflow:v1", "localhost:5000/grpoflow:v1"),
    ],
)
def test_redact_hides_credentials_in_values(text, redacted):
    assert redact(text) == redacted


def test_redact_json_hides_secret_named_keys_at_any_depth():
    value = {
        "token": "hf_abc",
        "storage_options": {"key": "AKIA", "secret": "s", "client_kwargs": {"endpoint_url": "http://u:p@h:9000"}},
        "max_tokens": 64,
        "headers": {"Authorization": "Bearer x", "n": [1, "y"]},
        "urls": ["https://h/x?sig=abc"],
    }
    assert redact_json(value) == {
        "token": "***",
        "storage_options": {"key": "***", "secret": "***", "client_kwargs": {"endpoint_url": "http://***@h:9000"}},
        "max_tokens": 64,
        "headers": {"Authorization": "***", "n": [1, "***"]},
        "urls": ["https://h/x?sig=***"],
    }
    assert value["token"] == "hf_abc"  # a copy


def test_mlflow_params_redact_values_and_secret_named_keys():
    cfg = run_config_from_dict(
        {
            "data": {"dataset_kwargs": {"token": "hf_abc123", "min_terms": 2}},
            "tracking": {"uri": "http://alice:s3cret@host:5000"},
            "resources": {"train": {"image": "alice:hunter2@ghcr.io/acme/grpoflow-train:v3"}},
        }
    )
    params = cfg.flat_params()
    assert params["data.dataset_kwargs.token"] == "***"
    assert params["data.dataset_kwargs.min_terms"] == "2"
    assert params["resources.train.image"] == "***@ghcr.io/acme/grpoflow-train:v3"
    assert params["tracking.uri"] == "http://***@host:5000"
    assert params["generation.max_new_tokens"] == "32"  # a config field named like a secret is no secret
    assert not any(s in v for v in params.values() for s in ("hf_abc123", "hunter2", "s3cret"))
    assert cfg.resources.train.image == "alice:hunter2@ghcr.io/acme/grpoflow-train:v3"  # the config keeps its values


ENV_FILE = """
from rl.environments.interfaces import EnvironmentInterface


class Keyed(EnvironmentInterface):
    reward_weights = {"keyed": 1.0}

    def __init__(self, api_key, url):
        self.api_key, self.url = api_key, url

    def step(self, message_log_batch, metadata):
        raise NotImplementedError
"""


def test_mlflow_params_redact_environment_kwargs(tmp_path):
    (tmp_path / "keyed_env.py").write_text(ENV_FILE)
    kwargs = {"api_key": "sk-1", "url": "https://h/?token=t"}
    spec = {"environment": {"class": f"{tmp_path}/keyed_env.py:Keyed", "kwargs": kwargs}}
    cfg = config_from_dict({"data": {"train": "p.jsonl", "task_key": "task"}, "env": {"tasks": {"a": spec, "b": RF}}})
    params = cfg.flat_params()
    assert params["env.tasks.a.environment.kwargs.api_key"] == "***"
    assert params["env.tasks.a.environment.kwargs.url"] == "https://h/?token=***"
    assert params["env.tasks.b.reward_functions"] == json.dumps([{"function": "tests.rewards:earnable"}])


@pytest.mark.parametrize(
    ("endpoint", "shown", "parts"),
    [
        ("https://minio/?X-Amz-Signature=abc", "https://minio/?X-Amz-Signature=***", "the parameter 'X-Amz-Signature'"),
        ("https://minio/x?user=u&password=pw", "https://minio/x?user=u&password=***", "the parameter 'password'"),
        (
            "https://AKIA:s@minio/?X-Amz-Credential=AKIA",
            "https://***@minio/?X-Amz-Credential=***",
            "a user:password@ part and the parameter 'X-Amz-Credential'",
        ),
    ],
)
def test_the_credential_check_reads_values(endpoint, shown, parts):
    with pytest.raises(ValueError) as err:
        config_from_dict({"dataplane": {"storage_options": {"client_kwargs": {"endpoint_url": endpoint}}}})
    assert str(err.value) == (
        f"config dataplane.storage_options.client_kwargs.endpoint_url: {shown!r} holds credentials ({parts}): the "
        "config travels in Flyte's task inputs; drop them and set them in the environment (AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN) or a credentials file (~/.aws/credentials, AWS_PROFILE) instead"
    )


def test_credential_parts_finds_nothing_in_plain_urls():
    assert credential_parts("https://minio:9000/bucket?versionId=3&x-id=GetObject") == []
    assert credential_parts("http://host:5000/a@b") == []
    config_from_dict({"dataplane": {"storage_options": {"endpoint_url": "http://minio:9000?region=us"}}})


def test_the_config_file_task_prints_its_url_redacted(capsys):
    import fsspec

    from tasks.config_file import load_config_file

    url = "memory://alice:s3cret@bucket/probe/c.yaml"  # the memory filesystem keeps 'alice:s3cret@' in the path
    memory = fsspec.filesystem("memory")
    memory.pipe(url, b"grpo: {max_num_steps: 2}\n")
    try:
        cfg = load_config_file.task_function(url=url)
    finally:
        memory.rm(url)
    assert cfg.grpo.max_num_steps == 2
    assert "[grpoflow] config from memory://***@bucket/probe/c.yaml\n" in capsys.readouterr().out


# ---------------------------------------------------------------- tracking URIs that fail when the run starts


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        (
            "http://host:notaport",
            "'http://host:notaport' has the port 'notaport', not a whole number from 1 to 65535; write e.g. "
            "'http://host:5000', or leave the port out for the scheme's default",
        ),
        (
            "https://alice:pw@host:70000/x",
            "'https://***@host:70000/x' has the port '70000', not a whole number from 1 to 65535; write e.g. "
            "'http://host:5000', or leave the port out for the scheme's default",
        ),
        ("postgresql://db:0/mlflow", "'postgresql://db:0/mlflow' has the port '0', not a whole number from 1 to 65535"),
        (
            "sqlite://rel.db",
            "'sqlite://rel.db' names the host 'rel.db', but SQLAlchemy reads a SQLite file after the third slash; "
            "write 'sqlite:///rel.db' (a path relative to the current folder) or 'sqlite:////abs/rel.db' (an "
            "absolute one)",
        ),
        ("http://", "'http://' names no host; write the tracking server as e.g. 'http://host:5000'"),
    ],
)
def test_tracking_uris_refused_at_config_time(uri, message):
    with pytest.raises(ValueError) as err:
        config_from_dict({"tracking": {"uri": uri}})
    assert str(err.value).startswith(f"config tracking.uri: {message}")


@pytest.mark.parametrize(
    "uri",
    [
        "http://host:5000",
        "https://[::1]:65535/x",
        "http://host",
        "sqlite:///rel.db",
        "sqlite:////abs/x.db",
        "postgresql+psycopg2://u:p@db:5432/mlflow",
        "file:///abs/mlruns",
        "databricks",
        "mlruns",
    ],
)
def test_tracking_uris_still_accepted(uri):
    assert config_from_dict({"tracking": {"uri": uri}}).tracking.uri == uri


# ---------------------------------------------------------------- prompts longer than vLLM's max_model_len allows


class _WordTokenizer:
    """One token per whitespace-separated word (raw prompts: no chat template)."""

    name_or_path = "words"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text.split())))}


def _vllm_cfg(tmp_path: Path, rows: list[dict]) -> object:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return config_from_dict(
        {
            "data": {"train": str(path), "apply_chat_template": False, "validation": str(path)},
            "env": RF,
            "generation": {"backend": "vllm", "max_new_tokens": 32, "vllm_cfg": {"max_model_len": 64}},
            "dataplane": {"root": str(tmp_path / "dp")},
        }
    )


def test_a_prompt_over_max_model_len_is_refused_naming_its_length_and_the_fix(tmp_path):
    rows = [{"prompt": "w " * 10}, {"prompt": "w " * 40}, {"prompt": "w " * 50}]
    cfg = _vllm_cfg(tmp_path, rows)
    with pytest.raises(ValueError) as err:
        prepare_prompts(cfg, root=cfg.dataplane.root, run_id="r", tokenizer=_WordTokenizer(), max_prompt_tokens=32)
    assert str(err.value).endswith(
        "line 2 (row 1), column 'prompt': the prompt has 40 tokens, which with generation.max_new_tokens=32 is more "
        "than the 64 tokens of generation.vllm_cfg.max_model_len; raise generation.vllm_cfg.max_model_len to at "
        "least 72, lower generation.max_new_tokens to at most 24, shorten the prompt, or set "
        "data.on_overlong_prompt: skip to drop such prompts"
    )


def test_the_model_limit_names_no_max_model_len(tmp_path):
    cfg = _vllm_cfg(tmp_path, [{"prompt": "w"}])
    fits = fits_checker(_WordTokenizer(), cfg, 20)  # the model's 52 positions, below max_model_len
    p = Problem(question="w " * 60, answer="", entry={})
    assert fits([p]) == [False]
    assert fits.explain(p) == (
        "the prompt has 60 tokens, which with generation.max_new_tokens=32 is more than the 52 tokens of the model's "
        "max_position_embeddings; shorten the prompt (or use a model with a longer context), or set "
        "data.on_overlong_prompt: skip to drop such prompts"
    )
