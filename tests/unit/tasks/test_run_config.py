"""`RunConfig` (``tasks/run_config.py``): `rl.config.GRPOConfig` plus the cluster's ``resources``, checked, documented
and carried through Flyte like the rest of the config; `rl.config` itself knows no ``resources``."""

from __future__ import annotations

import os

import pytest

from rl.config import GRPOConfig, config_from_dict
from rl.config.descriptions import class_doc, field_docs
from tasks.run_config import (
    CPUResources,
    RolloutResources,
    RunConfig,
    TrainResources,
    check_placement,
    load_run_config,
    quantity,
    run_config_from_dict,
)
from tests.helpers import ROOT, config_leaves, leaf_docs, nested_dict, schema_descriptions

RESOURCES_LEAVES = [(key, hint) for key, hint in config_leaves(RunConfig) if key.startswith("resources.")]


def test_a_run_config_is_the_grpo_config_with_resources():
    cfg = run_config_from_dict({"grpo": {"max_num_steps": 3}, "resources": {"train": {"gpu": 1}}})
    assert isinstance(cfg, GRPOConfig) and cfg.grpo.max_num_steps == 3 and cfg.resources.train.gpu == 1
    assert [key for key, _ in config_leaves(RunConfig) if not key.startswith("resources.")] == [
        key for key, _ in config_leaves(GRPOConfig)
    ]
    assert cfg.flat_params()["resources.train.gpu"] == "1"
    assert not hasattr(GRPOConfig(), "resources")
    with pytest.raises(ValueError, match=r"^config root: unknown keys \['resources'\]; use only \['checkpointing', "):
        config_from_dict({"resources": {}})


def test_every_shipped_config_loads_as_a_run_config():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        assert type(load_run_config(str(path))) is RunConfig, path


@pytest.mark.parametrize(("key", "hint"), RESOURCES_LEAVES)
def test_every_resources_field_is_type_checked(key, hint):
    with pytest.raises(ValueError, match=rf"^config {key}: expected "):
        run_config_from_dict(nested_dict(key, [1]))


def test_resources_sections_built_directly_are_named_by_their_path():
    with pytest.raises(ValueError, match=r"^config resources.train.gpu: is -1; use 0 \(CPU\)"):
        TrainResources(gpu=-1)
    with pytest.raises(ValueError, match=r"^config resources.rollout.memory: expected a string, got the number 8"):
        RolloutResources(memory=8)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"resources": {"steps_per_task": 0}}, r"resources.steps_per_task: is 0; use 1 \(a node per task\)"),
        (
            {
                "resources": {"steps_per_task": 2},
                "grpo": {"max_trajectory_age_steps": 1},
                "loss": {"use_importance_sampling_correction": True},
            },
            r"resources.steps_per_task: is 2 with grpo.max_trajectory_age_steps 1; use steps_per_task 1 for async GRPO",
        ),
        (
            {"resources": {"steps_per_task": 2, "train": {"gpu": 2}}, "policy": {"nproc_per_node": 2}},
            r"is 2 with 2 training processes; use steps_per_task 1 with data- or model-parallel ranks",
        ),
        (
            {"resources": {"steps_per_task": 2}, "policy": {"backend": "megatron"}, "generation": {"backend": "vllm"}},
            r"no image holds both",
        ),
    ],
)
def test_steps_per_task_refuses_what_one_task_cannot_run(data, match):
    with pytest.raises(ValueError, match=match):
        run_config_from_dict(data)
    assert run_config_from_dict({"resources": {"steps_per_task": 4}}).resources.steps_per_task == 4


def test_the_grpo_checks_still_run():
    with pytest.raises(ValueError, match=r"^config optim.train_global_batch_size: 48 does not divide"):
        run_config_from_dict({"optim": {"train_global_batch_size": 48, "train_micro_batch_size": 8}})


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # flytekit's import of click.__version__
def test_from_json_as_pyflyte_run_parses_cfg():
    from flytekit.interaction.click_types import JsonParamType

    cfg = JsonParamType(RunConfig).convert(
        '{"resources": {"train": {"gpu": 1, "accelerator": "nvidia-l4"}}}', None, None
    )
    assert type(cfg) is RunConfig and cfg.resources.train.accelerator == "nvidia-l4"
    with pytest.raises(ValueError, match=r"^config resources.train: unknown keys \['gpus'\]"):
        RunConfig.from_json('{"resources": {"train": {"gpus": 1}}}')


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_resources_cross_a_task_boundary():
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    cfg = run_config_from_dict(
        {
            "resources": {"train": {"gpu": 2, "shared_memory": "16Gi"}, "steps_per_task": 3},
            "policy": {"nproc_per_node": 1},
        }
    )
    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, cfg, RunConfig, TypeEngine.to_literal_type(RunConfig))
    assert TypeEngine.to_python_value(ctx, literal, RunConfig) == cfg


# ---------------------------------------------------------------- descriptions


def test_every_resources_field_has_a_docstring():
    missing = [key for key, doc in leaf_docs(RunConfig) if not doc]
    assert missing == [], f"document these fields with a string right under them: {missing}"


def test_field_docs_are_read_from_the_class_that_declares_the_field():
    assert (
        field_docs(TrainResources)["memory"] == "Memory request and limit, a Kubernetes quantity (``16Gi``, ``256Gi``)."
    )
    assert (
        field_docs(RolloutResources)["memory"] == "Memory request and limit, a Kubernetes quantity (``8Gi``, ``64Gi``)."
    )
    assert field_docs(CPUResources)["gpu"] == "GPUs per task (``nvidia.com/gpu``); 0 runs on CPU."  # inherited
    assert class_doc(RunConfig) is None


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_flyte_schema_describes_every_field():
    from flytekit.core.type_engine import TypeEngine

    resources = TypeEngine.to_literal_type(RunConfig).metadata["properties"]["resources"]
    assert (
        resources["description"] == "Images and resources of each class of tasks on a cluster (ignored by local runs)."
    )
    assert (
        resources["properties"]["train"]["properties"]["memory"]["description"]
        == "Memory request and limit, a Kubernetes quantity (`16Gi`, `256Gi`)."
    )
    assert {key: schema for key, (schema, doc) in schema_descriptions(RunConfig).items() if schema != doc} == {}


def test_config_reference_documents_resources():
    text = (ROOT / "docs" / "config.md").read_text()
    for key, _ in RESOURCES_LEAVES:
        assert f"| `{key}` |" in text
    assert "- [`resources.train`](#resourcestrain)" in text


def test_quantities_read_as_kubernetes_does():
    assert (
        quantity("500m") == 0.5
        and quantity("2") == 2.0
        and quantity("16Gi") == 16 * 2**30
        and quantity("1.5G") == 1.5e9
    )


@pytest.mark.parametrize(
    ("data", "local", "match"),
    [
        (
            {"policy": {"nproc_per_node": 1000}},
            True,
            r"^config policy.nproc_per_node: is 1000 but this machine has 2 CPU cores "
            r"\(a local run starts every rank here\); use at most 2$",
        ),
        (
            {"generation": {"backend": "vllm", "vllm_cfg": {"cpu_kv_cache_gib": 1e6}}},
            True,
            r"^config generation.vllm_cfg.cpu_kv_cache_gib: is 1e\+06 GiB but this machine has 16.0 GiB of memory",
        ),
        (
            {"policy": {"backend": "megatron"}},
            False,
            r"^config resources.train.gpu: is 0 but policy.backend 'megatron' runs only on CUDA GPUs; "
            r"set it to policy.nproc_per_node$",
        ),
        (
            {"policy": {"nproc_per_node": 1000}},
            False,
            r"^config policy.nproc_per_node: is 1000 CPU ranks but resources.train.cpu gives each train pod 2 cores; "
            r"use at most 2 ranks",
        ),
        (
            {"policy": {"nproc_per_node": 3}, "resources": {"train": {"cpu": "2500m"}}},
            False,
            None,
        ),  # 2.5 cores hold 3 ranks
        (
            {"policy": {"nproc_per_node": 4}, "resources": {"train": {"cpu": "2500m"}}},
            False,
            r"gives each train pod 2500m cores; use at most 3 ranks",
        ),
        (
            {"generation": {"backend": "vllm", "vllm_cfg": {"cpu_kv_cache_gib": 1e6}}},
            False,
            r"^config generation.vllm_cfg.cpu_kv_cache_gib: is 1e\+06 GiB "
            r"but a rollout pod has resources.rollout.memory 8Gi",
        ),
        (
            {
                "generation": {"backend": "vllm", "vllm_cfg": {"cpu_kv_cache_gib": 64}},
                "resources": {"rollout": {"gpu": 1}},
            },
            False,
            None,
        ),  # CUDA: no CPU cache
        ({"policy": {"backend": "megatron", "nproc_per_node": 2}, "resources": {"train": {"gpu": 2}}}, False, None),
    ],
)
def test_placement_refuses_what_the_machine_or_the_pods_cannot_hold(monkeypatch, data, local, match):

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 * 2**30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    cfg = run_config_from_dict(data)  # a valid config in itself
    if match is None:
        check_placement(cfg, local=local)
        return
    with pytest.raises(ValueError, match=match):
        check_placement(cfg, local=local)


@pytest.mark.parametrize(
    ("remote", "cfg"),
    [(True, '{"policy": {"backend": "megatron"}}'), (False, '{"policy": {"nproc_per_node": 100000}}')],
)
def test_pyflyte_run_checks_the_placement_of_its_run_before_submitting(remote, cfg):
    from click.testing import CliRunner
    from flytekit.clis.sdk_in_container.pyflyte import main

    args = ["run", *(["--remote"] if remote else []), str(ROOT / "workflows/grpo.py"), "grpo", "--cfg", cfg]
    result = CliRunner().invoke(main, args)
    out = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, out  # click's usage error: nothing was submitted or run
    key = "resources.train.gpu" if remote else "policy.nproc_per_node"
    assert f"Invalid value for '--cfg': config {key}: " in out and "Traceback" not in out
