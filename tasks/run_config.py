"""`RunConfig`: the config a run is launched with, `rl.config.GRPOConfig` plus the cluster's ``resources`` section
(where each class of tasks runs: its image and Kubernetes resources, and how many steps one task runs). Every Flyte
task and workflow takes one; `rl` code takes it as the `GRPOConfig` it is. ``tasks/placement.py`` reads
``resources`` to place the tasks; a local run ignores it. No flytekit import: the checks run wherever a config is
built.

    run_config_from_dict({"grpo": {"max_num_steps": 2}, "resources": {"train": {"gpu": 1}}})
    load_run_config("configs/cluster.yaml")
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rl.config import GRPOConfig, config_from_dict, load_config
from rl.config.checks import Section, check_fields, config_root, fail, section_name
from rl.config.descriptions import document_tree
from tasks.cli import install_config_options

_QUANTITY = re.compile(r"(\d+(\.\d+)?|\.\d+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
"""A Kubernetes resource quantity: ``2``, ``500m``, ``16Gi``, ``1.5``."""
_IMAGE_NAMES = ("default", "cpu", "rollout-gpu", "train-gpu")


@dataclass
class TaskResources(Section):
    """Where a class of tasks runs on a cluster: its container image and its Kubernetes resources. Read only by
    remote executions (a local run shares this machine). See ``tasks/placement.py``."""

    image: str = "default"
    """``default`` (the class's own ImageSpec in ``images/``), ``cpu``, ``rollout-gpu``, ``train-gpu`` (those
    ImageSpecs), or a full image reference such as ``ghcr.io/acme/grpoflow-train:v3``."""
    gpu: int = 0
    """GPUs per task (``nvidia.com/gpu``); 0 runs on CPU."""
    accelerator: str | None = None
    """GPU type the pod is scheduled on (Flyte's accelerator name: ``nvidia-h100``, ``nvidia-tesla-a100``,
    ``nvidia-l4``, ...); None: any GPU. Needs ``gpu`` >= 1."""
    cpu: str = "2"
    """CPU request and limit, a Kubernetes quantity (``2``, ``500m``)."""
    memory: str = "8Gi"
    """Memory request and limit, a Kubernetes quantity (``8Gi``, ``64Gi``)."""
    shared_memory: str | None = None
    """Size of ``/dev/shm`` (a Kubernetes quantity such as ``16Gi``; NCCL and vLLM need more than the default 64 MiB
    on GPUs); None keeps the container runtime's default."""

    def __post_init__(self) -> None:
        check_fields(self)
        where = section_name(type(self), "resources")
        if not (self.image in _IMAGE_NAMES or ("/" in self.image or ":" in self.image) and " " not in self.image):
            fail(f"{where}.image", f"{self.image!r} is neither an image name nor an image reference", f"use one of {list(_IMAGE_NAMES)} or a reference such as 'ghcr.io/acme/grpoflow:v1'")
        if self.gpu < 0:
            fail(f"{where}.gpu", f"is {self.gpu}", "use 0 (CPU) or the number of GPUs per task")
        if self.accelerator is not None and self.gpu == 0:
            fail(f"{where}.accelerator", f"{self.accelerator!r} is set but gpu is 0", "set gpu >= 1 or accelerator: null")
        if self.accelerator is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.accelerator):
            fail(f"{where}.accelerator", f"{self.accelerator!r} is not an accelerator name", "use e.g. 'nvidia-h100' or 'nvidia-tesla-a100'")
        for key in ("cpu", "memory", "shared_memory"):
            value = getattr(self, key)
            if value is not None and (not _QUANTITY.fullmatch(value) or float(re.match(r"[\d.]+", value).group()) <= 0):
                fail(f"{where}.{key}", f"{value!r} is not a positive Kubernetes quantity", "use e.g. '2', '500m', '16Gi'")


@dataclass
class RolloutResources(TaskResources):
    """``rollout`` and ``validate`` (and ``evaluate``): generation, on the rollout image."""


@dataclass
class TrainResources(TaskResources):
    """``policy_logprobs``, ``reference_logprobs`` and ``train``: forward and backward passes, on the train image."""

    memory: str = "16Gi"
    """Memory request and limit, a Kubernetes quantity (``16Gi``, ``256Gi``)."""


@dataclass
class CPUResources(TaskResources):
    """``start_run``, ``advantages``, ``finish_run`` and the step loop: bookkeeping, on the CPU image."""

    memory: str = "4Gi"
    """Memory request and limit, a Kubernetes quantity (``4Gi``)."""


@dataclass
class ResourcesConfig(Section):
    """Images and resources of each class of tasks on a cluster (ignored by local runs)."""

    rollout: RolloutResources = field(default_factory=RolloutResources)
    """Generation tasks: ``rollout``, ``validate``, ``evaluate``."""
    train: TrainResources = field(default_factory=TrainResources)
    """Model tasks: ``policy_logprobs``, ``reference_logprobs``, ``train``."""
    cpu: CPUResources = field(default_factory=CPUResources)
    """Bookkeeping tasks: ``advantages``, ``finish_run``, the step loop."""
    steps_per_task: int = 1
    """Consecutive GRPO steps one task runs, with its back-ends warm between them (the local executor's path): 1 is
    a node per task (rollout, logprobs, advantages, train) per step; K > 1 is one node per K steps, on the train
    class's resources, that loads the policy and optimizer state once and saves them once (each step still saves its
    weights and the checkpoints due), so a pod's start-up, engine start-up and storage round trips come once per K
    steps (``bench/cold_start.py``). Needs synchronous GRPO (``grpo.max_trajectory_age_steps`` 0), one training
    process (``policy.nnodes`` x ``nproc_per_node`` = 1), and back-ends that share an image (not megatron with
    vLLM). A local run gives the same results either way."""

    def __post_init__(self) -> None:
        check_fields(self)
        if type(self.steps_per_task) is not int or self.steps_per_task < 1:
            fail("resources.steps_per_task", f"is {self.steps_per_task!r}", "use 1 (a node per task) or the number of steps one task runs")


@config_root
@dataclass
class RunConfig(GRPOConfig):
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Images and resources of each class of tasks on a cluster (ignored by local runs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        gpus, ranks = self.resources.train.gpu, self.policy.nproc_per_node
        if 0 < gpus < ranks:
            fail("policy.nproc_per_node", f"is {ranks} but resources.train.gpu is {gpus}", "give each rank its own GPU: set resources.train.gpu to nproc_per_node")
        k = self.resources.steps_per_task
        if k > 1 and self.grpo.max_trajectory_age_steps > 0:
            fail("resources.steps_per_task", f"is {k} with grpo.max_trajectory_age_steps {self.grpo.max_trajectory_age_steps}", "use steps_per_task 1 for async GRPO (its rollouts run beside training on their own nodes)")
        if k > 1 and self.policy.world_size > 1:
            fail("resources.steps_per_task", f"is {k} with {self.policy.world_size} training processes", "use steps_per_task 1 with data- or model-parallel ranks (their train task is a multi-process job)")
        if k > 1 and self.policy.backend == "megatron" and self.generation.backend == "vllm":
            fail("resources.steps_per_task", f"is {k} with policy.backend megatron and generation.backend vllm", "no image holds both (vLLM pins its own torch): use steps_per_task 1, or generation.backend transformers")


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """`rl.config.config_from_dict` for a `RunConfig`: ``{section: {key: value}}``, ``resources`` included."""
    return config_from_dict(data, RunConfig)


def load_run_config(source: str, *, storage_options: dict[str, Any] | None = None) -> RunConfig:
    """`rl.config.load_config` for a `RunConfig`: inline JSON, or a YAML or JSON file at a path or any fsspec URL."""
    return load_config(source, root=RunConfig, storage_options=storage_options)


document_tree(RunConfig)
install_config_options()  # pyflyte run's --cfg: load_config and a short help (a no-op outside pyflyte)
