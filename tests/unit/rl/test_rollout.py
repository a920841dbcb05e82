"""Rollout (sampling, scoring, filters, columns) through the transformers generation back-end, on a tiny random
model with the real tokenizer. The decode loop itself: tests/unit/rl/backends/hf/test_decode.py."""

from __future__ import annotations

import pytest
import torch

from dataplane.codec import pad_nested
from rl.backends.hf.generation import HFGeneration
from rl.backends.hf.logprobs import batched_logprobs
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.model import load_tokenizer
from rl.rollout import sample_step, to_columns


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _generator(cfg, tok, model_dir):
    gen = HFGeneration(cfg, tokenizer=tok, model_path=model_dir)
    gen.refit(PolicyVersion(step=0, path=model_dir))
    return gen


def _cfg(**grpo):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 3, **grpo},
            "generation": {"max_new_tokens": 6},
            "model": {"precision": "float32"},
        }
    )


@pytest.mark.parametrize(("precision", "tolerance"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_training_forward_agrees_with_generation_logprobs(tok, tiny_model_dir, precision, tolerance):
    cfg = _cfg()
    cfg.model.precision = precision
    gen = _generator(cfg, tok, tiny_model_dir)
    model = gen._model
    groups, mask, metrics = sample_step(gen, tok, cfg, step=1)
    cols = to_columns(groups, mask, group_size=3, weight_version=0)
    ids = pad_nested(cols["input_ids"], tok.pad_token_id)  # [N, S]
    token_mask = pad_nested(cols["token_mask"], False)  # [N, S]
    gen = pad_nested(cols["generation_logprobs"], 0.0)  # [N, S]
    lp = batched_logprobs(model, ids, cols["input_lengths"], token_mask, batch_size=4, precision=precision)
    assert ids.shape == lp.shape == gen.shape and ids.shape[0] == 6
    # token_mult_prob_error (NeMo-RL): mean over response tokens of exp(|logprob - generation logprob|)
    mult = (torch.exp((lp - gen).abs())[token_mask]).mean().item()
    assert mult == pytest.approx(1.0, abs=tolerance)
    if precision == "bfloat16":  # the bf16 path really ran in bf16, and stays close to float32
        fp32 = batched_logprobs(model, ids, cols["input_lengths"], token_mask, batch_size=4, precision="float32")
        assert not torch.equal(lp, fp32)
        assert torch.exp((lp - fp32).abs())[token_mask].mean().item() == pytest.approx(1.0, abs=2e-2)
    assert metrics["dynamic_sampling_num_gen_batches"] == 1.0
    assert cols["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert cols["generation_index"].tolist() == [0, 1, 2, 0, 1, 2]


def test_same_step_same_problems_and_samples_whatever_the_global_rng(tok, tiny_model_dir):
    gen = _generator(_cfg(), tok, tiny_model_dir)
    runs = []
    for global_seed in (7, 8):
        torch.manual_seed(global_seed)  # the rollout's sampling is seeded from the step, not the global RNG
        groups, _, _ = sample_step(gen, tok, _cfg(), step=3)
        runs.append(groups)
    assert [p.question for p in runs[0].problems] == [p.question for p in runs[1].problems]
    assert all(torch.equal(a, b) for a, b in zip(runs[0].input_ids, runs[1].input_ids))
    other, _, _ = sample_step(gen, tok, _cfg(), step=4)
    assert not all(torch.equal(a, b) for a, b in zip(runs[0].input_ids, other.input_ids))


def test_dynamic_sampling_gives_up_with_a_clear_error(tok, tiny_model_dir):
    # a random model never answers right: every group has all-zero rewards and carries no signal
    cfg = _cfg(use_dynamic_sampling=True, dynamic_sampling_max_gen_batches=2)
    with pytest.raises(RuntimeError, match="dynamic_sampling_max_gen_batches"):
        sample_step(_generator(cfg, tok, tiny_model_dir), tok, cfg, step=1)


def test_overlong_filtering_masks_truncated(tok, tiny_model_dir):
    cfg = _cfg(overlong_filtering=True)
    groups, mask, _ = sample_step(_generator(cfg, tok, tiny_model_dir), tok, cfg, step=1)
    assert mask.tolist() == [not t for t in groups.truncated]
