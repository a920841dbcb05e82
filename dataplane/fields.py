"""Column names of the data plane (NeMo-RL's names): one table, :data:`FIELDS`, and every field list derived from it.

Owns the vocabulary only; no I/O. Source: NeMo-RL `nemo_rl/data_plane` (see NEMO_RL_DIGEST.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """One column of a step partition.

    Attributes:
        name: the column name.
        dtype: the dtype name a partition registers for it (``int64``, ``float32``, ``bool``, ``str``, ``struct``: a
            mapping per sample, ``reward_components`` holds each sample's named rewards; see
            ``DataPlane.register_partition``).
        per_token: stored jagged, one Arrow list per sample aligned with ``input_ids`` (no padding); else one value
            per sample.
        written_by: the task whose write adds the column: ``"rollout"`` (the first put), ``"prev_lp"``, ``"ref_lp"``
            or ``"advantages"`` (delta writes under the rollout's sample ids).
        read_by: the readers that read it: ``"train"`` (the train task), ``"logprobs"`` (the logprob tasks),
            ``"loss"`` (the GRPO loss, beside the forward's ``input_ids`` and ``input_lengths``).
    """

    name: str
    dtype: str
    per_token: bool
    written_by: str
    read_by: frozenset[str] = frozenset()


SAMPLE_ID = "sample_id"
"""The key column of every data file: the row's sample id (``KVBatchMeta.sample_ids``); not a field of the table."""

INPUT_IDS = "input_ids"
GENERATION_LOGPROBS = "generation_logprobs"
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_POLICY_LOGPROBS = "reference_policy_logprobs"
ADVANTAGES = "advantages"
TOKEN_MASK = "token_mask"
INPUT_LENGTHS = "input_lengths"
SAMPLE_MASK = "sample_mask"
REWARDS = "rewards"
TRUNCATED = "truncated"
PROMPT_INDEX = "prompt_index"
GENERATION_INDEX = "generation_index"
WEIGHT_VERSION = "weight_version"
PROMPT_LENGTHS = "prompt_lengths"
PROMPT_TEXT = "prompt"
RESPONSE_TEXT = "response"
ANSWER_TEXT = "answer"
TASK_NAME = "task_name"
ROW_ID = "row_id"
REWARD_COMPONENTS = "reward_components"

_TRAIN, _LOGPROBS, _LOSS = "train", "logprobs", "loss"

FIELDS = (
    Field(INPUT_IDS, "int64", True, "rollout", frozenset({_TRAIN, _LOGPROBS})),
    Field(INPUT_LENGTHS, "int64", False, "rollout", frozenset({_TRAIN, _LOGPROBS})),
    Field(GENERATION_LOGPROBS, "float32", True, "rollout", frozenset({_TRAIN, _LOSS})),
    Field(PREV_LOGPROBS, "float32", True, "prev_lp", frozenset({_TRAIN, _LOSS})),
    Field(REFERENCE_POLICY_LOGPROBS, "float32", True, "ref_lp", frozenset({_TRAIN, _LOSS})),
    Field(ADVANTAGES, "float32", True, "advantages", frozenset({_TRAIN, _LOSS})),
    Field(TOKEN_MASK, "bool", True, "rollout", frozenset({_TRAIN, _LOGPROBS, _LOSS})),
    Field(SAMPLE_MASK, "bool", False, "rollout", frozenset({_TRAIN, _LOGPROBS, _LOSS})),
    Field(REWARDS, "float32", False, "rollout"),
    Field(TRUNCATED, "bool", False, "rollout"),
    Field(PROMPT_INDEX, "int64", False, "rollout"),
    Field(GENERATION_INDEX, "int64", False, "rollout"),
    Field(WEIGHT_VERSION, "int64", False, "rollout"),
    Field(PROMPT_LENGTHS, "int64", False, "rollout"),
    Field(PROMPT_TEXT, "str", False, "rollout"),
    Field(RESPONSE_TEXT, "str", False, "rollout"),
    Field(ANSWER_TEXT, "str", False, "rollout"),
    Field(TASK_NAME, "str", False, "rollout"),
    Field(ROW_ID, "str", False, "rollout"),
    Field(REWARD_COMPONENTS, "struct", False, "rollout"),
)
"""Every field of a step partition, once: name, dtype, per-token or per-sample, writer, readers. The lists below are
selections of it, in its order."""


def _read_by(reader: str) -> tuple[str, ...]:
    return tuple(f.name for f in FIELDS if reader in f.read_by)


TOKEN_FIELDS = frozenset(f.name for f in FIELDS if f.per_token)
"""The per-token fields: stored jagged, aligned with ``input_ids`` (row lengths ``input_lengths``)."""

DP_TRAIN_FIELDS = _read_by(_TRAIN)
"""What the train task reads (NeMo-RL `DP_TRAIN_FIELDS`)."""

LP_SEED_FIELDS = _read_by(_LOGPROBS)
"""What the logprob tasks read (NeMo-RL `LP_SEED_FIELDS`)."""

LOSS_FIELDS = _read_by(_LOSS)
"""What the loss reads: the per-token logprobs, advantages and masks beside `input_ids` (NeMo-RL `ClippedPGLossFn`)."""

ROLLOUT_FIELDS = tuple(f.name for f in FIELDS if f.written_by == "rollout")
"""What the rollout task writes in its first put."""

ROLLOUT_DTYPES = {f.name: f.dtype for f in FIELDS if f.written_by == "rollout"}
"""Schema of a validation partition (rollout columns only): name -> dtype name."""

STEP_SCHEMA = {**ROLLOUT_DTYPES, **{f.name: f.dtype for f in FIELDS if f.written_by != "rollout"}}
"""Schema of a step partition: the rollout columns, then the ones later tasks write as delta columns."""
