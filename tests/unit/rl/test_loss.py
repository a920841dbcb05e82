from __future__ import annotations

import math

import pytest
import torch

from rl.config import LossConfig
from rl.loss import LossInputs, clipped_pg_loss, clipped_pg_loss_with, kl_penalty

DEFAULTS = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    ratio_clip_c=None,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    loss_type="dapo",
)


def _batch(curr, prev, adv, *, ref=None, token_mask=None, sample_mask=None):
    curr = torch.tensor(curr, dtype=torch.float64)
    n, s = curr.shape
    return LossInputs(
        logprobs=curr,
        prev_logprobs=torch.tensor(prev, dtype=torch.float64),
        reference_policy_logprobs=curr.clone() if ref is None else torch.tensor(ref, dtype=torch.float64),
        generation_logprobs=torch.tensor(prev, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        token_mask=torch.ones(n, s, dtype=torch.bool) if token_mask is None else torch.tensor(token_mask),
        sample_mask=torch.ones(n, dtype=torch.bool) if sample_mask is None else torch.tensor(sample_mask),
    )


def test_kl_estimators_hand_computed():
    # logr = ref - curr = -0.5 - (-1.0) = 0.5
    curr, ref = torch.tensor([-1.0]), torch.tensor([-0.5])
    assert kl_penalty(curr, ref, "k1").item() == pytest.approx(-0.5)  # -logr
    assert kl_penalty(curr, ref, "k2").item() == pytest.approx(0.125)  # 0.5^2 / 2
    assert kl_penalty(curr, ref, "k3").item() == pytest.approx(math.exp(0.5) - 1 - 0.5)  # 0.148721
    # clamps: logr = 30 -> clamped to 20 -> k3 = e^20 - 21 -> clamped to 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(curr, ref, "k4")


def test_kl_zero_when_policy_equals_reference():
    x = torch.randn(4, 7)
    for kind in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(x, x, kind), torch.zeros(4, 7))


def test_clipped_loss_hand_computed():
    # one sample, positions 1 and 2 count (position 0 is the unused prefix slot)
    # t=1: ratio = exp(0.1) = 1.10517, A = +1 -> max(-1.10517, -1.10517) = -1.10517 (inside the clip range)
    # t=2: ratio = exp(0.5) = 1.64872, A = +1 -> clipped to 1.2 -> max(-1.64872, -1.2) = -1.2
    # token-level mean over 2 tokens: (-1.10517 - 1.2) / 2 = -1.152585
    b = _batch([[0.0, -1.0, -1.0]], [[0.0, -1.1, -1.5]], [[0.0, 1.0, 1.0]])
    loss, sums = clipped_pg_loss(b, **DEFAULTS, global_valid_toks=2, global_valid_seqs=1)
    assert loss.item() == pytest.approx(-1.152585, abs=1e-6)
    assert sums["probs_ratio_clamped"].item() == pytest.approx(1.10517 + 1.2, abs=1e-5)


def test_negative_advantage_and_dual_clip():
    # A = -1, ratio = exp(2) = 7.389: PPO term max(7.389, 1.2) = 7.389; dual clip c=3 -> min(7.389, 3) = 3
    b = _batch([[0.0, 0.0]], [[0.0, -2.0]], [[0.0, -1.0]])
    loss, _ = clipped_pg_loss(b, **DEFAULTS, global_valid_toks=1, global_valid_seqs=1)
    assert loss.item() == pytest.approx(math.exp(2.0))
    loss_c, _ = clipped_pg_loss(b, **{**DEFAULTS, "ratio_clip_c": 3.0}, global_valid_toks=1, global_valid_seqs=1)
    assert loss_c.item() == pytest.approx(3.0)


def test_zero_advantage_and_equal_reference_gives_zero_loss():
    curr = torch.randn(3, 6, dtype=torch.float64).tolist()
    b = _batch(curr, curr, [[0.0] * 6] * 3)
    loss, sums = clipped_pg_loss(
        b, **{**DEFAULTS, "reference_policy_kl_penalty": 0.01}, global_valid_toks=15, global_valid_seqs=3
    )
    assert loss.item() == 0.0
    assert sums["kl_penalty"].item() == 0.0


def test_sequence_level_loss_hand_computed():
    # sample 0: 2 valid tokens with per-token loss -1 each -> mean -1
    # sample 1: 1 valid token with per-token loss -2       -> mean -2
    # sequence-level: (-1 + -2) / 2 sequences = -1.5; token-level would be (-1 -1 -2) / 3 = -1.3333
    b = _batch(
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[0.0, 1.0, 1.0], [0.0, 2.0, 2.0]],
        token_mask=[[False, True, True], [False, True, False]],
    )
    seq, _ = clipped_pg_loss(b, **{**DEFAULTS, "loss_type": "grpo"}, global_valid_toks=3, global_valid_seqs=2)
    tok, _ = clipped_pg_loss(b, **DEFAULTS, global_valid_toks=3, global_valid_seqs=2)
    assert seq.item() == pytest.approx(-1.5)
    assert tok.item() == pytest.approx(-4 / 3)


def test_padding_changes_nothing():
    torch.manual_seed(1)
    curr = torch.randn(2, 5, dtype=torch.float64)
    prev = curr + 0.1 * torch.randn(2, 5, dtype=torch.float64)
    adv = torch.randn(2, 1, dtype=torch.float64).expand(2, 5).clone()
    b = _batch(curr.tolist(), prev.tolist(), adv.tolist())
    pad = lambda x, v=0.0: torch.cat([x, torch.full((2, 3), v, dtype=x.dtype)], 1)  # noqa: E731
    padded = LossInputs(
        logprobs=pad(b.logprobs, 7.0),
        prev_logprobs=pad(b.prev_logprobs, -3.0),
        reference_policy_logprobs=pad(b.reference_policy_logprobs, 5.0),
        generation_logprobs=pad(b.generation_logprobs),
        advantages=pad(b.advantages, 9.0),
        token_mask=torch.cat([b.token_mask, torch.zeros(2, 3, dtype=torch.bool)], 1),
        sample_mask=b.sample_mask,
    )
    args = {**DEFAULTS, "reference_policy_kl_penalty": 0.05}
    l1, _ = clipped_pg_loss(b, **args, global_valid_toks=8, global_valid_seqs=2)
    l2, _ = clipped_pg_loss(padded, **args, global_valid_toks=8, global_valid_seqs=2)
    assert l1.item() == pytest.approx(l2.item(), abs=1e-12)


def test_masked_sample_contributes_nothing():
    b = _batch(
        [[0.0, -1.0], [0.0, -1.0]], [[0.0, -1.0], [0.0, -1.0]], [[0.0, 1.0], [0.0, 100.0]], sample_mask=[True, False]
    )
    loss, _ = clipped_pg_loss(b, **DEFAULTS, global_valid_toks=1, global_valid_seqs=1)
    assert loss.item() == pytest.approx(-1.0)


def test_importance_sampling_correction_hand_computed():
    # A = +1, curr = prev = -1.0 (ratio 1); generation logprob gen = -1.5:
    #   w = exp(prev - gen) = exp(0.5) = 1.64872 -> L_pg = -1 * 1 * 1.64872
    #   truncated at 1.2: L_pg = -1.2;  without the correction: -1.0
    b = LossInputs(
        logprobs=torch.tensor([[0.0, -1.0]], dtype=torch.float64),
        prev_logprobs=torch.tensor([[0.0, -1.0]], dtype=torch.float64),
        reference_policy_logprobs=torch.tensor([[0.0, -1.0]], dtype=torch.float64),
        generation_logprobs=torch.tensor([[0.0, -1.5]], dtype=torch.float64),
        advantages=torch.tensor([[0.0, 1.0]], dtype=torch.float64),
        token_mask=torch.tensor([[False, True]]),
        sample_mask=torch.tensor([True]),
    )
    counts = dict(global_valid_toks=1, global_valid_seqs=1)
    plain, _ = clipped_pg_loss(b, **DEFAULTS, **counts)
    full, sums = clipped_pg_loss(b, **DEFAULTS, **counts, use_importance_sampling_correction=True)
    tis, _ = clipped_pg_loss(
        b, **DEFAULTS, **counts, use_importance_sampling_correction=True, truncated_importance_sampling_ratio=1.2
    )
    assert plain.item() == pytest.approx(-1.0)
    assert full.item() == pytest.approx(-math.exp(0.5))
    assert sums["sampling_importance_ratio"].item() == pytest.approx(math.exp(0.5))
    assert tis.item() == pytest.approx(-1.2)


def test_importance_weight_of_an_impossible_generation_token_is_zero():
    # gen = -inf (the back-end reported an impossible token): exp(prev - gen) = inf -> weight 0, loss stays finite
    b = _batch([[0.0, -1.0]], [[0.0, -1.0]], [[0.0, 1.0]])
    b = LossInputs(**{**b.__dict__, "generation_logprobs": torch.tensor([[0.0, -math.inf]], dtype=torch.float64)})
    loss, _ = clipped_pg_loss(
        b, **DEFAULTS, global_valid_toks=1, global_valid_seqs=1, use_importance_sampling_correction=True
    )
    assert loss.item() == 0.0


def test_the_config_section_reaches_every_setting_of_the_loss():
    cfg = LossConfig(
        reference_policy_kl_penalty=0.3,
        reference_policy_kl_type="k1",
        reference_policy_kl_gradient="reverse_kl",
        ratio_clip_min=0.1,
        ratio_clip_max=0.3,
        ratio_clip_c=3.0,
        loss_type="grpo",
        importance_sampling_level="sequence",
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
    )
    b = _batch(
        [[0.0, -1.0, -2.0, -0.5]], [[0.0, -1.5, -1.0, -0.7]], [[0.0, -2.0, -2.0, 1.0]], ref=[[0.0, -0.5, -2.5, -0.1]]
    )
    b = LossInputs(**{**b.__dict__, "generation_logprobs": b.prev_logprobs - 0.4})
    got = clipped_pg_loss_with(b, cfg, global_valid_toks=3, global_valid_seqs=1, max_response_tokens=4)
    want = clipped_pg_loss(
        b,
        ratio_clip_min=0.1,
        ratio_clip_max=0.3,
        ratio_clip_c=3.0,
        reference_policy_kl_penalty=0.3,
        reference_policy_kl_type="k1",
        reference_policy_kl_gradient="reverse_kl",
        loss_type="grpo",
        importance_sampling_level="sequence",
        global_valid_toks=3,
        global_valid_seqs=1,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=1.5,
    )
    assert torch.equal(got[0], want[0]) and all(torch.equal(got[1][k], want[1][k]) for k in want[1])
    assert not torch.equal(
        got[0], clipped_pg_loss(b, **DEFAULTS, global_valid_toks=3, global_valid_seqs=1)[0]
    )  # the settings matter here
    dr = clipped_pg_loss_with(
        b, LossConfig(loss_type="dr_grpo"), global_valid_toks=3, global_valid_seqs=1, max_response_tokens=4
    )[0]
    assert dr.item() == pytest.approx(
        clipped_pg_loss_with(b, LossConfig(), global_valid_toks=3, global_valid_seqs=1, max_response_tokens=4)[0].item()
        * 3
        / 4
    )
