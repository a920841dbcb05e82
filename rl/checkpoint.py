"""Checkpoints on any fsspec filesystem: HF weights (safetensors) plus trainer state (optimizer, scheduler,
RNG, data position) with no pickle, made visible atomically by a ``_COMPLETE`` marker written last.

Owns the on-disk format of a checkpoint; where checkpoints live is `dataplane.paths`.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

COMPLETE = "_COMPLETE"
TRAINER_STATE = "trainer_state"


@dataclass
class TrainerState:
    """Everything that resumes training exactly, besides the weights."""

    step: int
    mlflow_run_id: str
    extra: dict[str, Any]


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
    torch.set_rng_state(tensors["torch"])
    py = doc["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    st = doc["numpy"]
    np.random.set_state((st[0], np.array(st[1], dtype=np.uint32), *st[2:]))


def save(
    url: str,
    *,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    state: TrainerState | None = None,
    storage_options: dict[str, Any] | None = None,
) -> str:
    """Write an HF folder at ``url`` (and the trainer state when ``optimizer`` is given), then ``_COMPLETE``.

    A reader that finds no ``_COMPLETE`` must treat the folder as absent (a writer died mid-way).

    Returns:
        ``url``.
    """
    from safetensors.torch import save_file

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    staging = Path(path).parent / f".{Path(path).name}.tmp-{uuid.uuid4().hex}" if local else Path(tempfile.mkdtemp())
    staging.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if optimizer is not None and state is not None:
        ts = staging / TRAINER_STATE
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
    if local:
        if fs.exists(path):
            fs.rm(path, recursive=True)
        staging.rename(path)
    else:
        fs.put(str(staging), path, recursive=True)
        shutil.rmtree(staging)
    fs.pipe_file(f"{path}/{COMPLETE}", b"")
    return url


def is_complete(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs.exists(f"{path}/{COMPLETE}")


def has_trainer_state(url: str, storage_options: dict[str, Any] | None = None) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return is_complete(url, storage_options) and fs.exists(f"{path}/{TRAINER_STATE}/state.json")


def local_copy(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A local folder holding the checkpoint (the folder itself when it is already local)."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return path
    target = tempfile.mkdtemp(prefix="grpoflow-ckpt-")
    fs.get(path, target, recursive=True)
    return target


def load_trainer_state(
    folder: str, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainerState:
    """Load optimizer, scheduler and RNG state from a local checkpoint folder into the given objects."""
    from safetensors.torch import load_file

    ts = Path(folder) / TRAINER_STATE
    doc = json.loads((ts / "state.json").read_text())
    tensors = load_file(str(ts / "optimizer.safetensors"))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": doc["optimizer"]["param_groups"]})
    if scheduler is not None and doc["scheduler"] is not None:
        scheduler.load_state_dict(doc["scheduler"])
    restore_rng(load_file(str(ts / "rng.safetensors")), doc["rng"])
    return TrainerState(step=doc["step"], mlflow_run_id=doc["mlflow_run_id"], extra=doc["extra"])


def list_complete(url: str, storage_options: dict[str, Any] | None = None) -> list[tuple[int, str]]:
    """``(step, url)`` of complete ``step_XXXXXX`` folders under ``url``, oldest first."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not fs.exists(path):
        return []
    out = []
    for child in fs.ls(path, detail=False):
        name = child.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith("step_") and fs.exists(f"{child}/{COMPLETE}"):
            out.append((int(name.removeprefix("step_")), f"{url.rstrip('/')}/{name}"))
    return sorted(out)


def prune(url: str, keep_last_k: int, storage_options: dict[str, Any] | None = None, *, keep: str | None = None) -> None:
    """Delete all but the newest ``keep_last_k`` complete checkpoints under ``url``, and never ``keep`` (the
    checkpoint the running step started from: a retry of that step must be able to load it again)."""
    fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
    complete = list_complete(url, storage_options)
    for _, old in complete[: max(len(complete) - keep_last_k, 0)]:
        if keep is None or old.rstrip("/") != keep.rstrip("/"):
            fs.rm(fsspec.core.url_to_fs(old, **(storage_options or {}))[1], recursive=True)
