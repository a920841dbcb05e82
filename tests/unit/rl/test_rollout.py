"""Generation and rollout on a tiny random model with the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from dataplane.codec import pad_nested
from rl.config import config_from_dict
from rl.logprobs import batched_logprobs
from rl.rollout import sample_step, to_columns


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from rl.model import load_model, load_tokenizer

    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def _cfg(**grpo):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 3, **grpo},
            "generation": {"max_new_tokens": 6},
            "model": {"precision": "float32"},
        }
    )


def test_training_forward_agrees_with_generation_logprobs(tiny):
    model, tok = tiny
    cfg = _cfg()
    torch.manual_seed(0)
    groups, mask, metrics = sample_step(model, tok, cfg, step=1)
    cols = to_columns(groups, mask, group_size=3, weight_version=0)
    ids = pad_nested(cols["input_ids"], tok.pad_token_id)  # [N, S]
    token_mask = pad_nested(cols["token_mask"], False)  # [N, S]
    gen = pad_nested(cols["generation_logprobs"], 0.0)  # [N, S]
    lp = batched_logprobs(model, ids, cols["input_lengths"], token_mask, batch_size=4, precision="float32")
    assert ids.shape == lp.shape == gen.shape and ids.shape[0] == 6
    mult = (torch.exp((lp - gen).abs())[token_mask]).mean().item()
    assert mult == pytest.approx(1.0, abs=1e-4)
    assert metrics["dynamic_sampling_num_gen_batches"] == 1.0
    assert cols["prompt_index"].tolist() == [0, 0, 0, 1, 1, 1]
    assert cols["generation_index"].tolist() == [0, 1, 2, 0, 1, 2]


def test_same_step_same_problems_and_samples(tiny):
    model, tok = tiny
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        groups, _, _ = sample_step(model, tok, _cfg(), step=3)
        runs.append(groups)
    assert [p.question for p in runs[0].problems] == [p.question for p in runs[1].problems]
    assert all(torch.equal(a, b) for a, b in zip(runs[0].input_ids, runs[1].input_ids))


def test_dynamic_sampling_gives_up_with_a_clear_error(tiny):
    # a random model never answers right: every group has all-zero rewards and carries no signal
    model, tok = tiny
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="dynamic_sampling_max_gen_batches"):
        sample_step(model, tok, _cfg(use_dynamic_sampling=True, dynamic_sampling_max_gen_batches=2), step=1)


def test_overlong_filtering_masks_truncated(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    groups, mask, _ = sample_step(model, tok, _cfg(overlong_filtering=True), step=1)
    assert mask.tolist() == [not t for t in groups.truncated]


def test_shared_prompt_prefill_matches_plain_generation(tiny):
    from rl.generation import _group_size, generate

    model, tok = tiny
    prompts = [[1, 5, 9, 13], [1, 7, 2]]
    grouped = [p for p in prompts for _ in range(3)]
    assert _group_size(grouped) == 3 and _group_size(prompts) == 1
    shared = generate(model, tok, grouped, max_new_tokens=5, greedy=True)
    plain = [generate(model, tok, [p], max_new_tokens=5, greedy=True) for p in grouped]
    for i, one in enumerate(plain):
        assert torch.equal(shared.input_ids[i], one.input_ids[0])
        assert torch.allclose(shared.generation_logprobs[i], one.generation_logprobs[0], atol=1e-3)  # float noise of padding
