"""Column names of the data plane (NeMo-RL's names) and which of them are per-token.

Owns the vocabulary only; no I/O. Source: NeMo-RL `nemo_rl/data_plane` (see NEMO_RL_DIGEST.md).
"""

from __future__ import annotations

SAMPLE_ID = "sample_id"

# Per-token columns: stored jagged (one Arrow list per sample, no padding), aligned with input_ids.
INPUT_IDS = "input_ids"
GENERATION_LOGPROBS = "generation_logprobs"
PREV_LOGPROBS = "prev_logprobs"
REFERENCE_POLICY_LOGPROBS = "reference_policy_logprobs"
ADVANTAGES = "advantages"
TOKEN_MASK = "token_mask"

# Per-sample columns.
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

TOKEN_FIELDS = frozenset(
    {INPUT_IDS, GENERATION_LOGPROBS, PREV_LOGPROBS, REFERENCE_POLICY_LOGPROBS, ADVANTAGES, TOKEN_MASK}
)

DP_TRAIN_FIELDS = (
    INPUT_IDS,
    INPUT_LENGTHS,
    GENERATION_LOGPROBS,
    PREV_LOGPROBS,
    REFERENCE_POLICY_LOGPROBS,
    ADVANTAGES,
    TOKEN_MASK,
    SAMPLE_MASK,
)
"""What the train task reads (NeMo-RL `DP_TRAIN_FIELDS`)."""

LP_SEED_FIELDS = (INPUT_IDS, INPUT_LENGTHS, TOKEN_MASK, SAMPLE_MASK)
"""What the logprob tasks read (NeMo-RL `LP_SEED_FIELDS`)."""

ROLLOUT_FIELDS = (
    INPUT_IDS,
    INPUT_LENGTHS,
    GENERATION_LOGPROBS,
    TOKEN_MASK,
    SAMPLE_MASK,
    REWARDS,
    TRUNCATED,
    PROMPT_INDEX,
    GENERATION_INDEX,
    WEIGHT_VERSION,
    PROMPT_LENGTHS,
    PROMPT_TEXT,
    RESPONSE_TEXT,
    ANSWER_TEXT,
)
"""What the rollout task writes in its first put."""
