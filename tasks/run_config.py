"""`RunConfig`: the config a run is launched with, `rl.config.GRPOConfig` plus the cluster's ``resources`` section
(where each class of tasks runs: its image and Kubernetes resources, and how many steps one task runs). Every Flyte
task and workflow takes one; `rl` code takes it as the `GRPOConfig` it is. ``tasks/placement.py`` reads
``resources`` to place the tasks; a local run ignores it. No flytekit import: the checks run wherever a config is
built.

    run_config_from_dict({"grpo": {"max_num_steps": 2}, "resources": {"train": {"gpu": 1}}})
    load_run_config("configs/cluster.yaml")
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from rl.config import GRPOConfig, config_from_dict, load_config
from rl.config.checks import Section, check_fields, config_root, fail, section_name, usage_error
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
            fail(
                f"{where}.image",
                f"{self.image!r} is neither an image name nor an image reference",
                f"use one of {list(_IMAGE_NAMES)} or a reference such as 'ghcr.io/acme/grpoflow:v1'",
            )
        if self.gpu < 0:
            fail(f"{where}.gpu", f"is {self.gpu}", "use 0 (CPU) or the number of GPUs per task")
        if self.accelerator is not None and self.gpu == 0:
            fail(
                f"{where}.accelerator", f"{self.accelerator!r} is set but gpu is 0", "set gpu >= 1 or accelerator: null"
            )
        if self.accelerator is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.accelerator):
            fail(
                f"{where}.accelerator",
                f"{self.accelerator!r} is not an accelerator name",
                "use e.g. 'nvidia-h100' or 'nvidia-tesla-a100'",
            )
        for key in ("cpu", "memory", "shared_memory"):
            value = getattr(self, key)
            if value is not None and (not _QUANTITY.fullmatch(value) or quantity(value) <= 0):
                fail(
                    f"{where}.{key}", f"{value!r} is not a positive Kubernetes quantity", "use e.g. '2', '500m', '16Gi'"
                )


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
            fail(
                "resources.steps_per_task",
                f"is {self.steps_per_task!r}",
                "use 1 (a node per task) or the number of steps one task runs",
            )


@config_root
@dataclass
class RunConfig(GRPOConfig):
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Images and resources of each class of tasks on a cluster (ignored by local runs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        gpus, ranks = self.resources.train.gpu, self.policy.nproc_per_node
        if 0 < gpus < ranks:
            fail(
                "policy.nproc_per_node",
                f"is {ranks} but resources.train.gpu is {gpus}",
                "give each rank its own GPU: set resources.train.gpu to nproc_per_node",
            )
        k = self.resources.steps_per_task
        if k > 1 and self.grpo.max_trajectory_age_steps > 0:
            fail(
                "resources.steps_per_task",
                f"is {k} with grpo.max_trajectory_age_steps {self.grpo.max_trajectory_age_steps}",
                "use steps_per_task 1 for async GRPO (its rollouts run beside training on their own nodes)",
            )
        if k > 1 and self.policy.world_size > 1:
            fail(
                "resources.steps_per_task",
                f"is {k} with {self.policy.world_size} training processes",
                "use steps_per_task 1 with data- or model-parallel ranks (their train task is a multi-process job)",
            )
        if k > 1 and self.policy.backend == "megatron" and self.generation.backend == "vllm":
            fail(
                "resources.steps_per_task",
                f"is {k} with policy.backend megatron and generation.backend vllm",
                "no image holds both (vLLM pins its own torch): use steps_per_task 1, or generation.backend "
                "transformers",
            )

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """`GRPOConfig.from_json`, and under ``pyflyte run`` (a click context whose object says whether the run is
        remote) the placement rules of that run (:func:`check_placement`): a remote run that asks for megatron
        without train GPUs is refused before it is submitted, not in its first pod.

        Raises:
            ValueError: as `GRPOConfig.from_json` and :func:`check_placement`, as a ``click.BadParameter``.
        """
        import click

        cfg = super().from_json(text)
        ctx = click.get_current_context(silent=True)
        remote = getattr(ctx.obj, "is_remote", None) if ctx is not None else None
        if isinstance(remote, bool):
            try:
                check_placement(cfg, local=not remote)
            except ValueError as err:
                raise usage_error(str(err)) from None
        return cfg


_SUFFIXES = {
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value: str) -> float:
    """A Kubernetes resource quantity as a number: ``"500m"`` -> 0.5 (cores), ``"16Gi"`` -> 17179869184.0 (bytes)."""
    m = _QUANTITY.fullmatch(value)
    if m is None:
        msg = f"{value!r} is not a Kubernetes quantity"
        raise ValueError(msg)
    return float(m[1]) * _SUFFIXES.get(m[3] or "", 1.0)


def check_placement(cfg: RunConfig, *, local: bool) -> None:
    """The rules that relate the config to where it runs, checked before any model task starts: when ``pyflyte run``
    reads ``--cfg`` (:meth:`RunConfig.from_json`) and again in ``start_run`` (a launch from the console).

    A local run (every task on this machine): ``policy.nproc_per_node`` ranks at most one per CPU core, and vLLM's CPU
    KV cache smaller than the machine's memory. A remote run (each class of tasks on its ``resources``): megatron
    needs train GPUs; CPU ranks at most one per requested core of a train pod; vLLM's CPU KV cache smaller than a
    rollout pod's memory.

    Args:
        cfg: the run's config.
        local: the run is local (flytekit's local executor), else remote.

    Raises:
        ValueError: naming the keys to change.
    """
    ranks, kv_gib = cfg.policy.nproc_per_node, cfg.generation.vllm_cfg.cpu_kv_cache_gib
    vllm = cfg.generation.backend == "vllm"
    if local:
        cores = os.cpu_count() or 1
        if ranks > cores:
            fail(
                "policy.nproc_per_node",
                f"is {ranks} but this machine has {cores} CPU cores (a local run starts every rank here)",
                f"use at most {cores}",
            )
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
        if vllm and memory and kv_gib * 2**30 >= memory:
            fail(
                "generation.vllm_cfg.cpu_kv_cache_gib",
                f"is {kv_gib:g} GiB but this machine has {memory / 2**30:.1f} GiB of memory",
                "use a few GiB, e.g. 2 (the cache holds only the rollout's sequences)",
            )
        return
    _check_user_inputs_reach_pods(cfg)
    train, rollout = cfg.resources.train, cfg.resources.rollout
    if cfg.policy.backend == "megatron" and train.gpu < 1:
        fail(
            "resources.train.gpu",
            "is 0 but policy.backend 'megatron' runs only on CUDA GPUs",
            "set it to policy.nproc_per_node",
        )
    cores = math.ceil(quantity(train.cpu))
    if train.gpu == 0 and ranks > cores:
        fail(
            "policy.nproc_per_node",
            f"is {ranks} CPU ranks but resources.train.cpu gives each train pod {train.cpu} cores",
            f"use at most {cores} ranks, or raise resources.train.cpu",
        )
    if vllm and rollout.gpu == 0 and kv_gib * 2**30 >= quantity(rollout.memory):
        fail(
            "generation.vllm_cfg.cpu_kv_cache_gib",
            f"is {kv_gib:g} GiB but a rollout pod has resources.rollout.memory {rollout.memory}",
            "lower it (e.g. 2), or raise resources.rollout.memory above it plus the model",
        )


def _check_user_inputs_reach_pods(cfg: RunConfig) -> None:
    """A remote run's pods see neither this machine's disk nor its Python path: its datasets must be URLs (or hub
    names) and its reward code importable from the project folder that pyflyte's fast registration ships.

    Raises:
        ValueError: a local dataset path, or a reward function a pod could not import.
    """
    from rl.environments.reward_functions import importable_in_pod

    for key in ("train", "validation"):
        spec = getattr(cfg.data, key)
        if spec and (spec.startswith("file:") or ("://" not in spec and os.path.exists(spec))):
            fail(
                f"data.{key}",
                f"is {spec!r}, a path on this machine, which the run's pods cannot read",
                f"upload it next to dataplane.root (e.g. {cfg.dataplane.root.rstrip('/')}/datasets/) and give its URL",
            )
    for task, spec in cfg.task_specs().items():
        ref = (spec.get("environment") or {}).get("class")
        why = importable_in_pod(str(ref), os.getcwd()) if ref else None
        if why is not None:
            fail(
                f"env.tasks.{task}.environment.class",
                f"{ref!r} cannot be imported in the run's pods: {why}",
                "put the file inside the project folder you run pyflyte from (fast registration ships it), or "
                "install its package in the task images",
            )
        for i, fn in enumerate(spec.get("reward_functions", [])):
            why = importable_in_pod(str(fn["function"]), os.getcwd())
            if why is not None:
                fail(
                    f"env.tasks.{task}.reward_functions[{i}]" if cfg.env.tasks else f"env.reward_functions[{i}]",
                    f"{fn['function']!r} cannot be imported in the run's pods: {why}",
                    "put the file inside the project folder you run pyflyte from (fast registration ships it), or "
                    "install its package in the task images",
                )


def run_config_from_dict(data: dict[str, Any]) -> RunConfig:
    """`rl.config.config_from_dict` for a `RunConfig`: ``{section: {key: value}}``, ``resources`` included."""
    return config_from_dict(data, RunConfig)


def load_run_config(source: str, *, storage_options: dict[str, Any] | None = None) -> RunConfig:
    """`rl.config.load_config` for a `RunConfig`: inline JSON, or a YAML or JSON file at a path or any fsspec URL."""
    return load_config(source, root=RunConfig, storage_options=storage_options)


document_tree(RunConfig)
install_config_options()  # pyflyte run's --cfg: load_config and a short help (a no-op outside pyflyte)
