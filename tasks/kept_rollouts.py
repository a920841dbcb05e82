"""`keep`: one step's rollouts as one plain Parquet file, ``{root}/{run_id}/rollouts/step_{k:06d}.parquet``, when
``dataplane.keep_rollouts`` is on. Owns that file's columns (``SCHEMA``); reads the step through `DataPlane`, never
its files. Readers need only pyarrow, pandas or DuckDB."""

from __future__ import annotations

import io
import os
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dataplane import fields as F
from dataplane import paths
from dataplane.errors import retry_transient
from dataplane.meta import KVBatchMeta
from tasks.run_config import RunConfig
from tasks.types import RunInfo

if TYPE_CHECKING:
    from dataplane.client import DataPlane

STEP = "step"
RESPONSE_LENGTHS = "response_lengths"

SCHEMA = pa.schema(
    [
        pa.field(STEP, pa.int64()),  # the optimizer step these rollouts trained (1-based)
        pa.field(F.SAMPLE_ID, pa.string()),  # the data plane's id: f"{uid}_g{generation_index}"
        pa.field(F.PROMPT_INDEX, pa.int64()),  # the prompt's index within the step (its group), 0..B-1
        pa.field(F.GENERATION_INDEX, pa.int64()),  # index within the group, 0..G-1
        pa.field(F.WEIGHT_VERSION, pa.int64()),  # the policy step that generated the response
        pa.field(F.PROMPT_TEXT, pa.string()),
        pa.field(F.RESPONSE_TEXT, pa.string()),
        pa.field(F.ANSWER_TEXT, pa.string()),  # the reference answer
        pa.field(F.TASK_NAME, pa.string()),  # the task whose environment scored it
        pa.field(F.ROW_ID, pa.string()),  # the dataset row of its prompt ("train:41")
        pa.field(F.REWARDS, pa.float32()),
        pa.field(F.ADVANTAGES, pa.float32()),  # the sample's advantage (every one of its tokens carries it)
        pa.field(F.SAMPLE_MASK, pa.bool_()),  # True: the sample counts in the loss
        pa.field(F.TRUNCATED, pa.bool_()),  # True: the response hit max_new_tokens
        pa.field(F.PROMPT_LENGTHS, pa.int64()),  # tokens
        pa.field(RESPONSE_LENGTHS, pa.int64()),  # tokens
        pa.field(F.GENERATION_LOGPROBS, pa.list_(pa.float32())),  # [response_lengths] nats, response tokens only
    ]
)
"""Columns of a kept-rollouts file: one row per sample, in the step's (group-contiguous) order."""

_READ = (
    F.PROMPT_INDEX,
    F.GENERATION_INDEX,
    F.WEIGHT_VERSION,
    F.PROMPT_TEXT,
    F.RESPONSE_TEXT,
    F.ANSWER_TEXT,
    F.TASK_NAME,
    F.ROW_ID,
    F.REWARDS,
    F.ADVANTAGES,
    F.SAMPLE_MASK,
    F.TRUNCATED,
    F.INPUT_LENGTHS,
    F.PROMPT_LENGTHS,
    F.GENERATION_LOGPROBS,
)


def rollouts_url(root: str, run_id: str, step: int) -> str:
    """``{root}/{run_id}/rollouts/step_{step:06d}.parquet``.

    Raises:
        ValueError: an invalid ``run_id`` (see ``dataplane.paths.check_name``).
    """
    return paths.join(paths.run_dir(root, run_id), "rollouts", f"step_{step:06d}.parquet")


def keep(cfg: RunConfig, run: RunInfo, dp: DataPlane, meta: KVBatchMeta, step: int) -> str | None:
    """Write the rollouts of ``step`` (the rows of ``meta``) to :func:`rollouts_url` as one Parquet file of
    ``SCHEMA``, if ``cfg.dataplane.keep_rollouts``; call it before the step's partition is cleared.

    The file replaces any earlier one (a retried train task) atomically: readers see the old file or the new one,
    never part of one (local: a temporary file renamed over it; object store: one PUT of the bytes).

    Args:
        cfg: ``dataplane.keep_rollouts``, ``dataplane.root`` and ``dataplane.storage_options`` are used.
        run: the run (``run_id`` names the folder).
        dp: the run's ``dataplane.client.DataPlane``.
        meta: the step's rows, carrying every column of ``_READ`` (the join of the rollout and advantages metas).
        step: the step whose partition ``meta`` names (``step_{step:06d}``).

    Returns:
        the file's URL, or None when ``keep_rollouts`` is off (nothing is read or written).

    Raises:
        ValueError: ``meta`` names another partition than ``step``'s, ``dp`` is another run's, or the columns are
            inconsistent (a sample whose advantage varies across its tokens, a prompt longer than its sequence).
        dataplane.errors.DataPlaneError / IntegrityError: as ``DataPlane.read`` (a missing column, a bad file).
        storage errors: permanent, or transient past the retry deadline (``dataplane.errors.retry_transient``).
    """
    if not cfg.dataplane.keep_rollouts:
        return None
    if meta.partition_id != paths.step_partition(step):
        msg = (
            f"keep_rollouts of step {step} got a meta of partition {meta.partition_id!r}; "
            f"pass the meta of {paths.step_partition(step)!r}"
        )
        raise ValueError(msg)
    if dp.run_id != run.run_id:
        msg = f"keep_rollouts of run {run.run_id!r} got the data plane of run {dp.run_id!r}"
        raise ValueError(msg)
    cols = dp.read(meta, list(_READ), layout="jagged")
    table = to_table(
        cols, sample_ids=meta.sample_ids, step=step, where=f"partition {meta.partition_id!r} of run {run.run_id!r}"
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    url = rollouts_url(cfg.dataplane.root, run.run_id, step)
    _write_atomic(url, buffer.getvalue(), cfg.dataplane.storage_options)
    return url


def to_table(cols: dict[str, Any], *, sample_ids: list[str], step: int, where: str) -> pa.Table:
    """The rows of ``SCHEMA`` from columns as ``DataPlane.read(..., layout="jagged")`` returns them.

    Args:
        cols: ``_READ`` -> [N] tensors (per sample), jagged [N, L_i] tensors (``advantages``,
            ``generation_logprobs``: aligned with the sequence, prompt included), list[str] (text).
        sample_ids: the N ids, in row order.
        step: the step's number.
        where: names the rows in error messages.

    Raises:
        ValueError: a per-token column whose row lengths differ from ``input_lengths``, a prompt longer than its
            sequence, a sample whose advantage is not the same on all its tokens.
    """
    lengths = cols[F.INPUT_LENGTHS].numpy().astype(np.int64)  # [N]
    prompt = cols[F.PROMPT_LENGTHS].numpy().astype(np.int64)  # [N]
    adv_values, adv_offsets = _flat(cols[F.ADVANTAGES], lengths, F.ADVANTAGES, where)  # [T], [N+1]
    lp_values, _ = _flat(cols[F.GENERATION_LOGPROBS], lengths, F.GENERATION_LOGPROBS, where)  # [T]
    bad = np.flatnonzero(prompt > lengths)
    if bad.size:
        msg = f"{where}: {F.PROMPT_LENGTHS} exceeds {F.INPUT_LENGTHS} for samples {[sample_ids[i] for i in bad[:5]]}"
        raise ValueError(msg)
    advantages = np.full(len(lengths), np.nan, dtype=np.float32)  # [N]; NaN only for an empty row
    filled = lengths > 0
    advantages[filled] = adv_values[adv_offsets[:-1][filled]]
    expected = np.repeat(advantages, lengths)  # [T]
    varying = np.flatnonzero((expected != adv_values) & ~(np.isnan(expected) & np.isnan(adv_values)))
    if varying.size:
        rows = np.unique(np.searchsorted(adv_offsets, varying, side="right") - 1)
        msg = (
            f"{where}: the advantage of samples {[sample_ids[i] for i in rows[:5]]} varies across their tokens; "
            "kept rollouts hold one advantage per sample"
        )
        raise ValueError(msg)
    position = np.arange(len(lp_values)) - np.repeat(adv_offsets[:-1], lengths)  # [T] index within its row
    response = position >= np.repeat(prompt, lengths)  # [T] True on response tokens
    response_lengths = lengths - prompt  # [N]
    offsets = np.concatenate([[0], np.cumsum(response_lengths)]).astype(np.int32)  # [N+1]
    n = len(sample_ids)
    logprobs = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(lp_values[response], pa.float32()))
    columns = {
        STEP: pa.array(np.full(n, step, dtype=np.int64)),
        F.SAMPLE_ID: pa.array(sample_ids, pa.string()),
        **{
            name: pa.array(cols[name].numpy().astype(np.int64))
            for name in (F.PROMPT_INDEX, F.GENERATION_INDEX, F.WEIGHT_VERSION)
        },
        **{
            name: pa.array(list(cols[name]), pa.string())
            for name in (F.PROMPT_TEXT, F.RESPONSE_TEXT, F.ANSWER_TEXT, F.TASK_NAME, F.ROW_ID)
        },
        F.REWARDS: pa.array(cols[F.REWARDS].float().numpy()),
        F.ADVANTAGES: pa.array(advantages),
        F.SAMPLE_MASK: pa.array(cols[F.SAMPLE_MASK].numpy().astype(bool)),
        F.TRUNCATED: pa.array(cols[F.TRUNCATED].numpy().astype(bool)),
        F.PROMPT_LENGTHS: pa.array(prompt),
        RESPONSE_LENGTHS: pa.array(response_lengths),
        F.GENERATION_LOGPROBS: logprobs,
    }
    return pa.table(columns, schema=SCHEMA)


def _flat(nested: Any, lengths: np.ndarray, name: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A jagged [N, L_i] tensor as (values [T] float32, offsets [N+1] int64), its row lengths checked against
    ``lengths``."""
    offsets = nested.offsets().numpy().astype(np.int64)  # [N+1]
    if not np.array_equal(np.diff(offsets), lengths):
        msg = f"{where}: the rows of {name} are not {F.INPUT_LENGTHS} tokens long"
        raise ValueError(msg)
    return nested.values().float().numpy(), offsets


def _write_atomic(url: str, payload: bytes, storage_options: dict[str, Any]) -> None:
    """Put ``payload`` at ``url`` so that readers see the whole file or the previous one: locally a hidden temporary
    file (``.step_*.parquet.tmp-*``: pyarrow / pandas skip dot files when reading the folder, and
    ``DataPlane.collect_garbage`` removes it if the writer dies) renamed over it; on an object store one PUT (S3
    makes an object visible only once it is complete, multipart uploads included)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    what = f"kept rollouts {url}: write"
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):

        def put() -> None:
            folder, name = os.path.split(path)
            tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")  # hidden: readers of the folder skip it
            os.makedirs(folder, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    f.write(payload)
                os.replace(tmp, path)  # atomic on one filesystem; replaces an earlier attempt's file
            except BaseException:
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise

        retry_transient(put, what=what)
    else:
        retry_transient(lambda: fs.pipe_file(path, payload), what=what)
