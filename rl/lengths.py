"""Whether a rollout's sequences fit the context they are generated in: prompt + ``generation.max_new_tokens`` tokens
within the model's positions (``max_position_embeddings``) and, on the vLLM back-end, within
``generation.vllm_cfg.max_model_len``. A sequence past either limit would be cut short without an error (vLLM stops it
at ``max_model_len``) or run past the positions the model was trained for, so both are refused: at the run's start
for the validation problems and the first step's prompts (``tasks/setup.py``), and by every back-end's ``generate``
for the prompts it is given. Pure functions, no I/O but reading a model's ``config.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rl.config import GRPOConfig

MODEL_LIMIT = "the model's max_position_embeddings"


def model_max_len(folder: str) -> int:
    """The model's own context limit in tokens: ``max_position_embeddings`` of ``{folder}/config.json`` (2**30 when
    the config names none).

    Raises:
        FileNotFoundError: ``folder`` has no ``config.json``.
    """
    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1 << 30)


def context_limit(cfg: GRPOConfig, model_limit: int) -> tuple[int, str]:
    """``(tokens, what sets them)``: the most prompt + completion tokens one sequence may have. The model's limit,
    or ``generation.vllm_cfg.max_model_len`` on the vLLM back-end where that is lower (vLLM caps it the same way,
    ``rl/backends/vllm/settings.py``)."""
    v = cfg.generation.vllm_cfg
    if cfg.generation.backend == "vllm" and v.max_model_len < model_limit:
        return v.max_model_len, "generation.vllm_cfg.max_model_len"
    return model_limit, MODEL_LIMIT


def check_fits(prompt_lengths: Sequence[int], max_new_tokens: int, limit: int, limit_name: str) -> None:
    """Refuse prompts whose longest plus ``max_new_tokens`` is more than ``limit`` tokens.

    Args:
        prompt_lengths: tokens of each prompt (empty: only ``max_new_tokens`` is checked).
        max_new_tokens: ``generation.max_new_tokens``.
        limit: the context in tokens, from :func:`context_limit`.
        limit_name: what sets ``limit`` (a config key or :data:`MODEL_LIMIT`), named in the message.

    Raises:
        ValueError: ``config generation.max_new_tokens: ...`` naming the longest prompt, the limit, the largest
            ``max_new_tokens`` that fits and, where the limit is ``max_model_len``, that it can be raised.
    """
    longest = max(prompt_lengths, default=0)
    if longest + max_new_tokens <= limit:
        return
    prompt = f" plus the longest prompt's {longest} tokens" if prompt_lengths else ""
    room = limit - longest
    fix = (
        f"lower it to at most {room}"
        if room > 0
        else "shorten the prompts (data.system_prompt, the dataset's questions)"
    )
    if limit_name != MODEL_LIMIT:
        fix += f", or raise {limit_name} (up to the model's max_position_embeddings)"
    msg = (
        f"config generation.max_new_tokens: {max_new_tokens}{prompt} is more than the {limit} tokens of "
        f"{limit_name}, so completions would be cut short; {fix}"
    )
    raise ValueError(msg)
