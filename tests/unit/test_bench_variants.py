"""``python -m bench.variants``: every variant's run is the learning config with the variant's keys, the seed and four
updates per step, a valid run config; the table averages over the seeds."""

from __future__ import annotations

import pytest

from bench.variants import VARIANTS, run_config, summarize
from rl.config import config_from_dict
from tasks.run_config import RunConfig


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_run_is_the_learning_config_with_the_variant_on_top(variant):
    cfg = config_from_dict(run_config(variant, seed=7, steps=10), root=RunConfig)
    learning = config_from_dict(run_config("default", seed=7, steps=10), root=RunConfig)
    assert (cfg.grpo.seed, cfg.data.seed, cfg.grpo.max_num_steps, cfg.grpo.val_period, cfg.grpo.val_at_start) == (
        7,
        7,
        10,
        10,
        True,
    )
    assert cfg.global_batch_size == 16 and cfg.samples_per_step == 64 and not cfg.on_policy  # four updates per step
    assert (cfg.data.dataset_kwargs, cfg.data.num_val_problems, cfg.optim.lr) == (
        learning.data.dataset_kwargs,
        200,
        2e-5,
    )
    assert cfg.tracking.run_name == f"{variant}-seed7"
    expected = {
        "default": ("dapo", "token", True),
        "grpo": ("grpo", "token", False),
        "dr_grpo": ("dr_grpo", "token", False),
        "dapo": ("dapo", "token", False),
        "gspo": ("grpo", "sequence", False),
        "cispo": ("cispo", "token", False),
    }[variant]
    assert (cfg.loss.loss_type, cfg.loss.importance_sampling_level, cfg.grpo.use_leave_one_out_baseline) == expected
    if variant == "dapo":
        assert cfg.grpo.use_dynamic_sampling and cfg.grpo.reward_shaping.enabled and cfg.loss.ratio_clip_max == 0.28


def test_the_table_averages_each_variant_over_its_seeds():
    def result(variant, seed, end):
        return {
            "variant": variant,
            "seed": seed,
            "accuracy": {"0": 0.16, "10": end},
            "reward": {str(k): 0.5 for k in range(1, 11)},
            "kl_penalty": {"10": 0.25},
            "step_time_s": {str(k): 40.0 for k in range(1, 11)},
        }

    text = summarize(
        [result("gspo", 2, 0.4), result("gspo", 1, 0.3), result("cispo", 1, 0.5)],
        10,
        [1, 2],
        ["default", "gspo", "cispo"],
        "cmd",
    )
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| gspo") or line.startswith("| cispo") or line.startswith("| default")
    ]
    assert rows == [
        # seeds in order; sample std of 0.3, 0.4
        "| gspo | 0.160 | 0.350 ± 0.071 | [0.300, 0.400] | 0.500 | 0.250 | 40.0 |",
        "| cispo | 0.160 | 0.500 ± 0.000 | [0.500] | 0.500 | 0.250 | 40.0 |",
    ]
