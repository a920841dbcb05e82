"""Where each task runs on a cluster: its container image and its Kubernetes resources, from ``cfg.resources`` (the
section of `tasks.run_config.RunConfig`).

Tasks belong to three classes (``ROLE``): generation on the rollout image, forward/backward passes on the train
image, bookkeeping on the CPU image. Every task is declared with its class's ImageSpec and the resources of the
default config (:func:`declared`), so the registered task is right by itself; the step loop, which has the run's
config, re-places each node it creates with the config's values (:func:`placed`). A local run ignores both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flytekit import ImageSpec, Resources
from flytekit.extras.accelerators import GPUAccelerator

from images import REGISTRY
from images.cpu import cpu_image
from images.rollout_gpu import rollout_gpu_image
from images.train_gpu import train_gpu_image
from tasks.data_parallel import DataParallel
from tasks.run_config import ResourcesConfig, RunConfig, TaskResources

ROLE: dict[str, str] = {
    "rollout": "rollout",
    "validate": "rollout",
    "evaluate": "rollout",
    "policy_logprobs": "train",
    "reference_logprobs": "train",
    "train": "train",
    "grpo_steps": "train",
    "start_run": "cpu",
    "advantages": "cpu",
    "finish_run": "cpu",
    "training_loop": "cpu",
    "find_checkpoint": "cpu",
    "load_config_file": "cpu",
}
"""Task name (the function's name) -> its class in ``cfg.resources``."""

IMAGES: dict[str, ImageSpec] = {"cpu": cpu_image, "rollout-gpu": rollout_gpu_image, "train-gpu": train_gpu_image}
"""The ImageSpecs of ``images/`` by the names a config uses."""

DEFAULT_IMAGE = {"rollout": "rollout-gpu", "train": "train-gpu", "cpu": "cpu"}
"""Each class's own image (``image: default``)."""


def role_of(task_name: str) -> str:
    """The resource class of a task, from its (possibly module-qualified) name.

    Raises:
        KeyError: a task this module does not place (add it to ``ROLE``).
    """
    short = task_name.rsplit(".", 1)[-1]
    if short not in ROLE:
        msg = f"task {task_name!r} has no resource class: add it to tasks.placement.ROLE"
        raise KeyError(msg)
    return ROLE[short]


def _resources(res: TaskResources) -> Resources:
    return Resources(cpu=res.cpu, mem=res.memory, gpu=res.gpu or None)


def _extended(res: TaskResources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if res.accelerator is not None:
        out["accelerator"] = GPUAccelerator(res.accelerator)
    if res.shared_memory is not None:
        out["shared_memory"] = res.shared_memory
    return out


def declared(role: str) -> dict[str, Any]:
    """``@task`` keyword arguments of a task of class ``role``: its ImageSpec and the default config's resources
    (requests equal to limits: Guaranteed QoS, so a pod is not evicted under memory pressure mid-step)."""
    res: TaskResources = getattr(ResourcesConfig(), role)
    r = _resources(res)
    env = {"GRPOFLOW_IMAGE_REGISTRY": REGISTRY} if REGISTRY else None
    return {
        "container_image": IMAGES[DEFAULT_IMAGE[role]],
        "requests": r,
        "limits": r,
        "environment": env,
        **_extended(res),
    }


def image_reference(name: str, role: str) -> str | None:
    """The image a node of class ``role`` runs on for config value ``name``: None for the task's own image, a
    full reference as given, or the registered name of one of ``IMAGES``.

    Raises:
        ValueError: a named ImageSpec that was not registered with this workflow (its name is unknown here).
    """
    if name in ("default", DEFAULT_IMAGE[role]):
        return None
    if name not in IMAGES:
        return name  # a full reference such as ghcr.io/acme/grpoflow:v1
    from flytekit.core.context_manager import FlyteContextManager

    settings = FlyteContextManager.current_context().serialization_settings
    found = (
        settings.image_config.find_image(IMAGES[name].id) if settings is not None and settings.image_config else None
    )
    if found is None:
        msg = (
            f"config resources.{role}.image: the {name!r} image is not known to this execution (it is registered only "
            "when a task declares it); use a full image reference such as 'ghcr.io/acme/grpoflow-cpu:v1'"
        )
        raise ValueError(msg)
    return found.full


def steps_image(cfg: RunConfig) -> str:
    """The image of a node that runs whole steps (``resources.steps_per_task`` > 1, on the train class's resources):
    the train class's, except that its default (the train image, which has no vLLM) becomes the rollout image with
    ``generation.backend: vllm`` (that image also holds the transformers trainer; megatron with vLLM is refused at
    config time)."""
    image = cfg.resources.train.image
    return "rollout-gpu" if image == "default" and cfg.generation.backend == "vllm" else image


def overrides(cfg: RunConfig, role: str, *, image_name: str | None = None) -> dict[str, Any]:
    """``Node.with_overrides`` keyword arguments that place a node of class ``role`` as ``cfg.resources`` says (on
    ``image_name`` instead of the class's image, when given)."""
    res: TaskResources = getattr(cfg.resources, role)
    r = _resources(res)
    out: dict[str, Any] = {"requests": r, "limits": r, **_extended(res)}
    image = image_reference(image_name or res.image, role)
    if image is not None:
        out["container_image"] = image
    return out


def placed(cfg: RunConfig, task: Any, *, node_name: str | None = None) -> Callable[..., Any]:
    """``task`` as a callable whose node (inside a ``@dynamic``) runs where ``cfg.resources`` says, named
    ``node_name`` in the console. Outside a compilation (a local run) the call is the plain task call."""
    role = role_of(task.name)

    def call(**inputs: Any) -> Any:
        from flytekit.core.context_manager import FlyteContextManager
        from flytekit.core.promise import Promise

        out = task(**inputs)
        first = out[0] if isinstance(out, tuple) else out
        if not isinstance(first, Promise) or FlyteContextManager.current_context().compilation_state is None:
            return out
        whole_steps = task.name.rsplit(".", 1)[-1] == "grpo_steps"
        first.with_overrides(
            node_name=node_name, **overrides(cfg, role, image_name=steps_image(cfg) if whole_steps else None)
        )
        if isinstance(getattr(task, "task_config", None), DataParallel):
            # several nodes make the node a Kubeflow PyTorchJob of that many replicas (one node's ranks are read from
            # the config when the task runs, tasks.data_parallel). flytekit applies this override to the task object
            # itself, so it is set back as well when a config of one node follows one of several in this process.
            nodes = DataParallel(
                nnodes=cfg.policy.nnodes, nproc_per_node=cfg.policy.nproc_per_node if cfg.policy.nnodes > 1 else 1
            )
            if task.task_config != nodes:
                first.with_overrides(task_config=nodes)
        return out

    return call
