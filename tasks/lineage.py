"""A run's lineage in MLflow: its prompt datasets as the run's inputs (``mlflow.log_input``: source URL, digest,
schema, row count) and each environment's reward code, by name and a hash of its source, as params."""

from __future__ import annotations

from typing import Any

from dataplane.urls import redact
from tasks import tracking
from tasks.run_config import RunConfig


def environment_params(cfg: RunConfig) -> dict[str, str]:
    """``env.<task>.<reward name>`` -> ``"<module:function or reasoning-gym dataset> <first 12 hex of the sha256 of
    its source>"`` for every environment of the run (:func:`rl.environments.registry.describe_environments`)."""
    from rl.environments.registry import describe_environments

    return {k: str(v) for k, v in describe_environments(cfg.task_specs()).items()}


def dataset_entity(prepared: Any, *, name: str) -> Any:
    """An ``mlflow.data`` dataset for a prepared split (:class:`rl.datasets.PreparedSplit`): its source URL (credentials
    redacted), the digest of its rows, its columns' schema and, as its profile, the rows kept and the counts of rows
    held out and skipped."""
    import json

    from mlflow.data.http_dataset_source import HTTPDatasetSource
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.types import ColSpec, DataType, Schema

    simple = {
        "string": DataType.string,
        "large_string": DataType.string,
        "int64": DataType.long,
        "int32": DataType.integer,
        "double": DataType.double,
        "float": DataType.float,
        "bool": DataType.boolean,
    }
    schema = Schema([ColSpec(type=simple.get(t, DataType.string), name=c) for c, t in prepared.schema.items()])
    profile = {"num_rows": prepared.num_rows, **prepared.counts, "arrow_schema": json.dumps(prepared.schema)}

    class PromptDataset(MetaDataset):
        @property
        def profile(self) -> Any:
            return profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(profile)}

    return PromptDataset(
        HTTPDatasetSource(url=redact(prepared.source)), name=name, digest=prepared.digest[:16], schema=schema
    )


def log_datasets(cfg: RunConfig, mlflow_run_id: str, prepared: tuple[Any, Any] | None) -> None:
    """Log the run's prompt datasets as its inputs, ``train`` with context ``training`` and ``validation`` with
    ``validation``, and their sizes at step 0: ``data/train_rows``, ``data/validation_rows``, ``data/held_out`` (rows of
    ``data.train`` kept for validation) and ``data/skipped_overlong`` (prompts too long for the context, left out).
    Nothing for reasoning-gym's generated problems."""
    if prepared is None:
        return
    train, validation = prepared
    sizes = {
        "data/train_rows": float(train.num_rows),
        "data/validation_rows": float(validation.num_rows),
        "data/held_out": float(train.counts.get("held_out", 0)),
        "data/skipped_overlong": float(
            train.counts.get("skipped_overlong", 0) + validation.counts.get("skipped_overlong", 0)
        ),
    }
    tracking.log_metrics(cfg.tracking.uri, mlflow_run_id, sizes, 0)
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for split, context in zip(prepared, ("training", "validation")):
        entity = dataset_entity(split, name=f"prompts-{context}")._to_mlflow_entity()
        inputs.append(DatasetInput(dataset=entity, tags=[InputTag(key="mlflow.data.context", value=context)]))
    tracking.client(cfg.tracking.uri).log_inputs(mlflow_run_id, datasets=inputs)
