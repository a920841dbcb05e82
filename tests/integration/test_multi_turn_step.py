"""One whole GRPO step with multi-turn episodes, as the tasks run it (`rl.step`), on the tiny model with the real
transformers back-ends and a local data plane: the episodes go through the data plane as jagged rows (environment
tokens with token_mask 0), advantages use the episode's total reward, the update trains, and the rollout metrics
count turns and tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane
from rl.backends import registry
from rl.backends.dataplane_policy import DataPlanePolicy
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.model import load_tokenizer
from rl.step import rollout_to_batch, update, write_advantages


def test_a_multi_turn_step_goes_through_the_data_plane_and_trains(tiny_model_dir, tmp_path):
    cfg = config_from_dict(
        {
            "model": {"name": tiny_model_dir},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_rollout_turns": 3},
            "generation": {"max_new_tokens": 5},
            "env": {"tasks": {"chain_sum": {"environment": {"class": "tests.unit.rl.test_multi_turn:Echo"}}}},
            "dataplane": {"root": str(tmp_path / "dp")},
        }
    )
    tok = load_tokenizer(tiny_model_dir)
    gen = registry.load("generation", "transformers")(cfg, tokenizer=tok, model_path=tiny_model_dir)
    gen.refit(PolicyVersion(step=0, path=tiny_model_dir))
    policy = registry.load("policy", "transformers")(cfg, tokenizer=tok, reference_path=tiny_model_dir)
    policy.load_checkpoint(PolicyVersion(step=0, path=tiny_model_dir), with_optimizer=True)
    policy.load_reference_policy()
    dp = DataPlane(cfg.dataplane.root, "multi-turn")
    meta = rollout_to_batch(gen, tok, cfg, dataplane=dp, step=1)
    info = meta.extra_info
    assert info["rollout/turns_per_sample"] == 3.0  # Echo ends every episode at its third turn
    assert info["rollout/environment_tokens"] > 0 and info["rollout/truncated_by_turns_fraction"] == 0.0
    rows = dp.read(meta, [F.INPUT_IDS, F.TOKEN_MASK, F.GENERATION_LOGPROBS, F.REWARDS, F.PROMPT_LENGTHS])
    for i in range(4):
        ids, mask, lp = rows[F.INPUT_IDS][i], rows[F.TOKEN_MASK][i], rows[F.GENERATION_LOGPROBS][i]
        assert len(ids) == len(mask) == len(lp)
        p = int(rows[F.PROMPT_LENGTHS][i])
        assert not mask[:p].any() and mask[p:].any() and not mask[p:].all()  # environment turns inside
        assert (lp[~mask] == 0).all()
    assert torch.allclose(rows[F.REWARDS], torch.full((4,), 0.75))
    trainer = DataPlanePolicy(policy, dp)
    meta = trainer.get_reference_policy_logprobs_from_meta(meta)
    meta, rewards, _ = write_advantages(cfg, dp, meta)
    assert torch.equal(rewards, torch.full((4,), 0.75))
    trained = update(cfg, trainer, meta, step=1)
    assert math.isfinite(trained["loss"]) and trained["total_num_tokens"] == sum(len(x) for x in rows[F.INPUT_IDS])
    gen.shutdown()
    policy.shutdown()


@pytest.mark.integration
@pytest.mark.slow
def test_a_multi_turn_run_killed_in_step_3_and_resumed_ends_bitwise_equal(tmp_path, tiny_model_dir):
    """The workflow with 3-turn episodes (the scripted environment of the unit tests), SIGKILLed during step 3 and
    resumed: the same final weights, bit for bit, as an uninterrupted run."""
    from safetensors.torch import load_file

    from tests.helpers import killed_in_step_3_and_resumed

    overrides = dict(
        env={"tasks": {"chain_sum": {"environment": {"class": "tests.unit.rl.test_multi_turn:Echo"}}}},
        grpo={"max_num_steps": 4, "val_period": 0, "max_rollout_turns": 3},
        checkpointing={"checkpoint_period": 2, "keep_last_k": 2},
    )
    clean, crash = killed_in_step_3_and_resumed(tmp_path, tiny_model_dir, **overrides)
    a, b = (
        load_file(str(next(Path(c.dataplane.root).glob("*/checkpoints/step_000004")) / "model.safetensors"))
        for c in (clean, crash)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
