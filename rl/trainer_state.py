"""The trainer state of a checkpoint, everything besides the weights that resumes training exactly: the optimizer's
state, the scheduler's, the torch, Python and NumPy global RNG states, the step and small JSON values (the data
position), with no pickle.

Layout, in a checkpoint's ``trainer_state/`` folder (`rl.checkpoint` writes it into the staged checkpoint before
the manifest, and lists it there like every other file):

- ``optimizer.safetensors``: every optimizer state tensor, as ``{param_index}.{name}`` (a
  :class:`ShardedOptimizerState`: ``{shard}:{param_index}.{name}``), detached, contiguous, on the CPU.
- ``rng.safetensors``: ``torch``, the CPU RNG state (uint8).
- ``state.json``: ``{"step", "mlflow_run_id", "extra", "optimizer": {"param_groups", "keys"}, "scheduler": its
  state_dict or null, "rng": {"python", "numpy"}}``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataplane.errors import retry_transient
from rl.manifest import filesystem

TRAINER_STATE = "trainer_state"
"""The checkpoint subfolder that holds the trainer state."""


@dataclass
class TrainerState:
    """Everything that resumes training exactly, besides the weights.

    Attributes:
        step: the optimizer step the checkpoint was taken after.
        mlflow_run_id: the MLflow run the metrics of the run go to.
        extra: small JSON-serialisable values (e.g. the data position).
    """

    step: int
    mlflow_run_id: str
    extra: dict[str, Any]


@dataclass
class ShardedOptimizerState:
    """The optimizer state dicts of a model split over ranks, one per shard name (``megatron-tp0-pp1``), saved as one
    trainer state: tensors under ``{shard}:{index}.{name}`` and param groups per shard. Each rank loads its own with
    ``load_trainer_state(..., shard=)``."""

    shards: dict[str, dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": {f"{shard}:{idx}": st for shard, sd in self.shards.items() for idx, st in sd["state"].items()},
            "param_groups": {shard: sd["param_groups"] for shard, sd in self.shards.items()},
        }


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors = {f"{idx}.{k}": v.detach().contiguous().cpu() for idx, st in sd["state"].items() for k, v in st.items()}
    return tensors, {"param_groups": sd["param_groups"], "keys": sorted(tensors)}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    py = random.getstate()
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state()}, {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def restore_rng(tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
    """Set the torch, Python and NumPy global RNG states to those saved in a checkpoint.

    Args:
        tensors: ``trainer_state/rng.safetensors`` as loaded (key ``torch``).
        doc: the ``rng`` entry of ``trainer_state/state.json`` (keys ``python``, ``numpy``).
    """
    torch.set_rng_state(tensors["torch"])
    py = doc["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    st = doc["numpy"]
    np.random.set_state((st[0], np.array(st[1], dtype=np.uint32), *st[2:]))


def write_trainer_state(folder: Path, optimizer: Any, scheduler: Any, state: TrainerState) -> None:
    """Write ``folder/trainer_state/`` (created here; ``folder`` is a local staging folder): ``optimizer``'s state
    (a ``torch.optim.Optimizer`` or a :class:`ShardedOptimizerState`), ``scheduler``'s when given, the global RNG
    states as they are now, and ``state``.

    Raises:
        FileExistsError: ``folder/trainer_state`` exists.
    """
    from safetensors.torch import save_file

    ts = folder / TRAINER_STATE
    ts.mkdir()
    tensors, doc = _optimizer_tensors(optimizer)
    save_file(tensors, str(ts / "optimizer.safetensors"))
    rng_tensors, rng_doc = _rng_state()
    save_file(rng_tensors, str(ts / "rng.safetensors"))
    (ts / "state.json").write_text(
        json.dumps(
            {
                "step": state.step,
                "mlflow_run_id": state.mlflow_run_id,
                "extra": state.extra,
                "optimizer": doc,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_doc,
            }
        )
    )


def trainer_state_doc(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON document of the checkpoint's trainer state (``step``, ``mlflow_run_id``, ``extra``), read without
    loading any tensor.

    Raises:
        FileNotFoundError: ``url`` holds no trainer state (a weights-only folder, or no checkpoint).
        storage errors: permanent, or transient past the retry deadline.
    """
    fs, path, _ = filesystem(url, storage_options)
    raw = retry_transient(
        lambda: fs.cat_file(f"{path}/{TRAINER_STATE}/state.json"), what=f"checkpoint {url}: read its trainer state"
    )
    return json.loads(raw)


def load_trainer_state(
    folder: str, optimizer: torch.optim.Optimizer, scheduler: Any, *, shard: str | None = None
) -> TrainerState:
    """Load optimizer, scheduler and RNG state from a local checkpoint folder (see :func:`rl.checkpoint.local_copy`)
    into the given objects.

    Args:
        folder: a local checkpoint folder with ``trainer_state/``.
        optimizer: built for the checkpoint's model (or for ``shard`` of it); its state is replaced.
        scheduler: its state is replaced when given and the checkpoint has one.
        shard: the model-parallel shard whose optimizer state to load (:class:`ShardedOptimizerState`); None for a
            checkpoint of one unsplit optimizer.

    Returns:
        the saved :class:`TrainerState`.

    Raises:
        FileNotFoundError: ``folder`` has no trainer state.
        RuntimeError: the checkpoint's optimizer state is split into shards and ``shard`` is not one of them (or it
            is not split and ``shard`` is given): it was written by another back-end or other parallel sizes.
    """
    from safetensors.torch import load_file

    ts = Path(folder) / TRAINER_STATE
    doc = json.loads((ts / "state.json").read_text())
    groups = doc["optimizer"]["param_groups"]
    sharded = isinstance(groups, dict)
    if sharded != (shard is not None) or (sharded and shard not in groups):
        held = f"the shards {sorted(groups)}" if sharded else "one unsplit optimizer (the transformers back-end)"
        wanted = (
            f"shard {shard!r} (policy.backend megatron with its parallel sizes)"
            if shard is not None
            else "one unsplit optimizer"
        )
        msg = (
            f"checkpoint {folder}: its optimizer state holds {held}, but this policy needs {wanted}; resume with the "
            "policy.backend and policy.megatron_cfg parallel sizes the checkpoint was saved with"
        )
        raise RuntimeError(msg)
    tensors = load_file(str(ts / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        if shard is not None:
            owner, _, idx = idx.partition(":")
            if owner != shard:
                continue
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": groups[shard] if shard is not None else groups})
    if scheduler is not None and doc["scheduler"] is not None:
        scheduler.load_state_dict(doc["scheduler"])
    restore_rng(load_file(str(ts / "rng.safetensors")), doc["rng"])
    return TrainerState(step=doc["step"], mlflow_run_id=doc["mlflow_run_id"], extra=doc["extra"])
