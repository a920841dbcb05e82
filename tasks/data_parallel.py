"""The task type of the train and logprob tasks: flytekitplugins-kfpytorch's ``Elastic`` (torchrun inside the task),
with its ranks taken from the run's config at run time.

``policy.nnodes * policy.nproc_per_node`` = 1: the task body runs in the task's own process, as a plain Python
task (a local run keeps its warm back-ends between tasks). More: ``torch.distributed.elastic`` starts
``nproc_per_node`` ranks on this node (CPU: gloo; GPU: NCCL, one rank per GPU) that each run the body on their shard
of the step (``rl.distributed``), and the task returns rank 0's result. On a cluster ``nnodes`` > 1 runs the task
as a Kubeflow PyTorchJob: the step loop sets the node's task config from the config (``tasks.placement.placed``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Any

from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.extend import TaskPlugins
from flytekitplugins.kfpytorch.task import Elastic, PytorchElasticFunctionTask

FAULT_DRILL_ENV = "GRPOFLOW_FAULT_DRILL"
"""Fault drill: ``<task>:<rank>`` (e.g. ``train:1``) makes that rank of that task exit at once, as a killed process
does, right after its share of the work (:func:`fault_drill`). For rehearsing a lost rank; the tests use it."""


@dataclasses.dataclass
class DataParallel(Elastic):
    """``Elastic`` whose ``nnodes`` and ``nproc_per_node`` come from the task's ``cfg`` input (``policy.nnodes``,
    ``policy.nproc_per_node``) when it runs. Workers are spawned (a forked worker would inherit the parent's OpenMP
    pool); the launcher checks them every second, so a dead rank fails the task within about a second."""

    monitor_interval: int = 1
    increase_shared_mem: bool = False
    """``/dev/shm`` comes from ``resources.train.shared_memory`` (Flyte's ``shared_memory``), as for every task."""


class DataParallelTask(PytorchElasticFunctionTask):
    """A :class:`DataParallel` task; see the module docstring."""

    @property
    def task_type(self) -> str:
        # a node-level task-config override (nnodes > 1) must also make it a PyTorchJob
        return self._ELASTIC_TASK_TYPE if str(self.task_config.nnodes) != "1" else self._ELASTIC_TASK_TYPE_STANDALONE

    def get_custom(self, settings: Any) -> dict[str, Any] | None:
        self._nodes_from_config()
        return super().get_custom(settings)

    def _nodes_from_config(self) -> None:
        from torch.distributed import run

        self.min_nodes, self.max_nodes = run.parse_min_max_nnodes(str(self.task_config.nnodes))

    def _execute(self, **kwargs: Any) -> Any:
        cfg = kwargs["cfg"]
        nnodes, nproc = cfg.policy.nnodes, cfg.policy.nproc_per_node
        if nnodes == 1 and nproc == 1:
            return self._task_function(**kwargs)  # no ranks: the body in this process
        from torch.distributed.elastic.multiprocessing.errors import record

        self._task_config = dataclasses.replace(self.task_config, nnodes=nnodes, nproc_per_node=nproc)
        self._nodes_from_config()
        body = self._task_function
        self._task_function = record(body)  # a rank's exception goes to its error file, where the launcher reads it
        # the ranks import the task's modules from the code root this process found them in: ``pyflyte run`` puts it
        # on sys.path only while it loads the workflow file, and a spawned process starts from the parent's sys.path
        root = _code_root(body)
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            return super()._execute(**kwargs)
        except FlyteUserRuntimeException as err:
            raise _rank_failure(self.name.rsplit(".", 1)[-1], nnodes * nproc, err) from None
        finally:
            self._task_function = body
            if added:
                sys.path.remove(root)


def _code_root(fn: Any) -> str:
    """The folder that holds ``fn``'s top-level package (``/repo`` for ``tasks.train`` in ``/repo/tasks/train.py``)."""
    module = sys.modules[fn.__module__]
    return str(Path(module.__file__).resolve().parents[fn.__module__.count(".")])  # type: ignore[arg-type]


def _rank_failure(task: str, world: int, err: FlyteUserRuntimeException) -> Exception:
    """The error a failed rank makes of the task: the rank, how it ended and what that means, in one paragraph.

    A rank that raised keeps its error (fatal, as that error would be in one process). A rank that ended without
    raising (killed by a signal, out of memory, its node lost) is recoverable: Flyte retries the task, whose writes
    replace this attempt's (see ``tasks.retry``).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failure = err.value
    if not isinstance(failure, ChildFailedError):
        return err
    rank, first = failure.get_first_failure()
    where = f"{task}: rank {rank} of {world} (pid {first.pid})"
    if os.path.isfile(first.error_file):  # it raised
        raised = first.message if isinstance(first.message, str) else first.message.get("message", "")
        return RuntimeError(f"{where} failed: {raised.strip()}")
    how = f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0 else f"exited with code {first.exitcode}"
    msg = (
        f"{where} {how} without raising an error (killed, out of memory, or its node lost); the other ranks were "
        "stopped and nothing this attempt wrote is kept as the step's result: Flyte retries the task"
    )
    return FlyteRecoverableException(msg)


def fault_drill(task: str) -> None:
    """Exit this process at once (``os._exit``: no cleanup, as a kill) if :data:`FAULT_DRILL_ENV` names ``task``
    and this rank."""
    from rl import distributed

    if os.environ.get(FAULT_DRILL_ENV) == f"{task}:{distributed.rank()}" and distributed.world_size() > 1:
        os._exit(86)


TaskPlugins.register_pythontask_plugin(DataParallel, DataParallelTask)
