from __future__ import annotations

import json
import runpy
import socket
from pathlib import Path

import pytest

from dataplane.errors import is_transient
from rl.config import GRPOConfig, GRPOSettings, TrackingConfig, config_from_dict, env_storage_options, load_config
from rl.config.descriptions import class_doc
from tests.helpers import config_leaves, leaf_docs, nested_dict, put_config_on_s3, schema_descriptions


def test_defaults_are_valid_and_json_safe():
    cfg = GRPOConfig()
    assert cfg.samples_per_step == 64
    json.dumps(cfg.to_dict())
    assert "dataplane.storage_options" not in cfg.flat_params()
    assert cfg.flat_params()["loss.reference_policy_kl_penalty"] == "0.01"


@pytest.mark.parametrize(
    ("section", "values", "match"),
    [
        ("grpo", {"num_generations_per_prompt": 1}, "at least 2"),
        ("loss", {"reference_policy_kl_type": "k9"}, "use 'k1', 'k2' or 'k3'"),
        ("loss", {"ratio_clip_max": -0.1}, r"^config loss.ratio_clip_max: is -0.1; use a value >= 0"),
        ("loss", {"ratio_clip_min": 1.5}, r"^config loss.ratio_clip_min: is 1.5; use a value in \[0, 1\]"),
        ("loss", {"ratio_clip_c": 0.5}, "ratio_clip_c"),
        ("optim", {"lr": 0}, "positive learning rate"),
        ("optim", {"train_global_batch_size": 12, "train_micro_batch_size": 8}, "multiple"),
        ("generation", {"temperature": 0}, "temperature"),
        (
            "generation",
            {"backend": "sglang"},
            r"'sglang' is not a generation back-end; use one of \['transformers', 'vllm'\]",
        ),
        (
            "policy",
            {"backend": "deepspeed"},
            r"'deepspeed' is not a policy back-end; use one of \['megatron', 'transformers'\]",
        ),
        (
            "policy",
            {"megatron_cfg": {"tensor_model_parallel_size": 0}},
            r"policy.megatron_cfg.tensor_model_parallel_size: is 0; use 1 or more",
        ),
        (
            "policy",
            {"megatron_cfg": {"sequence_parallel": True}},
            r"sequence_parallel: is true with tensor_model_parallel_size 1; set tensor_model_parallel_size above 1",
        ),
        (
            "policy",
            {"nproc_per_node": 2, "megatron_cfg": {"tensor_model_parallel_size": 2}},
            r"policy.megatron_cfg: asks for 2 model-parallel ranks but policy.backend is 'transformers'; set "
            r"policy.backend to 'megatron'",
        ),
        (
            "policy",
            {"backend": "megatron", "nproc_per_node": 4, "megatron_cfg": {"tensor_model_parallel_size": 3}},
            r"tensor x pipeline x context parallel sizes = 3 ranks do not divide the 4 ranks of policy.nnodes x "
            r"nproc_per_node",
        ),
        ("generation", {"vllm_cfg": {"gpu_memory_utilization": 1.5}}, r"vllm_cfg.gpu_memory_utilization: is 1.5"),
        (
            "generation",
            {"backend": "vllm", "max_new_tokens": 64, "vllm_cfg": {"max_model_len": 64}},
            "raise vllm_cfg.max_model_len",
        ),
        ("grpo", {"dynamic_sampling_max_gen_batches": 0}, "at least 1"),
        ("loss", {"seq_logprob_error_threshold": 0.5}, ">= 1"),
        ("model", {"precision": "fp8"}, "'auto', 'bfloat16' or 'float32'"),
        ("grpo", {"advantage_clip": 0}, "positive bound"),
        ("loss", {"truncated_importance_sampling_ratio": 2.0}, "use_importance_sampling_correction is false"),
        (
            "loss",
            {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": -1},
            "positive bound",
        ),
        ("dataplane", {"storage_options": {"secret": "x"}}, "environment"),
        # values that would fail later otherwise (a ZeroDivisionError at config time, a new run, a misplaced store)
        # or never
        (
            "optim",
            {"train_global_batch_size": 0},
            r"^config optim.train_global_batch_size: is 0; use a divisor of the step's samples, or null",
        ),
        ("optim", {"weight_decay": -1}, r"^config optim.weight_decay: is -1.0; use 0 \(off\) or a positive decay"),
        (
            "checkpointing",
            {"resume_run_id": ""},
            r"^config checkpointing.resume_run_id: is ''; give the run_id to resume .* or null to start a new run",
        ),
        (
            "checkpointing",
            {"resume_run_id": "run-1 "},
            r"^config checkpointing.resume_run_id: 'run-1 ' has leading or trailing spaces; write 'run-1'",
        ),
        (
            "tracking",
            {"uri": "not a uri"},
            r"^config tracking.uri: 'not a uri' is neither a URI .* nor a folder path, and MLflow would make a "
            r"folder of that name",
        ),
        (
            "tracking",
            {"uri": "htp://host:5000"},
            r"^config tracking.uri: 'htp://host:5000' has the scheme 'htp', which no MLflow tracking store reads",
        ),
        (
            "tracking",
            {"uri": "runs/mlflow.db"},
            r"^config tracking.uri: 'runs/mlflow.db' is a path to a database file.*; write 'sqlite:///runs/mlflow.db'",
        ),
        ("tracking", {"uri": "htp://u:hush@host"}, r"'htp://\*\*\*@host' has the scheme"),
        # the variants: unknown names, and combinations that cannot work
        (
            "grpo",
            {"adv_estimator": "rloo"},
            r"^config grpo.adv_estimator: is 'rloo'; use one of \['grpo', 'reinforce_plus_plus', 'gdpo'\] "
            r"\(RLOO and Dr. GRPO are settings of 'grpo'\)",
        ),
        (
            "loss",
            {"loss_type": "bnpo"},
            r"^config loss.loss_type: is 'bnpo'; use one of \['dapo', 'grpo', 'dr_grpo', 'cispo'\]",
        ),
        ("loss", {"importance_sampling_level": "seq"}, r"^config loss.importance_sampling_level: is 'seq'; use one of"),
        (
            "loss",
            {"reference_policy_kl_gradient": "forward"},
            r"^config loss.reference_policy_kl_gradient: is 'forward'; use one of \['estimator', 'reverse_kl'\]",
        ),
        (
            "loss",
            {"reference_policy_kl_type": "k1"},
            r"^config loss.reference_policy_kl_type: is 'k1' with reference_policy_kl_gradient "
            r"'estimator'.*expected gradient of 0.*; set reference_policy_kl_gradient: reverse_kl",
        ),
        (
            "loss",
            {"importance_sampling_level": "sequence"},
            r"^config loss.importance_sampling_level: is 'sequence' \(GSPO\) with loss_type 'dapo'.*; set loss_type: "
            r"grpo",
        ),
        (
            "loss",
            {"loss_type": "cispo", "ratio_clip_c": 3.0},
            r"^config loss.ratio_clip_c: is set with loss_type 'cispo'.*; set ratio_clip_c: null",
        ),
        (
            "loss",
            {"token_level_loss": False},
            r"^config loss.token_level_loss: is no longer a key; it became loss.loss_type: write loss_type: "
            r"dapo for token_level_loss: true, loss_type: grpo for false",
        ),
        (
            "grpo",
            {"reward_shaping": {"enabled": True, "overlong_buffer_length": 64}},
            r"^config grpo.reward_shaping.overlong_buffer_length: 64 is longer than "
            r"generation.max_new_tokens=32; use at most 32 tokens, e.g. 6",
        ),
        (
            "grpo",
            {"reward_shaping": {"overlong_buffer_length": 0}},
            r"^config grpo.reward_shaping.overlong_buffer_length: is 0; use at least 1 token",
        ),
        (
            "grpo",
            {"num_val_generations_per_prompt": -1},
            r"^config grpo.num_val_generations_per_prompt: is -1; use 0 \(greedy validation only\) or a positive",
        ),
        (
            "grpo",
            {"reward_shaping": {"overlong_buffer_penalty": -1}},
            r"^config grpo.reward_shaping.overlong_buffer_penalty: is -1.0; use a penalty >= 0",
        ),
    ],
)
def test_bad_values_fail_with_a_fix(section, values, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({section: values})


def test_megatron_sizes_split_the_ranks_of_a_task():
    cfg = config_from_dict(
        {
            "policy": {
                "backend": "megatron",
                "nnodes": 2,
                "nproc_per_node": 8,
                "megatron_cfg": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            }
        }
    )
    assert (cfg.policy.world_size, cfg.policy.megatron_cfg.model_parallel_size, cfg.policy.data_parallel_size) == (
        16,
        4,
        4,
    )
    assert (
        config_from_dict({"policy": {"nproc_per_node": 2}}).policy.data_parallel_size == 2
    )  # transformers: every rank a replica
    with pytest.raises(
        ValueError,
        match=r"loss.loss_type: is 'grpo' \(a mean per sequence\) with policy.megatron_cfg.context_parallel_size > "
        r"1; use a loss summed over tokens",
    ):
        config_from_dict(
            {
                "policy": {"backend": "megatron", "nproc_per_node": 2, "megatron_cfg": {"context_parallel_size": 2}},
                "loss": {"loss_type": "grpo"},
            }
        )


def test_every_variant_combines_with_async_data_parallel_ranks_and_megatron():
    variants = (
        [{"loss": {"loss_type": t}} for t in ("dapo", "grpo", "dr_grpo", "cispo")]
        + [
            {"loss": {"loss_type": "grpo", "importance_sampling_level": level}}
            for level in ("sequence", "sequence_token")
        ]
        + [
            {"loss": {"reference_policy_kl_type": "k1", "reference_policy_kl_gradient": "reverse_kl"}},
            {"grpo": {"adv_estimator": "reinforce_plus_plus", "reward_shaping": {"enabled": True}}},
        ]
    )
    around = {
        "grpo": {"max_trajectory_age_steps": 1},
        "loss": {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0},
        "policy": {"backend": "megatron", "nproc_per_node": 4, "megatron_cfg": {"tensor_model_parallel_size": 2}},
        "optim": {"train_global_batch_size": 16},
    }
    for variant in variants:
        merged = {k: {**around.get(k, {}), **variant.get(k, {})} for k in {*around, *variant}}
        cfg = config_from_dict(merged)
        assert cfg.policy.data_parallel_size == 2 and cfg.grpo.max_trajectory_age_steps == 1


def test_global_batch_must_divide_step():
    with pytest.raises(ValueError, match="does not divide"):
        config_from_dict({"optim": {"train_global_batch_size": 48, "train_micro_batch_size": 8}})


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown keys \['lr_typo'\]"):
        config_from_dict({"optim": {"lr_typo": 1}})
    with pytest.raises(ValueError, match="unknown keys"):
        config_from_dict({"optimizer": {}})
    # nested sections are parsed as strictly, and their keys are named with their path
    with pytest.raises(ValueError, match=r"generation.vllm_cfg: unknown keys \['gpu_mem'\]"):
        config_from_dict({"generation": {"vllm_cfg": {"gpu_mem": 0.5}}})
    nested = config_from_dict({"generation": {"backend": "vllm", "vllm_cfg": {"cpu_kv_cache_gib": 3.0}}})
    assert nested.generation.vllm_cfg.cpu_kv_cache_gib == 3.0 and nested.generation.vllm_cfg.max_model_len == 2048


def test_load_yaml_json_inline(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("grpo:\n  max_num_steps: 7\n")
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"optim": {"lr": 0.001}}))
    assert load_config(str(y)).grpo.max_num_steps == 7
    assert load_config(str(j)).optim.lr == 0.001
    assert load_config('{"generation": {"max_new_tokens": 5}}').generation.max_new_tokens == 5
    with pytest.raises(ValueError, match="config file 'missing.yaml': does not exist"):
        load_config("missing.yaml")


# ---------------------------------------------------------------- types are checked, never coerced


@pytest.mark.parametrize(
    ("section", "values", "match"),
    [
        ("grpo", {"val_at_start": "no"}, r"config grpo.val_at_start: expected true or false, got the string 'no'; "),
        (
            "grpo",
            {"val_at_start": "false"},
            r"config grpo.val_at_start: expected true or false, got the string 'false'",
        ),
        ("grpo", {"normalize_rewards": 1}, r"config grpo.normalize_rewards: expected true or false, got the number 1"),
        ("grpo", {"max_num_steps": 3.5}, r"config grpo.max_num_steps: expected a whole number, got the number 3.5"),
        ("grpo", {"max_num_steps": True}, r"config grpo.max_num_steps: expected a whole number, got the boolean true"),
        ("grpo", {"max_num_steps": "4"}, r"config grpo.max_num_steps: expected a whole number, got the string '4'"),
        (
            "generation",
            {"vllm_cfg": {"max_model_len": 2048.5}},
            r"config generation.vllm_cfg.max_model_len: expected a whole number",
        ),
        ("optim", {"lr": float("nan")}, r"config optim.lr: expected a finite number, got the number nan"),
        ("optim", {"lr": float("inf")}, r"config optim.lr: expected a finite number, got the number inf"),
        ("optim", {"lr": float("-inf")}, r"config optim.lr: expected a finite number"),
        ("optim", {"lr": "nan"}, r"config optim.lr: expected a finite number, got the string 'nan'"),
        ("optim", {"lr": "fast"}, r"config optim.lr: expected a finite number, got the string 'fast'"),
        ("optim", {"lr": False}, r"config optim.lr: expected a finite number, got the boolean false"),
        ("grpo", {"advantage_clip": float("nan")}, r"config grpo.advantage_clip: expected a finite number or null"),
        ("loss", {"ratio_clip_c": float("inf")}, r"config loss.ratio_clip_c: expected a finite number or null"),
        ("model", {"name": 3}, r"config model.name: expected a string, got the number 3"),
        ("tracking", {"run_name": 5}, r"config tracking.run_name: expected a string or null, got the number 5"),
        ("dataplane", {"storage_options": "anon"}, r"config dataplane.storage_options: expected a mapping"),
        (
            "dataplane",
            {"storage_options": {"retries": float("nan")}},
            r"config dataplane.storage_options.retries: expected a finite number",
        ),
        (
            "data",
            {"dataset_kwargs": {"min_terms": [2]}},
            r"config data.dataset_kwargs.min_terms: expected a bool, number, string or null",
        ),
        ("data", {"dataset_kwargs": {1: 2}}, r"config data.dataset_kwargs: key 1 is the number 1, not a string"),
    ],
)
def test_wrong_types_are_refused_naming_their_key(section, values, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({section: values})


@pytest.mark.parametrize(("key", "hint"), config_leaves(GRPOConfig))
def test_every_field_is_type_checked(key, hint):
    """A generic check, so that a field added later cannot skip it: a list fits no field's type."""
    with pytest.raises(ValueError, match=rf"^config {key}: expected "):
        config_from_dict(nested_dict(key, [1]))


def test_sections_built_directly_are_checked_too():
    with pytest.raises(ValueError, match=r"config grpo.val_at_start: expected true or false, got the string 'no'"):
        GRPOSettings(val_at_start="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"config grpo: expected a GRPOSettings section, got a mapping"):
        GRPOConfig(grpo={"max_num_steps": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"config tracking.uri: is empty"):
        TrackingConfig(uri="")


def test_numbers_are_normalized_to_their_field_type():
    cfg = config_from_dict(
        {
            "grpo": {"max_num_steps": 3.0, "advantage_clip": "3"},
            "optim": {"lr": "1e-5", "max_grad_norm": 1},
            "generation": {"vllm_cfg": {"gpu_memory_utilization": 1}},
        }
    )
    assert cfg.grpo.max_num_steps == 3 and type(cfg.grpo.max_num_steps) is int
    assert cfg.grpo.advantage_clip == 3.0 and type(cfg.grpo.advantage_clip) is float
    assert cfg.optim.lr == 1e-5 and type(cfg.optim.lr) is float
    assert type(cfg.optim.max_grad_norm) is float and type(cfg.generation.vllm_cfg.gpu_memory_utilization) is float


def test_yaml_exponent_without_a_dot_is_a_float(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-5` as the string '1e-5'; it is meant as a number
    y = tmp_path / "c.yaml"
    y.write_text("optim:\n  lr: 1e-5\ngrpo:\n  val_at_start: 'no'\n")
    with pytest.raises(ValueError, match="grpo.val_at_start"):
        load_config(str(y))
    y.write_text("optim:\n  lr: 1e-5\ngrpo:\n  val_at_start: no\n")  # unquoted `no` is YAML 1.1's false
    cfg = load_config(str(y))
    assert cfg.optim.lr == 1e-5 and type(cfg.optim.lr) is float and cfg.grpo.val_at_start is False


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flytekit's import of click.__version__
def test_from_json_as_pyflyte_run_parses_cfg():
    """``pyflyte run workflows/grpo.py grpo --cfg '<json>'``: flytekit's JsonParamType calls GRPOConfig.from_json."""
    from flytekit.interaction.click_types import JsonParamType

    parse = JsonParamType(GRPOConfig)
    with pytest.raises(ValueError, match="config grpo.val_at_start: expected true or false"):
        parse.convert('{"grpo": {"val_at_start": "no"}}', None, None)
    with pytest.raises(ValueError, match="config grpo.max_num_steps: expected a whole number"):
        parse.convert('{"grpo": {"max_num_steps": 3.5}}', None, None)
    with pytest.raises(ValueError, match="config optim.lr: expected a finite number"):
        parse.convert('{"optim": {"lr": NaN}}', None, None)
    cfg = parse.convert('{"dataplane": {"storage_options": {"anon": false}}}', None, None)
    assert cfg.dataplane.storage_options == {"anon": False}


def _round_trip(cfg):
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, cfg, GRPOConfig, TypeEngine.to_literal_type(GRPOConfig))
    return TypeEngine.to_python_value(ctx, literal, GRPOConfig)


def test_json_values_keep_their_types_through_a_task_boundary():
    """flytekit's dataclass transformer (mashumaro) would turn ``dict[str, str]`` values into strings: ``False`` ->
    'False'."""
    cfg = config_from_dict(
        {
            "dataplane": {
                "storage_options": {"anon": False, "retries": 3, "client_kwargs": {"region_name": "us-east-1"}}
            },
            "data": {"dataset_kwargs": {"min_terms": 2, "p_negative": 0.5, "allow_zero": True, "style": "plain"}},
        }
    )
    back = _round_trip(cfg)
    assert back == cfg
    so = back.dataplane.storage_options
    assert so["anon"] is False and so["retries"] == 3 and so["client_kwargs"] == {"region_name": "us-east-1"}
    kw = back.data.dataset_kwargs
    assert (
        type(kw["min_terms"]) is int and kw["p_negative"] == 0.5 and kw["allow_zero"] is True and kw["style"] == "plain"
    )


def _task_input(section: str, key: str, value):
    """A GRPOConfig literal as a task receives one built outside our dataclass (a dict, the console's launch form)."""
    import msgpack
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine
    from flytekit.models.literals import Binary, Literal, Scalar

    data = GRPOConfig().to_dict()
    data[section][key] = value
    literal = Literal(scalar=Scalar(binary=Binary(value=msgpack.dumps(data), tag="msgpack")))
    return TypeEngine.to_python_value(FlyteContextManager.current_context(), literal, GRPOConfig)


@pytest.mark.parametrize(
    ("section", "key", "value", "match"),
    [
        (
            "grpo",
            "val_at_start",
            "no",
            "config grpo.val_at_start: expected true or false",
        ),  # mashumaro: bool("no") is True
        (
            "grpo",
            "max_num_steps",
            3.5,
            "config grpo.max_num_steps: expected a whole number",
        ),  # mashumaro: int(3.5) is 3
        ("model", "name", 3, "config model.name: expected a string"),  # mashumaro: str(3)
    ],
)
def test_a_task_refuses_a_wrong_type_instead_of_coercing_it(section, key, value, match):
    with pytest.raises(ValueError) as err:
        _task_input(section, key, value)
    chain = []
    exc: BaseException | None = err.value
    while exc is not None:  # mashumaro wraps our error of a nested section in InvalidFieldValue
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(match in message for message in chain), chain


def test_a_task_accepts_well_typed_input():
    assert _task_input("optim", "lr", 2e-5).optim.lr == 2e-5
    assert _task_input("grpo", "max_num_steps", 4.0).grpo.max_num_steps == 4  # a JSON struct's 4.0 for an int


# ---------------------------------------------------------------- credentials


def test_flat_params_redact_credentials_in_urls():
    cfg = config_from_dict(
        {"tracking": {"uri": "http://alice:s3cret@host:5000"}, "dataplane": {"root": "s3://AKIA:hush@bucket/prefix"}}
    )
    params = cfg.flat_params()
    assert params["tracking.uri"] == "http://***@host:5000"
    assert params["dataplane.root"] == "s3://***@bucket/prefix"
    assert not any("s3cret" in v or "hush" in v for v in params.values())
    assert cfg.tracking.uri == "http://alice:s3cret@host:5000"  # MLflow itself still gets the real URI


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"passwd": "x"}, "dataplane.storage_options.passwd"),
        ({"pwd": "x"}, "dataplane.storage_options.pwd"),
        ({"auth": "x"}, "dataplane.storage_options.auth"),
        ({"credentials": "x"}, "dataplane.storage_options.credentials"),
        ({"session": "x"}, "dataplane.storage_options.session"),
        ({"headers": {"Authorization": "Bearer x"}}, "dataplane.storage_options.headers"),
        (
            {"client_kwargs": {"aws_secret_access_key": "x"}},
            "dataplane.storage_options.client_kwargs.aws_secret_access_key",
        ),
        ({"client_kwargs": {"aws_session_token": "x"}}, "dataplane.storage_options.client_kwargs.aws_session_token"),
        ({"endpoint_url": "http://u:p@minio:9000"}, "dataplane.storage_options.endpoint_url"),
    ],
)
def test_credentials_in_storage_options_are_refused(options, key):
    with pytest.raises(ValueError, match=rf"config {key}: .*environment \(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY"):
        config_from_dict({"dataplane": {"storage_options": options}})


def test_non_secret_storage_options_are_accepted():
    options = {
        "endpoint_url": "http://minio:9000",
        "anon": False,
        "use_ssl": True,
        "requester_pays": True,
        "client_kwargs": {"region_name": "us-east-1"},
        "config_kwargs": {"signature_version": "s3v4"},
        "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/runs"},
    }
    assert config_from_dict({"dataplane": {"storage_options": options}}).dataplane.storage_options == options


# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("root", "match"),
    [
        ("s3:/bucket", r"config dataplane.root: 's3:/bucket' looks like a URL with a malformed scheme"),
        ("s3:bucket", r"config dataplane.root: .*malformed scheme"),
        ("S3//bucket", r"config dataplane.root: .*missing the ':'"),
        ("s4://x", r"config dataplane.root: .*protocol 's4' is not known"),
        ("", r"config dataplane.root: is empty"),
        ("s3://bucket/p?x=1", r"config dataplane.root: .*query or fragment"),
    ],
)
def test_bad_dataplane_roots_are_refused(root, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({"dataplane": {"root": root}})


def test_tracking_uri_is_checked_loosely():
    with pytest.raises(ValueError, match="config tracking.uri: is empty"):
        config_from_dict({"tracking": {"uri": ""}})
    with pytest.raises(ValueError, match="config tracking.uri: .*leading or trailing spaces"):
        config_from_dict({"tracking": {"uri": " http://host:5000"}})
    accepted = (
        "http://user:pw@host:5000",
        "sqlite:///runs/mlflow.db",
        "runs/mlruns",
        "databricks",
        "mlruns",
        "./my runs",
        "/abs/my runs",
        "file:///abs/mlruns",
        "postgresql+psycopg2://u@db/mlflow",
        "https://host",
        "databricks://profile",
    )
    for uri in accepted:
        assert config_from_dict({"tracking": {"uri": uri}}).tracking.uri == uri


# ---------------------------------------------------------------- config files at URLs (load_config)


def test_load_config_reads_paths_and_file_urls(tmp_path, monkeypatch):
    y = tmp_path / "run.yaml"
    y.write_text("grpo:\n  max_num_steps: 6\noptim:\n  lr: 2.0e-5\n")
    assert load_config(str(y)).grpo.max_num_steps == 6
    assert load_config(y.as_uri()).optim.lr == 2e-5  # file:///...
    monkeypatch.chdir(tmp_path)
    assert load_config("run.yaml").grpo.max_num_steps == 6
    (tmp_path / "empty.yml").write_text("# all defaults\n")
    assert load_config("empty.yml") == GRPOConfig()
    (tmp_path / "run.JSON").write_text('{"grpo": {"max_num_steps": 3}}')
    assert load_config("run.JSON").grpo.max_num_steps == 3


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("nope.yaml", None, r"^config file 'nope.yaml': does not exist \(looked for /.*/nope.yaml\); check the path"),
        ("run.txt", "grpo: {}", r"^config file 'run.txt': is not a .yaml, .yml or .json file; give a YAML or JSON"),
        (
            "run.yaml",
            "grpo:\n  max_num_steps: [1\n",
            r"^config file 'run.yaml': is not valid YAML \(.*line 2.*\); check its indentation",
        ),
        (
            "run.json",
            '{"grpo": {"max_num_steps": 1,}}',
            r"^config file 'run.json': is not valid JSON \(Expecting property name .*\); check",
        ),
        ("run.yaml", "- grpo\n- optim\n", r"^config file 'run.yaml': holds a list, not a mapping of sections"),
        ("run.yaml", "just text", r"^config file 'run.yaml': holds the string 'just text', not a mapping of sections"),
        ("run.yaml", b"\xff\xfe\x00", r"^config file 'run.yaml': is not a text file"),
        (
            "run.yaml",
            "grpo:\n  max_num_steps: four\n",
            r"^config grpo.max_num_steps: expected a whole number, got the string 'four'",
        ),
        (
            "run.yaml",
            "grpo:\n  max_num_steps: 2\n  val_period: 1\n  max_num_steps: 3\n",
            r"^config file 'run.yaml': gives the key 'grpo.max_num_steps' twice \(lines 2 and 4\); keep one of them",
        ),
        (
            "run.yml",
            "grpo: {}\noptim: {lr: 1.0e-5}\ngrpo: {max_num_steps: 2}\n",
            r"^config file 'run.yml': gives the key 'grpo' twice \(lines 1 and 3\)",
        ),
        (
            "run.json",
            '{"optim": {"lr": 1e-5}, "grpo": {"max_num_steps": 2, "max_num_steps": 3}}',
            r"^config file 'run.json': gives the key 'grpo.max_num_steps' twice; keep one",
        ),
        (
            "run.yaml",
            "dataplane:\n  storage_options: &o {anon: *o}\n",
            r"^config file 'run.yaml': dataplane.storage_options.anon is an alias of 'dataplane.storage_options' "
            r"inside",
        ),
        (
            "run.yaml",
            "&root {grpo: *root}\n",
            r"^config file 'run.yaml': grpo is an alias of the document inside the document itself",
        ),
        (
            "run.yaml",
            "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            + "".join(f"{k}: &{k} [{', '.join([f'*{j}'] * 10)}]\n" for j, k in zip("abcd", "bcde")),
            r"^config file 'run.yaml': e expands to more than 100000 values",
        ),
        ("run.yaml", "[" * 5000 + "]" * 5000, r"^config file 'run.yaml': nests too deeply to read"),
        ("run.json", "[" * 100_000 + "]" * 100_000, r"^config file 'run.json': nests too deeply to read"),
    ],
)
def test_load_config_says_what_is_wrong_with_the_file(tmp_path, monkeypatch, name, content, match):
    monkeypatch.chdir(tmp_path)
    if isinstance(content, bytes):
        (tmp_path / name).write_bytes(content)
    elif content is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=match):
        load_config(name)


def test_yaml_merge_keys_may_be_overridden_and_inline_json_keys_are_unique(tmp_path):
    """A ``<<: *base`` merge and a key that overrides it is no duplicate; two keys in one inline JSON object are."""
    y = tmp_path / "run.yaml"
    y.write_text("base: &base {max_num_steps: 2, val_period: 1}\ngrpo:\n  <<: *base\n  max_num_steps: 3\n")
    with pytest.raises(ValueError, match=r"^config root: unknown keys \['base'\]"):  # the anchor's key is a key too
        load_config(str(y))
    y.write_text("grpo: &g {max_num_steps: 2, val_period: 1}\noptim: {}\n")
    assert load_config(str(y)).grpo.max_num_steps == 2  # an alias used once is fine
    with pytest.raises(ValueError, match=r"^config \(inline JSON\): gives the key 'grpo' twice; keep one of them"):
        load_config('{"grpo": {}, "grpo": {"max_num_steps": 2}}')
    with pytest.raises(ValueError, match=r"^config: gives the key 'optim.lr' twice; keep one of them"):
        GRPOConfig.from_json('{"optim": {"lr": 1e-5, "lr": 2e-5}}')


def test_load_config_refuses_folders_and_unknown_protocols(tmp_path):
    (tmp_path / "configs.yaml").mkdir()
    with pytest.raises(ValueError, match=r"config file '.*configs.yaml': is a folder; name the config file inside it"):
        load_config(str(tmp_path / "configs.yaml"))
    with pytest.raises(
        ValueError, match=r"config file 's4://bucket/x.yaml': cannot be read \(ValueError: Protocol not known: s4\)"
    ):
        load_config("s4://bucket/x.yaml")
    with pytest.raises(ValueError, match=r"config \(inline JSON\): is not valid JSON"):
        load_config('{"grpo": ')


def test_env_storage_options_follow_flytekit(monkeypatch):
    for name in ("FLYTE_AWS_ENDPOINT", "FLYTE_AWS_ACCESS_KEY_ID", "FLYTE_AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert env_storage_options("s3") == {}
    monkeypatch.setenv("FLYTE_AWS_ENDPOINT", "http://localhost:30002")
    monkeypatch.setenv("FLYTE_AWS_ACCESS_KEY_ID", "minio")
    monkeypatch.setenv("FLYTE_AWS_SECRET_ACCESS_KEY", "miniostorage")
    assert env_storage_options("s3") == {
        "endpoint_url": "http://localhost:30002",
        "key": "minio",
        "secret": "miniostorage",
    }
    assert env_storage_options("gs") == {} and env_storage_options("file") == {}


def test_load_config_reads_s3_with_the_flyte_environment(s3_server, monkeypatch):
    """A config on S3 (moto on loopback), reached as a Flyte pod reaches it: FLYTE_AWS_* in the environment."""
    url = put_config_on_s3(s3_server, monkeypatch, "configs/run.yaml", b"grpo:\n  max_num_steps: 5\n")
    assert load_config(url).grpo.max_num_steps == 5
    with pytest.raises(ValueError, match=r"^config file 's3://grpoflow/configs/nope.yaml': does not exist; check"):
        load_config("s3://grpoflow/configs/nope.yaml")
    monkeypatch.delenv("FLYTE_AWS_ENDPOINT")  # explicit options replace the environment's
    cfg = load_config("s3://grpoflow/configs/run.yaml", storage_options={"endpoint_url": s3_server})
    assert cfg.grpo.max_num_steps == 5


# ---------------------------------------------------------------- descriptions: Flyte's schema, docs/config.md


def test_every_leaf_field_has_a_docstring():
    missing = [key for key, doc in leaf_docs(GRPOConfig) if not doc]
    assert missing == [], f"document these fields with a string right under them: {missing}"


def test_the_root_has_no_docstring_of_its_own():
    assert class_doc(GRPOConfig) is None  # no docstring written: not the signature @dataclass makes up


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_flyte_schema_describes_every_field():
    """flytekit puts mashumaro's JSON schema of the config into the input's literal type; each property carries its
    field's docstring as ``description``."""
    from flytekit.core.type_engine import TypeEngine

    schema = TypeEngine.to_literal_type(GRPOConfig).metadata
    assert schema["properties"]["optim"]["properties"]["lr"] == {
        "type": "number",
        "description": "AdamW learning rate after warmup.",
        "default": 1e-5,
    }
    assert {key: schema for key, (schema, doc) in schema_descriptions(GRPOConfig).items() if schema != doc} == {}


def test_config_reference_is_up_to_date():
    """docs/config.md is generated from the dataclasses: regenerate it with ``python scripts/config_reference.py``."""
    root = Path(__file__).resolve().parents[3]
    render = runpy.run_path(str(root / "scripts" / "config_reference.py"))["render"]
    text = render()
    assert (root / "docs" / "config.md").read_text() == text, (
        "docs/config.md is stale: run python scripts/config_reference.py"
    )
    for key, _ in leaf_docs(GRPOConfig):
        assert f"| `{key}` |" in text
    assert "| `optim.lr` | number | `1e-05` | AdamW learning rate after warmup. |" in text
    assert "| `grpo.advantage_clip` | number or null | `null` |" in text


def test_load_config_keeps_a_dropped_connection_transient(tmp_path):
    """A task retries a transient failure (``tasks/retry.py``): the ValueError keeps the connection error as its cause,
    while a missing file stays permanent."""

    with socket.socket() as s:  # a port nothing listens on: the connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        ValueError, match=rf"^config file 'http://127.0.0.1:{port}/run.yaml': cannot be read \(ClientConnectorError: "
    ) as refused:
        load_config(f"http://127.0.0.1:{port}/run.yaml")  # fsspec's HTTP filesystem calls this a missing file
    assert is_transient(refused.value)
    with pytest.raises(ValueError, match="does not exist") as missing:
        load_config(str(tmp_path / "nope.yaml"))
    assert not is_transient(missing.value)
