"""Where each task runs on a cluster (``tasks/placement.py``): the static ``@task`` arguments, and the step loop's
nodes compiled offline (``workflows.registration.step_loop_nodes``) with the images faked, as a pod compiles them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from flytekit import Resources
from flytekit.models.task import Resources as ResourcesModel

import workflows.launch_plans  # noqa: F401 (registers every project entity)
from images.cpu import cpu_image
from images.rollout_gpu import rollout_gpu_image
from images.train_gpu import train_gpu_image
from tasks import placement
from tasks.advantages import advantages
from tasks.evaluate import evaluate, find_checkpoint
from tasks.logprobs import reference_logprobs
from tasks.rollout import rollout
from tasks.run_config import RunConfig, TrainResources, load_run_config, run_config_from_dict
from tasks.train import train
from workflows import registration
from workflows.grpo import training_loop

ROOT = Path(__file__).resolve().parents[2]
CPU, GPU, MEM = ResourcesModel.ResourceName.CPU, ResourcesModel.ResourceName.GPU, ResourcesModel.ResourceName.MEMORY
STEP_TASKS = ["rollout", "reference-logprobs", "advantages", "train"]
"""The nodes of an on-policy step, in the order the loop creates them."""


def _compile(cfg: RunConfig, ss=None):
    """The step loop's nodes for ``cfg`` (images faked), and the image names asked for."""
    with registration.fake_images() as asked:
        spec = registration.step_loop_nodes(cfg, ss if ss is not None else registration.settings())
    return spec, asked


def _cluster(steps: int = 2) -> RunConfig:
    """configs/cluster.yaml, shortened to ``steps`` steps with validation after the last."""
    cfg = load_run_config(str(ROOT / "configs" / "cluster.yaml"))
    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, max_num_steps=steps, val_period=steps))


def _by_id(spec) -> dict:
    return {n.id: n for n in spec.nodes}


def _entries(entries) -> dict[int, str]:
    return {e.name: e.value for e in entries}


def _placement(node) -> dict:
    """A node's overrides as plain values."""
    o = node.task_node.overrides
    ext = o.extended_resources
    return {
        "requests": _entries(o.resources.requests),
        "limits": _entries(o.resources.limits),
        "accelerator": ext.gpu_accelerator.device if ext is not None and ext.HasField("gpu_accelerator") else None,
        "shared_memory": ext.shared_memory.size_limit if ext is not None and ext.HasField("shared_memory") else None,
        "image": o.container_image,
    }


# ---------------------------------------------------------------- declared (the registered tasks)


def _static(kwargs: dict) -> dict:
    """The image and resources of ``declared``'s keyword arguments."""
    return {k: kwargs[k] for k in ("container_image", "requests", "limits")}


def test_declared_train_is_the_train_image_with_default_resources_as_requests_and_limits():
    kwargs = placement.declared("train")
    res = TrainResources()
    assert (res.cpu, res.memory, res.gpu) == ("2", "16Gi", 0)
    assert _static(kwargs) == {
        "container_image": train_gpu_image,
        "requests": Resources(cpu="2", mem="16Gi"),
        "limits": Resources(cpu="2", mem="16Gi"),
    }
    assert "accelerator" not in kwargs and "shared_memory" not in kwargs  # the default config asks for no GPU


def test_declared_rollout_and_cpu_classes():
    assert _static(placement.declared("rollout")) == {
        "container_image": rollout_gpu_image,
        "requests": Resources(cpu="2", mem="8Gi"),
        "limits": Resources(cpu="2", mem="8Gi"),
    }
    assert _static(placement.declared("cpu")) == {
        "container_image": cpu_image,
        "requests": Resources(cpu="2", mem="4Gi"),
        "limits": Resources(cpu="2", mem="4Gi"),
    }


def test_registered_tasks_carry_their_class():
    expected = {
        rollout: rollout_gpu_image,
        evaluate: rollout_gpu_image,
        train: train_gpu_image,
        advantages: cpu_image,
        find_checkpoint: cpu_image,
        training_loop: cpu_image,
    }
    for task, image in expected.items():
        assert task.container_image is image, task.name
    assert train.resources.requests == Resources(cpu="2", mem="16Gi") == train.resources.limits


def test_every_task_has_a_role():
    assert placement.role_of("tasks.logprobs.policy_logprobs") == "train"
    assert placement.role_of("validate") == "rollout"
    assert placement.role_of("workflows.grpo.training_loop") == "cpu"
    with pytest.raises(KeyError, match=r"task 'tasks.x.unknown' has no resource class: add it to tasks.placement.ROLE"):
        placement.role_of("tasks.x.unknown")


def test_overrides_of_a_full_image_reference_outside_a_compilation():
    cfg = run_config_from_dict(
        {
            "resources": {
                "rollout": {"image": "ghcr.io/acme/x:1", "gpu": 2, "accelerator": "nvidia-l4", "memory": "32Gi"}
            }
        }
    )
    out = placement.overrides(cfg, "rollout")
    assert out["requests"] == out["limits"] == Resources(cpu="2", mem="32Gi", gpu=2)
    assert out["accelerator"].to_flyte_idl().device == "nvidia-l4"
    assert out["container_image"] == "ghcr.io/acme/x:1"
    assert "shared_memory" not in out
    assert placement.image_reference("default", "train") is None
    assert placement.image_reference("train-gpu", "train") is None  # the class's own image: the task's
    assert "container_image" not in placement.overrides(RunConfig(), "cpu")


# ---------------------------------------------------------------- the compiled step loop


def test_cluster_config_places_every_node():
    cfg = _cluster(steps=2)
    spec, asked = _compile(cfg)
    ids = [n.id for n in spec.nodes]
    assert ids == [
        *(f"step-1-{t}" for t in STEP_TASKS),
        *(f"step-2-{t}" for t in STEP_TASKS),
        "step-2-validate",
        "end-finish-run",
    ]
    nodes = _by_id(spec)
    assert nodes["step-1-rollout"].task_node.reference_id.name == "tasks.rollout.rollout"
    assert nodes["step-2-validate"].task_node.reference_id.name == "tasks.validate.validate"
    assert nodes["end-finish-run"].task_node.reference_id.name == "tasks.finish.finish_run"

    rollout = {"requests": {CPU: "8", MEM: "64Gi", GPU: "1"}, "accelerator": "nvidia-h100", "shared_memory": "16Gi"}
    train = {"requests": {CPU: "8", MEM: "128Gi", GPU: "1"}, "accelerator": "nvidia-h100", "shared_memory": "16Gi"}
    cpu = {"requests": {CPU: "2", MEM: "8Gi"}, "accelerator": None, "shared_memory": None}
    expected = {
        "rollout": rollout,
        "validate": rollout,
        "reference-logprobs": train,
        "train": train,
        "advantages": cpu,
        "finish-run": cpu,
    }
    for node_id, node in nodes.items():
        task = re.sub(r"^(step-\d+|end)-", "", node_id)
        got = _placement(node)
        want = expected[task]
        assert got["requests"] == got["limits"] == want["requests"], node_id
        assert (got["accelerator"], got["shared_memory"]) == (want["accelerator"], want["shared_memory"]), node_id
        assert got["image"] is None, node_id  # no override: each task's own image
    shm = nodes["step-1-rollout"].task_node.overrides.extended_resources.shared_memory
    assert (shm.mount_path, shm.size_limit) == ("/dev/shm", "16Gi")
    # the tasks compiled with the loop are on their ImageSpecs (faked names)
    images = {t.id.name: t.container.image for t in spec.tasks}
    assert images["tasks.rollout.rollout"] == rollout_gpu_image.image_name()
    assert images["tasks.train.train"] == train_gpu_image.image_name()
    assert images["tasks.advantages.advantages"] == cpu_image.image_name()
    assert set(asked) == {cpu_image.image_name(), rollout_gpu_image.image_name(), train_gpu_image.image_name()}


def test_default_config_is_on_policy_without_policy_logprobs_nodes():
    cfg = RunConfig()
    assert cfg.on_policy
    spec, _ = _compile(cfg)
    ids = [n.id for n in spec.nodes]
    assert not [i for i in ids if "policy-logprobs" in i and "reference" not in i]
    assert ids == [*(f"step-{k}-{t}" for k in range(1, 5) for t in STEP_TASKS), "step-4-validate", "end-finish-run"]
    # the default config's resources: the declared ones, no GPU
    assert _placement(_by_id(spec)["step-1-train"])["requests"] == {CPU: "2", MEM: "16Gi"}
    assert _placement(_by_id(spec)["step-1-rollout"])["requests"] == {CPU: "2", MEM: "8Gi"}


def test_off_policy_config_has_a_policy_logprobs_node_per_step():
    cfg = run_config_from_dict(
        {
            "grpo": {"max_num_steps": 2, "val_period": 0},
            "optim": {"train_global_batch_size": 32},
            "resources": {"train": {"gpu": 2, "memory": "64Gi"}},
        }
    )
    assert cfg.samples_per_step == 64 and not cfg.on_policy
    spec, _ = _compile(cfg)
    ids = [n.id for n in spec.nodes]
    assert ids == [
        *(
            f"step-{k}-{t}"
            for k in (1, 2)
            for t in ("rollout", "policy-logprobs", "reference-logprobs", "advantages", "train")
        ),
        "end-finish-run",
    ]
    node = _by_id(spec)["step-2-policy-logprobs"]
    assert node.task_node.reference_id.name == "tasks.logprobs.policy_logprobs"
    got = _placement(node)
    assert got["requests"] == got["limits"] == {CPU: "2", MEM: "64Gi", GPU: "2"}


def test_image_reference_goes_on_train_class_nodes_only():
    cfg = run_config_from_dict(
        {
            "grpo": {"max_num_steps": 1, "val_period": 1},
            "optim": {"train_global_batch_size": 32},
            "resources": {"train": {"image": "ghcr.io/acme/x:1"}},
        }
    )
    spec, _ = _compile(cfg)
    images = {n.id: _placement(n)["image"] for n in spec.nodes}
    assert images == {
        "step-1-rollout": None,
        "step-1-policy-logprobs": "ghcr.io/acme/x:1",
        "step-1-reference-logprobs": "ghcr.io/acme/x:1",
        "step-1-advantages": None,
        "step-1-train": "ghcr.io/acme/x:1",
        "step-1-validate": None,
        "end-finish-run": None,
    }


@pytest.fixture(scope="module")
def registered_settings():
    """Serialization settings after serializing every entity: the ImageSpecs are registered in its image config,
    as in the serialized context a cluster hands the step loop's pod."""
    from flytekit.core.context_manager import FlyteEntities

    ours = [
        e for e in FlyteEntities.entities if str(getattr(e, "instantiated_in", "")).startswith(("tasks.", "workflows."))
    ]
    ss = registration.settings()
    with pytest.MonkeyPatch.context() as mp, registration.fake_images():
        mp.setattr(FlyteEntities, "entities", ours)  # other test modules' entities are not this check's business
        registration.serialize(ss)
    return ss


def test_named_image_resolves_to_its_registered_name(registered_settings):
    cfg = run_config_from_dict(
        {
            "grpo": {"max_num_steps": 1, "val_period": 0},
            "resources": {
                "train": {"image": "cpu"},
                "cpu": {"image": "rollout-gpu"},
                "rollout": {"image": "rollout-gpu"},
            },
        }
    )
    spec, _ = _compile(cfg, registered_settings)
    images = {n.id: _placement(n)["image"] for n in spec.nodes}
    assert cpu_image.image_name().startswith("grpoflow-cpu:")
    assert images == {
        "step-1-rollout": None,  # its own image
        "step-1-reference-logprobs": cpu_image.image_name(),
        "step-1-advantages": rollout_gpu_image.image_name(),
        "step-1-train": cpu_image.image_name(),
        "end-finish-run": rollout_gpu_image.image_name(),
    }


def test_named_image_unknown_to_the_execution_is_refused():
    cfg = run_config_from_dict(
        {"grpo": {"max_num_steps": 1, "val_period": 0}, "resources": {"train": {"image": "cpu"}}}
    )
    ss = registration.settings()  # nothing serialized into it: no ImageSpec is known
    with pytest.raises(
        ValueError,
        match=r"config resources.train.image: the 'cpu' image is not known to this execution .* use a full image "
        r"reference",
    ):
        _compile(cfg, ss)


# ---------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        (
            {"train": {"memory": "lots"}},
            "config resources.train.memory: 'lots' is not a positive Kubernetes quantity; use e.g. '2', '500m', '16Gi'",
        ),
        (
            {"rollout": {"cpu": "0"}},
            "config resources.rollout.cpu: '0' is not a positive Kubernetes quantity; use e.g. '2', '500m', '16Gi'",
        ),
        (
            {"cpu": {"shared_memory": "16GB"}},
            "config resources.cpu.shared_memory: '16GB' is not a positive Kubernetes quantity; use e.g. '2', '500m', "
            "'16Gi'",
        ),
        (
            {"rollout": {"accelerator": "nvidia-h100"}},
            "config resources.rollout.accelerator: 'nvidia-h100' is set but gpu is 0; set gpu >= 1 or accelerator: "
            "null",
        ),
        (
            {"train": {"gpu": 1, "accelerator": "NVIDIA H100"}},
            "config resources.train.accelerator: 'NVIDIA H100' is not an accelerator name; use e.g. 'nvidia-h100' or "
            "'nvidia-tesla-a100'",
        ),
        ({"train": {"gpu": -1}}, "config resources.train.gpu: is -1; use 0 (CPU) or the number of GPUs per task"),
        (
            {"cpu": {"image": "my image"}},
            "config resources.cpu.image: 'my image' is neither an image name nor an image reference; use one "
            "of ['default', 'cpu', 'rollout-gpu', 'train-gpu'] or a reference such as 'ghcr.io/acme/grpoflow:v1'",
        ),
        (
            {"cpu": {"image": "gpu"}},
            "config resources.cpu.image: 'gpu' is neither an image name nor an image reference",
        ),
    ],
)
def test_resources_validation(resources, message):
    with pytest.raises(ValueError) as err:
        run_config_from_dict({"resources": resources})
    assert str(err.value).startswith(message)


def test_resources_unknown_key_names_its_section():
    with pytest.raises(ValueError, match=r"^config resources.train: unknown keys \['gpus'\]"):
        run_config_from_dict({"resources": {"train": {"gpus": 1}}})


def test_resources_valid_values_accepted():
    cfg = run_config_from_dict(
        {
            "resources": {
                "train": {
                    "gpu": 8,
                    "accelerator": "nvidia-tesla-a100",
                    "cpu": "500m",
                    "memory": "1.5Ti",
                    "shared_memory": "64Gi",
                    "image": "registry.local:5000/grpoflow",
                }
            }
        }
    )
    assert (cfg.resources.train.cpu, cfg.resources.train.memory, cfg.resources.train.image) == (
        "500m",
        "1.5Ti",
        "registry.local:5000/grpoflow",
    )


def test_model_tasks_of_several_nodes_are_pytorch_jobs_with_the_configs_ranks():
    before = train.task_config, reference_logprobs.task_config
    cfg = run_config_from_dict(
        {
            "grpo": {"max_num_steps": 1, "val_period": 0},
            "policy": {"nnodes": 2, "nproc_per_node": 4},
            "resources": {"train": {"gpu": 4}},
        }
    )
    try:
        spec, _ = _compile(cfg)
        tasks = {t.id.name: t for t in spec.tasks}
        for name in ("tasks.train.train", "tasks.logprobs.reference_logprobs"):
            assert tasks[name].type == "pytorch", name  # a Kubeflow PyTorchJob
            elastic = tasks[name].custom["elasticConfig"]
            assert (
                elastic["minReplicas"],
                elastic["maxReplicas"],
                elastic["nprocPerNode"],
                elastic["rdzvBackend"],
            ) == (2, 2, 4, "c10d")
            assert tasks[name].custom["workerReplicas"]["replicas"] == 2
        assert tasks["tasks.rollout.rollout"].type == "python-task"
        assert _placement(_by_id(spec)["step-1-train"])["requests"][GPU] == "4"  # one GPU per rank of a node
    finally:
        train._task_config, reference_logprobs._task_config = before


def test_model_tasks_of_one_node_stay_plain_pods():
    spec, _ = _compile(
        run_config_from_dict(
            {
                "grpo": {"max_num_steps": 1, "val_period": 0},
                "policy": {"nproc_per_node": 4},
                "resources": {"train": {"gpu": 4}},
            }
        )
    )
    tasks = {t.id.name: t for t in spec.tasks}
    # one node: the ranks are processes of the task's pod, started by the task itself from the config it reads
    assert tasks["tasks.train.train"].type == "python-task"


def test_ranks_per_node_need_a_gpu_each():
    with pytest.raises(
        ValueError, match=r"config policy.nproc_per_node: is 4 but resources.train.gpu is 2; give each rank its own GPU"
    ):
        run_config_from_dict({"policy": {"nproc_per_node": 4}, "resources": {"train": {"gpu": 2}}})
    with pytest.raises(ValueError, match=r"config policy.nnodes: is 0; use 1 or more"):
        run_config_from_dict({"policy": {"nnodes": 0}})


@pytest.mark.parametrize("age", [0, 1, 2])
def test_async_rollout_of_step_k_waits_only_for_the_policy_of_step_k_minus_1_minus_a(age):
    """The serialized step loop: each rollout node's ``policy`` input is bound to the train node a steps before the
    step's own input policy (the start policy, a literal, for the first a + 1 steps), and nothing else is upstream of
    it, so on a cluster rollout k runs beside the training of steps k - a .. k - 1."""
    cfg = run_config_from_dict(
        {
            "grpo": {"max_num_steps": 4, "val_period": 0, "max_trajectory_age_steps": age},
            "loss": {"use_importance_sampling_correction": age > 0},
        }
    )
    spec, _ = _compile(cfg)
    nodes = _by_id(spec)
    for k in range(1, 5):
        rollout = nodes[f"step-{k}-rollout"]
        (policy,) = [b.binding for b in rollout.inputs if b.var == "policy"]
        source = k - 1 - age
        if source >= 1:
            assert policy.promise.node_id == f"step-{source}-train"
            assert list(rollout.upstream_node_ids) == [f"step-{source}-train"]
        else:
            assert policy.promise is None and policy.scalar is not None  # the run's start policy
            assert list(rollout.upstream_node_ids) == []
        # the step trains the policy of the step before it, whatever sampled it
        (trained,) = [b.binding for b in nodes[f"step-{k}-train"].inputs if b.var == "policy"]
        if k > 1:
            assert trained.promise.node_id == f"step-{k - 1}-train"


# ---------------------------------------------------------------- several steps per task


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_k_steps_per_task_compile_to_one_train_class_node_per_k_steps(backend, registered_settings):
    cfg = _cluster(steps=5)
    cfg = dataclasses.replace(
        cfg,
        generation=dataclasses.replace(cfg.generation, backend=backend),
        resources=dataclasses.replace(cfg.resources, steps_per_task=2),
    )
    spec, _ = _compile(cfg, registered_settings)
    assert [n.id for n in spec.nodes] == [
        "steps-1-2-grpo-steps",
        "steps-3-4-grpo-steps",
        "steps-5-5-grpo-steps",
        "end-finish-run",
    ]
    assert {n.task_node.reference_id.name for n in spec.nodes[:3]} == {"workflows.grpo.grpo_steps"}
    got = _placement(spec.nodes[0])
    assert (
        got["requests"]
        == got["limits"]
        == {CPU: cfg.resources.train.cpu, MEM: cfg.resources.train.memory, GPU: str(cfg.resources.train.gpu)}
    )
    # vLLM is only in the rollout image (which also holds the transformers trainer); else the task's own train image
    expected = rollout_gpu_image.image_name() if backend == "vllm" else None
    assert {_placement(n)["image"] for n in spec.nodes[:3]} == {expected}
