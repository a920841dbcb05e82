"""Serialize every Flyte entity of grpoflow offline, as ``pyflyte register`` does, with the container images faked
(named, not built), and compile the step loop's nodes (the ``@dynamic``'s) for each shipped config: what a cluster
receives, checked without one. ``python -m workflows.registration`` exits non-zero on any error; CI runs it
(``tests/unit/test_registration.py``), and the cold-task test executes what it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.types import RunInfo

MODULES = ("workflows.grpo", "workflows.evaluate", "workflows.launch_plans")
"""Every module that declares Flyte entities (tasks are found through the workflows that use them)."""

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def fake_images() -> Iterator[list[str]]:
    """Within the block, ImageSpecs are named (``name:tag`` from their content) instead of built or looked up in a
    registry; yields the names, as they are asked for."""
    from flytekit.image_spec.image_spec import ImageBuildEngine

    asked: list[str] = []
    original = ImageBuildEngine.build

    def build(image_spec: Any) -> None:
        asked.append(image_spec.image_name())

    ImageBuildEngine.build = build  # type: ignore[method-assign]
    try:
        yield asked
    finally:
        ImageBuildEngine.build = original  # type: ignore[method-assign]


def settings(version: str = "v0", project: str = "grpoflow", domain: str = "development") -> Any:
    """Non-fast serialization settings (the code is in the image), flytekit's default image as the default."""
    from flytekit.configuration import ImageConfig, SerializationSettings

    return SerializationSettings(
        project=project, domain=domain, version=version, image_config=ImageConfig.auto_default_image()
    )


def serialize(ss: Any) -> list[Any]:
    """Every registrable entity (task, workflow and launch plan specs) of ``MODULES``, as flytekit models.

    Raises:
        whatever flytekit raises for an entity that does not serialize (an unknown type, a bad binding, ...).
    """

    from flytekit.core.context_manager import FlyteContextManager, FlyteEntities
    from flytekit.tools.serialize_helpers import get_registrable_entities

    for name in MODULES:
        importlib.import_module(name)
    everything = list(FlyteEntities.entities)
    FlyteEntities.entities[:] = [e for e in everything if _declared_here(e)]
    ctx = FlyteContextManager.current_context().with_serialization_settings(ss)
    try:
        with FlyteContextManager.with_context(ctx) as c:
            return get_registrable_entities(c)
    finally:
        FlyteEntities.entities[:] = everything + [
            e for e in FlyteEntities.entities if all(e is not x for x in everything)
        ]


def _declared_here(entity: Any) -> bool:
    """An entity declared at module level in ``tasks``/``workflows`` or ``MODULES`` (not one a test declares, nor the
    step loop's workflow that a run in this process compiled and flytekit keeps among its entities)."""

    from flytekit.core.launch_plan import LaunchPlan

    if isinstance(entity, LaunchPlan):
        return _declared_here(entity.workflow)
    module = sys.modules.get(str(getattr(entity, "instantiated_in", "")))
    if module is None or not (module.__name__.startswith(("tasks.", "workflows.")) or module.__name__ in MODULES):
        return False
    return any(value is entity for value in vars(module).values())


def step_loop_nodes(cfg: Any, ss: Any) -> Any:
    """The step loop's ``DynamicJobSpec`` for ``cfg`` (a run starting at step 0), as its pod would produce it.
    Every step's nodes are built alike; :func:`main` caps the steps (:func:`checked_steps`) to keep the check fast.

    Raises:
        whatever flytekit raises compiling it (a node override it refuses, a bad binding, ...).
    """
    from flytekit.core.context_manager import FlyteContextManager

    from workflows.grpo import training_loop

    run = RunInfo(
        run_id="run-check",
        mlflow_run_id="0" * 32,
        model_path="/models/base",
        start_policy_path="/models/base",
        cold_tasks=True,
    )
    ctx = FlyteContextManager.current_context().with_serialization_settings(ss.with_serialized_context())
    training_loop._wf = None  # flytekit caches the compiled loop: a pod compiles once, this check once per config
    with FlyteContextManager.with_context(ctx) as c:
        return training_loop.compile_into_workflow(c, training_loop._task_function, cfg=cfg, run=run)


def checked_steps(cfg: Any) -> Any:
    """``cfg`` with at most enough steps to reach its first validation (and 2 at least): every step compiles to the
    same nodes, and flytekit spends ~0.4 s per node (it rebuilds the config's JSON schema for each)."""

    g = cfg.grpo
    steps = min(g.max_num_steps, max(2, g.val_period))
    return dataclasses.replace(cfg, grpo=dataclasses.replace(g, max_num_steps=steps))


def shipped_configs() -> dict[str, Any]:
    """``configs/*.yaml`` by file stem, plus the default config as ``default``."""
    from tasks.run_config import RunConfig, load_run_config

    out = {"default": RunConfig()}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        out[path.stem] = load_run_config(str(path))
    return out


def write(entities: list[Any], folder: Path) -> None:
    """Persist ``entities`` as ``pyflyte package`` does (``NN_name_K.pb``, K the resource type)."""
    from flytekit.tools.serialize_helpers import persist_registrable_entities

    folder.mkdir(parents=True, exist_ok=True)
    persist_registrable_entities(entities, str(folder))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the serialized entities (protobuf files) here")
    args = parser.parse_args(argv)
    from flytekit.models.admin.workflow import WorkflowSpec
    from flytekit.models.launch_plan import LaunchPlan
    from flytekit.models.task import TaskSpec

    ss = settings()
    with fake_images() as images:
        try:
            entities = serialize(ss)
            loops = {name: step_loop_nodes(checked_steps(cfg), ss) for name, cfg in shipped_configs().items()}
        except Exception as err:  # noqa: BLE001 (the check's job: any error fails it, named)
            print(f"registration check FAILED: {type(err).__name__}: {err}", file=sys.stderr)
            return 1
    kinds = {"task": TaskSpec, "workflow": WorkflowSpec, "launch plan": LaunchPlan}
    for kind, cls in kinds.items():
        names = sorted(
            e.template.id.name if hasattr(e, "template") else e.id.name for e in entities if isinstance(e, cls)
        )
        print(f"{len(names)} {kind}s: {', '.join(names)}")
    for name, spec in loops.items():
        print(f"step loop of config {name!r} (first steps): {len(spec.nodes)} nodes, {len(spec.tasks)} tasks")
    print(f"images (faked): {', '.join(sorted(set(images)))}")
    if args.out:
        write(entities, args.out)
        print(f"wrote {len(entities)} entities to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
