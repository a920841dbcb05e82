"""A minimal stand-in for Flyte's propeller, for tests: it executes a *serialized* workflow the way a cluster does,
every task node as a fresh process running the task's own container command (``pyflyte-execute ...``, from the
serialized ``TaskTemplate``) with its inputs as a protobuf ``LiteralMap`` file, and reads back ``outputs.pb``,
``futures.pb`` (a ``@dynamic``'s nodes, executed in turn) or ``error.pb`` (retried when recoverable, up to the
node's retries). The processes share nothing but what the test gives them all (the data plane, the checkpoint store,
MLflow): each has its own HOME, TMPDIR and caches (``GRPOFLOW_CACHE``, ``GRPOFLOW_MODEL_CACHE``, ``HF_HOME``, all
under its HOME), no Hugging Face hub (``HF_HUB_OFFLINE``), and, as a pod's disk goes with the pod, its HOME and
TMPDIR are deleted when it exits: a path on one pod's disk means nothing to the next pod.

What it leaves out of a real cluster: images (the processes run in this virtualenv), scheduling and resources
(recorded per node in ``Pods.placements``, not enforced), branches, map tasks, launch-plan nodes, caching.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Pod:
    """One task attempt: its node, task, wall time (s), exit code and log."""

    node: str
    task: str
    attempt: int
    seconds: float
    returncode: int
    log: str


@dataclass
class Pods:
    """Executes serialized workflows; ``pods`` and ``placements`` record what ran and where it asked to run."""

    workdir: Path
    execution: str = "cold0"
    project: str = "grpoflow"
    domain: str = "development"
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0
    prepare_home: Callable[[str, Path], None] | None = None
    """Called with each pod's task name and its (empty) HOME before the pod starts: puts there what that pod's own
    disk holds when it starts (for example a model that task would have made there itself)."""
    ephemeral: bool = True
    """Delete each pod's HOME and TMPDIR when it exits (its log, inputs and outputs stay)."""
    pods: list[Pod] = field(default_factory=list)
    placements: dict[str, Any] = field(default_factory=dict)

    def run_workflow(self, spec: Any, tasks: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """Execute a ``WorkflowSpec`` (flytekit model) with ``inputs`` (name -> flytekit ``Literal`` model);
        ``tasks`` maps task names to their ``TaskTemplate``s. Returns the workflow's output literals."""
        subs = {s.id.name: s for s in spec.sub_workflows}
        return self._run_nodes(spec.template.nodes, spec.template.outputs, inputs, tasks, subs, prefix="")

    def _run_nodes(
        self,
        nodes: list[Any],
        outputs: list[Any],
        inputs: dict[str, Any],
        tasks: dict[str, Any],
        subs: dict[str, Any],
        prefix: str,
    ) -> dict[str, Any]:
        done: dict[str, dict[str, Any]] = {"start-node": inputs}
        pending = [n for n in nodes if n.id not in ("start-node", "end-node")]
        while pending:
            ready = [n for n in pending if all(u in done for u in self._upstream(n))]
            if not ready:
                msg = f"no node is ready among {[n.id for n in pending]}: a cycle or a missing node"
                raise RuntimeError(msg)
            node = ready[0]
            pending.remove(node)
            node_inputs = {b.var: self._literal(b.binding, done) for b in node.inputs}
            if node.task_node is not None:
                template = tasks[node.task_node.reference_id.name]
                self.placements[f"{prefix}{node.id}"] = node.task_node.overrides
                done[node.id] = self._run_task(
                    f"{prefix}{node.id}",
                    template,
                    node_inputs,
                    node.metadata.retries.retries if node.metadata and node.metadata.retries else 0,
                    tasks,
                    subs,
                )
            elif node.workflow_node is not None:
                sub = subs[node.workflow_node.sub_workflow_ref.name]
                done[node.id] = self._run_nodes(
                    sub.nodes, sub.outputs, node_inputs, tasks, subs, prefix=f"{prefix}{node.id}-"
                )
            else:
                msg = f"node {node.id}: only task and sub-workflow nodes are supported here"
                raise NotImplementedError(msg)
        return {b.var: self._literal(b.binding, done) for b in outputs}

    @staticmethod
    def _upstream(node: Any) -> set[str]:
        ids = set(node.upstream_node_ids or [])

        def refs(bd: Any) -> None:
            if bd.promise is not None:
                ids.add(bd.promise.node_id)
            for item in bd.collection.bindings if bd.collection is not None else []:
                refs(item)
            for item in bd.map.bindings.values() if bd.map is not None else []:
                refs(item)

        for b in node.inputs:
            refs(b.binding)
        ids -= {"start-node", ""}  # "" (flytekit's models) and start-node (propeller's) both mean the inputs
        return ids

    def _literal(self, bd: Any, done: dict[str, dict[str, Any]]) -> Any:
        from flytekit.models.literals import Literal, LiteralCollection, LiteralMap

        if bd.scalar is not None:
            return Literal(scalar=bd.scalar)
        if bd.promise is not None:
            value = done[bd.promise.node_id or "start-node"][bd.promise.var]
            if bd.promise.attr_path:
                msg = "attribute paths in bindings are not supported here"
                raise NotImplementedError(msg)
            return value
        if bd.collection is not None:
            return Literal(
                collection=LiteralCollection(literals=[self._literal(b, done) for b in bd.collection.bindings])
            )
        if bd.map is not None:
            return Literal(map=LiteralMap(literals={k: self._literal(b, done) for k, b in bd.map.bindings.items()}))
        msg = f"unsupported binding {bd}"
        raise NotImplementedError(msg)

    def _run_task(
        self,
        node_id: str,
        template: Any,
        inputs: dict[str, Any],
        retries: int,
        tasks: dict[str, Any],
        subs: dict[str, Any],
    ) -> dict[str, Any]:
        from flyteidl.core import dynamic_job_pb2, errors_pb2, literals_pb2
        from flytekit.models.dynamic_job import DynamicJobSpec
        from flytekit.models.literals import LiteralMap

        for attempt in range(retries + 1):
            pod_dir = self.workdir / "pods" / f"{node_id}-{attempt}"
            shutil.rmtree(pod_dir, ignore_errors=True)
            out_dir, home, tmp = pod_dir / "out", pod_dir / "home", pod_dir / "tmp"
            for d in (out_dir, home, tmp, pod_dir / "raw"):
                d.mkdir(parents=True)
            (pod_dir / "inputs.pb").write_bytes(LiteralMap(literals=inputs).to_flyte_idl().SerializeToString())
            if self.prepare_home is not None:
                self.prepare_home(template.id.name, home)
            args = [self._substitute(a, pod_dir) for a in template.container.args]
            args[0] = str(Path(sys.executable).parent / args[0])  # pyflyte-execute of this virtualenv
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "FLYTE_INTERNAL"))},
                **{k: v for k, v in (template.container.env or {}).items()},
                # the pod's own caches, whatever this machine's environment says: nothing reaches a pod but storage
                "GRPOFLOW_CACHE": str(home / ".cache" / "grpoflow"),
                "GRPOFLOW_MODEL_CACHE": str(home / ".cache" / "grpoflow-node"),
                "HF_HOME": str(home / ".cache" / "huggingface"),
                "HF_HUB_OFFLINE": "1",
                "XDG_CACHE_HOME": str(home / ".cache"),
                **self.env,
                "HOME": str(home),
                "TMPDIR": str(tmp),
                "PYTHONPATH": str(ROOT),
                "FLYTE_INTERNAL_EXECUTION_PROJECT": self.project,
                "FLYTE_INTERNAL_EXECUTION_DOMAIN": self.domain,
                "FLYTE_INTERNAL_EXECUTION_ID": self.execution,
                "FLYTE_INTERNAL_EXECUTION_WORKFLOW": "workflows.grpo.grpo",
                "FLYTE_INTERNAL_TASK_PROJECT": self.project,
                "FLYTE_INTERNAL_TASK_DOMAIN": self.domain,
                "FLYTE_INTERNAL_TASK_NAME": template.id.name,
                "FLYTE_INTERNAL_TASK_VERSION": template.id.version,
                "FLYTE_ATTEMPT_NUMBER": str(attempt),
            }
            t0 = time.time()
            try:
                proc = subprocess.run(
                    args, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=self.timeout_s
                )
            finally:
                if self.ephemeral:  # the pod is gone, and its disk with it
                    shutil.rmtree(home, ignore_errors=True)
                    shutil.rmtree(tmp, ignore_errors=True)
            log = proc.stdout + proc.stderr
            (pod_dir / "log.txt").write_text(log)
            self.pods.append(Pod(node_id, template.id.name, attempt, time.time() - t0, proc.returncode, log))
            if (out_dir / "error.pb").exists():
                doc = errors_pb2.ErrorDocument()
                doc.ParseFromString((out_dir / "error.pb").read_bytes())
                recoverable = doc.error.kind == errors_pb2.ContainerError.RECOVERABLE
                if recoverable and attempt < retries:
                    continue
                msg = (
                    f"task {template.id.name} (node {node_id}, attempt {attempt}) failed: {doc.error.message}\n"
                    f"--- log ---\n{log[-4000:]}"
                )
                raise RuntimeError(msg)
            if proc.returncode != 0:
                msg = (
                    f"task {template.id.name} (node {node_id}) exited {proc.returncode} without an error document\n"
                    f"{log[-4000:]}"
                )
                raise RuntimeError(msg)
            if (out_dir / "futures.pb").exists():  # a @dynamic: run the nodes it compiled
                pb = dynamic_job_pb2.DynamicJobSpec()
                pb.ParseFromString((out_dir / "futures.pb").read_bytes())
                job = DynamicJobSpec.from_flyte_idl(pb)
                inner = {**tasks, **{t.id.name: t for t in job.tasks}}
                inner_subs = {**subs, **{s.id.name: s for s in job.subworkflows}}
                return self._run_nodes(job.nodes, job.outputs, inputs, inner, inner_subs, prefix=f"{node_id}-")
            pb = literals_pb2.LiteralMap()
            pb.ParseFromString((out_dir / "outputs.pb").read_bytes())
            return dict(LiteralMap.from_flyte_idl(pb).literals)
        raise AssertionError("unreachable")

    @staticmethod
    def _substitute(arg: str, pod_dir: Path) -> str:
        return (
            arg.replace("{{.input}}", str(pod_dir / "inputs.pb"))
            .replace("{{.outputPrefix}}", str(pod_dir / "out"))
            .replace("{{.rawOutputDataPrefix}}", str(pod_dir / "raw"))
            .replace("{{.checkpointOutputPrefix}}", str(pod_dir / "checkpoint"))
            .replace("{{.prevCheckpointPrefix}}", "")
        )
