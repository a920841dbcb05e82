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


@pytest.mark.parametrize(("precision", "tolerance"), [("float32", 1e-4), ("bfloat16", 1e-2)])
def test_training_forward_agrees_with_generation_logprobs(tiny, precision, tolerance):
    model, tok = tiny
    cfg = _cfg()
    cfg.model.precision = precision
    torch.manual_seed(0)
    groups, mask, metrics = sample_step(model, tok, cfg, step=1)
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


def test_inverse_cdf_sampling_draws_the_temperature_distribution():
    from rl.generation import sample_next

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)  # [n, V]
    expected = torch.softmax(logits[0] / 0.7, -1)  # exp(l/T) / sum: [0.743, 0.178, 0.043, 0.010] (rounded)
    torch.manual_seed(0)
    tokens, lp = sample_next(logits, temperature=0.7, top_p=1.0, greedy=False)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(freq, expected, atol=0.01)  # binomial std at n=20000 is <= 0.0035
    assert torch.allclose(lp, expected.log()[tokens])


def test_top_p_keeps_the_smallest_set_reaching_p_and_greedy_takes_the_argmax():
    from rl.generation import sample_next

    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log()[None].repeat(20000, 1)
    torch.manual_seed(0)
    tokens, lp = sample_next(logits, temperature=1.0, top_p=0.5, greedy=False)
    # cumulative mass before each token: 0, 0.4, 0.7, 0.9 -> tokens 0 and 1 are kept, renormalized to 4/7 and 3/7
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert freq[2:].sum() == 0 and abs(freq[0].item() - 4 / 7) < 0.01
    assert torch.allclose(lp, probs.log()[tokens])  # the logprob before truncation
    top, top_lp = sample_next(logits[:2] * 3.0, temperature=0.5, top_p=0.5, greedy=True)
    assert top.tolist() == [0, 0] and torch.allclose(top_lp, torch.log_softmax(logits[0] * 3.0, -1)[0].expand(2))
