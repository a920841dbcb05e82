"""The task type of the train and logprob tasks: flytekitplugins-kfpytorch's ``Elastic`` (torch elastic, as torchrun,
inside the task) with its ranks read from the run's config when the task runs. How and why:
``docs/data_parallel.md``."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flytekit.core.python_function_task import PythonFunctionTask
from flytekit.exceptions.user import FlyteRecoverableException, FlyteUserRuntimeException
from flytekit.extend import TaskPlugins
from flytekitplugins.kfpytorch.task import Elastic, PytorchElasticFunctionTask

FAULT_DRILL_ENV = "GRPOFLOW_FAULT_DRILL"
"""Fault drill: ``<task>:<rank>`` (e.g. ``train:1``) makes that rank of that task exit at once, as a killed process
does, right after its share of the work (:func:`fault_drill`), in every attempt. For rehearsing a lost rank; the tests
use it."""

PEER_LOST_WAIT_S = 10.0
"""How long a rank that lost a peer waits to be stopped by the launcher before it raises (see :func:`_ranked`)."""


@dataclasses.dataclass
class DataParallel(Elastic):
    """``Elastic`` whose ``nnodes`` and ``nproc_per_node`` come from the task's ``cfg`` input (``policy.nnodes``,
    ``policy.nproc_per_node``) when it runs. Ranks are spawned (a forked one would inherit the parent's OpenMP
    pool); the launcher checks them every second, so a dead rank fails the task within about a second."""

    monitor_interval: int = 1
    increase_shared_mem: bool = False
    """``/dev/shm`` comes from ``resources.train.shared_memory`` (Flyte's ``shared_memory``), as for every task."""


class DataParallelTask(PytorchElasticFunctionTask):
    """A :class:`DataParallel` task.

    ``policy.nnodes * policy.nproc_per_node`` = 1: the body runs in the task's own process, as a plain Python task
    (a local run keeps its warm back-ends). More: torch elastic starts ``nproc_per_node`` ranks on this node (gloo on
    CPU, NCCL on GPUs, ``rl.distributed.process_group``), each runs the body on its shard of the step, and the task
    returns rank 0's result. ``nnodes`` > 1 makes the node a Kubeflow PyTorchJob: the step loop overrides the node's
    task config from the run's config (``tasks.placement.placed``).
    """

    def __init__(self, task_config: DataParallel, task_function: Callable[..., Any], **kwargs: Any) -> None:
        # not PytorchElasticFunctionTask.__init__: it imports torch.distributed (~3 s) only to parse ``nnodes``,
        # and every process that imports a workflow (a CPU pod, registration) would pay for it
        PythonFunctionTask.__init__(
            self,
            task_config=task_config,
            task_type=self._ELASTIC_TASK_TYPE_STANDALONE,
            task_function=task_function,
            task_type_version=1,
            **kwargs,
        )
        self.rdzv_backend = "c10d"
        self.min_nodes, self.max_nodes = _node_range(task_config.nnodes)

    @property
    def task_type(self) -> str:
        # a node-level task-config override (nnodes > 1) must also make it a PyTorchJob
        return self._ELASTIC_TASK_TYPE if str(self.task_config.nnodes) != "1" else self._ELASTIC_TASK_TYPE_STANDALONE

    def get_custom(self, settings: Any) -> dict[str, Any] | None:
        self.min_nodes, self.max_nodes = _node_range(self.task_config.nnodes)
        return super().get_custom(settings)

    def _execute(self, **kwargs: Any) -> Any:
        cfg = kwargs["cfg"]
        nnodes, nproc = cfg.policy.nnodes, cfg.policy.nproc_per_node
        if nnodes == 1 and nproc == 1:
            return self._task_function(**kwargs)  # no ranks: the body in this process
        declared = self._task_config
        self._task_config = dataclasses.replace(declared, nnodes=nnodes, nproc_per_node=nproc)  # for this launch only
        self.min_nodes, self.max_nodes = _node_range(nnodes)
        body = self._task_function
        self._task_function = _ranked(body)
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
            self._task_function, self._task_config = body, declared
            self.min_nodes, self.max_nodes = _node_range(declared.nnodes)
            if added:
                sys.path.remove(root)


def _node_range(nnodes: int | str) -> tuple[int, int]:
    """``2`` -> (2, 2); ``"1:4"`` -> (1, 4): torchrun's ``--nnodes``
    (``torch.distributed.run.parse_min_max_nnodes``)."""
    low, _, high = str(nnodes).partition(":")
    return int(low), int(high or low)


def _code_root(fn: Any) -> str:
    """The folder that holds ``fn``'s top-level package (``/repo`` for ``tasks.train`` in ``/repo/tasks/train.py``)."""
    module = sys.modules[fn.__module__]
    return str(Path(module.__file__).resolve().parents[fn.__module__.count(".")])  # type: ignore[arg-type]


def _ranked(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` as a rank runs it. When a collective fails because another rank is gone (gloo: the connection closed
    or reset by the peer), this rank waits up to :data:`PEER_LOST_WAIT_S` for the launcher to notice the dead rank
    and stop it, so that the task's error names the rank that died rather than a survivor; a rank still running then
    (its peer was on another node) raises a recoverable error."""

    def run(**kwargs: Any) -> Any:
        try:
            return body(**kwargs)
        except Exception as err:
            if not _lost_peer(err):
                raise
            time.sleep(PEER_LOST_WAIT_S)
            msg = (
                f"rank {os.environ.get('RANK', '?')}: lost a peer rank ({type(err).__name__}: "
                f"{str(err).splitlines()[0]}); Flyte retries the task"
            )
            raise FlyteRecoverableException(msg) from err

    return run


def _lost_peer(err: BaseException | None) -> bool:
    """Whether ``err`` (or its cause) is a collective that failed because a peer rank is gone."""
    while err is not None:
        text = str(err)
        if (
            type(err).__name__ == "DistNetworkError"
            or "Connection closed by peer" in text
            or "Connection reset by peer" in text
        ):
            return True
        err = err.__cause__ or err.__context__
    return False


def _rank_failure(task: str, world: int, err: FlyteUserRuntimeException) -> Exception:
    """The error a failed rank makes of the task, in one paragraph: which rank, how it ended, and whether a retry
    may help. A rank that raised keeps its error (fatal, as in one process); one that ended without raising (killed,
    out of memory, its node lost) is recoverable: Flyte retries the task, whose writes replace this attempt's."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    failure = err.value
    if not isinstance(failure, ChildFailedError):
        return err
    rank, first = failure.get_first_failure()
    where = f"{task}: rank {rank} of {world} (pid {first.pid})"
    if os.path.isfile(first.error_file):  # it raised: torch elastic recorded the error
        raised = first.message if isinstance(first.message, str) else first.message.get("message", "")
        msg = f"{where} failed: {raised.strip()}"
        return RuntimeError(msg)
    how = (
        f"was killed by {signal.Signals(-first.exitcode).name}"
        if first.exitcode < 0
        else f"exited with code {first.exitcode}"
    )
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
