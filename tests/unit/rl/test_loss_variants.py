"""The loss variants (GRPO, DAPO, Dr. GRPO, GSPO, GSPO-token, CISPO) and the KL gradient conventions against float64
references written one sequence and one token at a time from the papers' equations; hand-computed values at the edges;
the metrics as NeMo-RL and TRL define them."""

from __future__ import annotations

import math

import pytest
import torch

from rl.loss import LossInputs, clipped_pg_loss, kl_penalty

VARIANTS = [
    ("dapo", "token"),
    ("grpo", "token"),
    ("dr_grpo", "token"),
    ("cispo", "token"),
    ("grpo", "sequence"),
    ("grpo", "sequence_token"),
]
KLS = [("k1", "reverse_kl"), ("k2", "estimator"), ("k2", "reverse_kl"), ("k3", "estimator"), ("k3", "reverse_kl")]


def _paper_kl(curr: torch.Tensor, ref: float, kl_type: str, gradient: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi || pi_ref) on one sampled token (joschu.net/blog/kl-approx), with NeMo-RL's
    clamps; ``reverse_kl`` adds the score-function weight pi / sg(pi) that makes the gradient that of E_pi[k]."""
    logr = ref - curr
    clamped = min(max(float(logr.detach()), -20.0), 20.0)
    x = (
        logr if clamped == float(logr.detach()) else torch.tensor(clamped, dtype=torch.float64)
    )  # a clamped input has no gradient
    k = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - 1 - x}[kl_type]
    if gradient == "reverse_kl":
        w = torch.exp(curr - curr.detach())
        k = (w if clamped == float(logr.detach()) else w.detach()) * k
    return k.clamp(-10.0, 10.0)


def _clip(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return x.clamp(low, high)


def paper_loss(
    b: LossInputs,
    *,
    loss_type,
    level,
    kl_type,
    kl_gradient,
    beta,
    eps_low,
    eps_high,
    c,
    is_correction,
    tis,
    toks,
    seqs,
    max_tokens,
):
    """The loss of each variant from its paper, summed sequence by sequence and token by token.

    PPO-clip per token (DeepSeekMath eq. 3): l_t = -min(r_t A, clip(r_t) A), dual clip -max(l, c A) for A < 0 written as
    min(l, -c A). GSPO (2507.18071 eq. 5-7): s_i = exp(mean_t log r_t), l_i = -min(s_i A_i, clip(s_i) A_i). GSPO-token
    (eq. 10): s_i,t = sg(s_i) pi_t / sg(pi_t). CISPO (2506.13585 eq. 4): l_t = -sg(clip(r_t)) A_t log pi_t. Aggregation:
    DAPO (2503.14476 eq. 12) sum over tokens / tokens; GRPO mean per sequence / sequences; Dr. GRPO (2503.20783)
    sum / (sequences x generation budget). Off-policy weights: exp(prev - gen) per token, exp(sum_t (prev - gen)) per
    sequence at the sequence levels, truncated at ``tis``."""
    n, s = b.logprobs.shape
    total = torch.zeros((), dtype=torch.float64)
    for i in range(n):
        if not bool(b.sample_mask[i]):
            continue
        tokens = [t for t in range(1, s) if bool(b.token_mask[i, t])]
        if not tokens:
            continue
        curr = [b.logprobs[i, t] for t in tokens]
        prev = [float(b.prev_logprobs[i, t]) for t in tokens]
        gen = [float(b.generation_logprobs[i, t]) for t in tokens]
        adv = [float(b.advantages[i, t]) for t in tokens]
        kls = [
            beta * _paper_kl(curr[j], float(b.reference_policy_logprobs[i, tokens[j]]), kl_type, kl_gradient)
            for j in range(len(tokens))
        ]
        seq_weight = math.exp(sum(p - g for p, g in zip(prev, gen)))
        seq_weight = min(seq_weight, tis) if tis is not None else seq_weight
        terms = []
        if level == "token":
            for j in range(len(tokens)):
                r = torch.exp(curr[j] - prev[j])
                a = adv[j]
                if loss_type == "cispo":
                    term = -_clip(r, 1 - eps_low, 1 + eps_high).detach() * a * curr[j]
                else:
                    plain, clipped = -r * a, -_clip(r, 1 - eps_low, 1 + eps_high) * a
                    term = plain if plain >= clipped else clipped
                    if c is not None and a < 0:
                        term = term if term <= -c * a else torch.tensor(-c * a, dtype=torch.float64)
                if is_correction:
                    w = math.exp(prev[j] - gen[j])
                    term = term * (min(w, tis) if tis is not None else w)
                terms.append(term + kls[j])
        else:
            s_i = torch.exp(sum(cj - pj for cj, pj in zip(curr, prev)) / len(tokens))
            for j in range(len(tokens)):
                r = s_i if level == "sequence" else s_i.detach() * torch.exp(curr[j] - curr[j].detach())
                a = adv[j]
                plain, clipped = -r * a, -_clip(r, 1 - eps_low, 1 + eps_high) * a
                term = plain if plain >= clipped else clipped
                if c is not None and a < 0:
                    term = term if term <= -c * a else torch.tensor(-c * a, dtype=torch.float64)
                if is_correction:
                    term = term * seq_weight
                terms.append(term + kls[j])
        if loss_type in ("dapo", "cispo"):
            total = total + sum(terms) / toks
        elif loss_type == "grpo":
            total = total + sum(terms) / len(terms) / seqs
        else:
            total = total + sum(terms) / (seqs * max_tokens)
    return total


def _random_batch(seed: int, n: int = 7, s: int = 10) -> LossInputs:
    """Rows with padding, holes in the response, one invalid sample, one empty and one one-token response, a group of
    equal rewards (A = 0), and garbage values where nothing counts."""
    g = torch.Generator().manual_seed(seed)
    curr = -torch.rand(n, s, generator=g, dtype=torch.float64) * 3
    prev = curr + 0.35 * torch.randn(n, s, generator=g, dtype=torch.float64)  # ratios in and out of the clip range
    token_mask = (torch.rand(n, s, generator=g) > 0.25) & (torch.arange(s) >= 2)
    token_mask[:, -2:] = False  # padding
    token_mask[2] = False  # an empty response
    token_mask[3] = False
    token_mask[3, 5] = True  # a one-token response
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, s).clone()
    adv[4] = 0.0  # a group whose rewards were all equal
    valid = ~token_mask
    garbage = lambda x, v: torch.where(valid, torch.full_like(x, v), x)  # noqa: E731
    return LossInputs(
        logprobs=garbage(curr, 0.5).requires_grad_(True),
        prev_logprobs=garbage(prev, -2.0),
        reference_policy_logprobs=garbage(curr + 0.5 * torch.randn(n, s, generator=g, dtype=torch.float64), 3.0),
        generation_logprobs=garbage(prev + 0.2 * torch.randn(n, s, generator=g, dtype=torch.float64), 1.0),
        advantages=garbage(adv, 9.0),
        token_mask=token_mask,
        sample_mask=torch.tensor([True, True, True, True, True, False, True]),
    )


@pytest.mark.parametrize(("loss_type", "level"), VARIANTS)
@pytest.mark.parametrize(("kl_type", "kl_gradient"), KLS)
@pytest.mark.parametrize(("off_policy", "dual"), [(False, None), (True, 3.0)])
def test_every_variant_equals_its_paper_in_value_and_gradient(loss_type, level, kl_type, kl_gradient, off_policy, dual):
    if loss_type == "cispo":
        dual = None  # the config refuses a dual clip with CISPO
    b = _random_batch(11)
    mask = b.token_mask[:, 1:] & b.sample_mask[:, None]
    toks, seqs = float(mask.sum()), float(b.sample_mask.sum())
    tis = 1.5 if off_policy else None
    args = dict(
        ratio_clip_min=0.2,
        ratio_clip_max=0.28,
        ratio_clip_c=dual,
        reference_policy_kl_penalty=0.05,
        reference_policy_kl_type=kl_type,
    )
    ours, _ = clipped_pg_loss(
        b,
        **args,
        reference_policy_kl_gradient=kl_gradient,
        loss_type=loss_type,
        importance_sampling_level=level,
        global_valid_toks=toks,
        global_valid_seqs=seqs,
        max_response_tokens=12,
        use_importance_sampling_correction=off_policy,
        truncated_importance_sampling_ratio=tis,
    )
    (grad,) = torch.autograd.grad(ours, b.logprobs)
    want = paper_loss(
        b,
        loss_type=loss_type,
        level=level,
        kl_type=kl_type,
        kl_gradient=kl_gradient,
        beta=0.05,
        eps_low=0.2,
        eps_high=0.28,
        c=dual,
        is_correction=off_policy,
        tis=tis,
        toks=toks,
        seqs=seqs,
        max_tokens=12,
    )
    (want_grad,) = torch.autograd.grad(want, b.logprobs)
    assert ours.item() == pytest.approx(want.item(), abs=1e-12)
    assert torch.allclose(grad, want_grad, rtol=0, atol=1e-12)
    assert grad.abs().sum() > 0  # the batch moves the policy
    assert torch.equal(grad[:, 0], torch.zeros(grad.shape[0], dtype=torch.float64))  # position 0 is no prediction
    assert torch.equal(
        grad[:, 1:][~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64)
    )  # padding, holes, invalid: no gradient


def _on_policy(b: LossInputs) -> LossInputs:
    prev = b.logprobs.detach().clone()
    return LossInputs(**{**b.__dict__, "prev_logprobs": prev, "generation_logprobs": prev})


def _grad(b: LossInputs, **kw) -> torch.Tensor:
    args = dict(
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        ratio_clip_c=None,
        reference_policy_kl_penalty=0.0,
        reference_policy_kl_type="k3",
        global_valid_toks=20.0,
        global_valid_seqs=6.0,
    )
    loss, _ = clipped_pg_loss(b, **{**args, **kw})
    return torch.autograd.grad(loss, b.logprobs)[0]


def test_on_policy_gspo_trains_as_sequence_mean_grpo_and_cispo_as_dapo():
    # one update per step: every ratio is 1 with the gradient of log pi, so clipping never binds; GSPO's
    # grad s_i = mean_t grad log pi_t then equals the sequence-mean of the token terms, and CISPO's
    # -sg(1) A grad log pi equals PPO's -A grad r
    b = _on_policy(_random_batch(5))
    assert torch.allclose(
        _grad(b, loss_type="grpo", importance_sampling_level="sequence"), _grad(b, loss_type="grpo"), rtol=0, atol=1e-15
    )
    assert torch.allclose(_grad(b, loss_type="cispo"), _grad(b, loss_type="dapo"), rtol=0, atol=1e-15)


def test_gspo_token_trains_as_gspo_with_one_advantage_per_sequence_off_policy_too():
    b = _random_batch(7)
    assert torch.allclose(
        _grad(b, loss_type="grpo", importance_sampling_level="sequence_token"),
        _grad(b, loss_type="grpo", importance_sampling_level="sequence"),
        rtol=0,
        atol=1e-14,
    )


# --------------------------------------------------------------------------------------- hand-computed edges
def _one(curr, prev, adv, *, gen=None, ref=None, token_mask=None, sample_mask=None):
    curr_t = torch.tensor(curr, dtype=torch.float64, requires_grad=True)
    n, s = curr_t.shape
    prev_t = torch.tensor(prev, dtype=torch.float64)
    return LossInputs(
        logprobs=curr_t,
        prev_logprobs=prev_t,
        reference_policy_logprobs=curr_t.detach().clone() if ref is None else torch.tensor(ref, dtype=torch.float64),
        generation_logprobs=prev_t.clone() if gen is None else torch.tensor(gen, dtype=torch.float64),
        advantages=torch.tensor(adv, dtype=torch.float64),
        token_mask=torch.ones(n, s, dtype=torch.bool) if token_mask is None else torch.tensor(token_mask),
        sample_mask=torch.ones(n, dtype=torch.bool) if sample_mask is None else torch.tensor(sample_mask),
    )


def _loss(b, **kw):
    args = dict(
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        ratio_clip_c=None,
        reference_policy_kl_penalty=0.0,
        reference_policy_kl_type="k3",
        global_valid_toks=2.0,
        global_valid_seqs=1.0,
        max_response_tokens=4,
    )
    return clipped_pg_loss(b, **{**args, **kw})


def test_gspo_clips_the_length_normalized_sequence_ratio():
    # log ratios 0.1 and 0.5: s = exp(0.3) = 1.349859, beyond 1.2
    #   A = +1: -min(1.349859, 1.2) = -1.2, clipped: no gradient
    #   A = -1: -min(-1.349859, -1.2) = 1.349859; d/dcurr_t = s / 2 = 0.674929 on each token
    pos = _one([[0.0, -1.0, -1.0]], [[0.0, -1.1, -1.5]], [[0.0, 1.0, 1.0]])
    loss, sums = _loss(pos, loss_type="grpo", importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(-1.2)
    assert torch.equal(torch.autograd.grad(loss, pos.logprobs)[0], torch.zeros(1, 3, dtype=torch.float64))
    assert (
        sums["clip_fraction/high"].item() == 2.0 and sums["clip_fraction/low"].item() == 0.0
    )  # both tokens' sequence was clipped
    neg = _one([[0.0, -1.0, -1.0]], [[0.0, -1.1, -1.5]], [[0.0, -1.0, -1.0]])
    loss, _ = _loss(neg, loss_type="grpo", importance_sampling_level="sequence")
    assert loss.item() == pytest.approx(math.exp(0.3))
    assert torch.autograd.grad(loss, neg.logprobs)[0][0, 1:].tolist() == pytest.approx([math.exp(0.3) / 2] * 2)


def test_cispo_weights_a_reinforce_term_with_a_clipped_stop_gradient_ratio():
    # one token: ratio exp(-1 - (-1.5)) = 1.648721 -> weight clipped to 1.2; A = +1
    #   loss = -1.2 * 1 * log pi = -1.2 * -1 = 1.2 (over 1 token); d loss / d curr = -1.2:
    #   the clipped token still learns
    b = _one([[0.0, -1.0]], [[0.0, -1.5]], [[0.0, 1.0]])
    loss, sums = _loss(b, loss_type="cispo", global_valid_toks=1.0)
    assert loss.item() == pytest.approx(1.2)
    assert torch.autograd.grad(loss, b.logprobs)[0][0, 1].item() == pytest.approx(-1.2)
    ppo, _ = _loss(b, global_valid_toks=1.0)  # PPO-clip cuts that token's gradient
    assert torch.autograd.grad(ppo, b.logprobs)[0][0, 1].item() == 0.0
    assert sums["clip_fraction/high"].item() == 1.0


def test_dr_grpo_divides_by_sequences_times_the_generation_budget():
    # per-token terms -exp(0.1) = -1.105171 and -1.2 (clipped); sum -2.305171 over 1 sequence x 4 tokens of budget
    b = _one([[0.0, -1.0, -1.0]], [[0.0, -1.1, -1.5]], [[0.0, 1.0, 1.0]])
    assert _loss(b, loss_type="dr_grpo")[0].item() == pytest.approx(-(math.exp(0.1) + 1.2) / 4)
    assert _loss(b, loss_type="dapo")[0].item() == pytest.approx(-(math.exp(0.1) + 1.2) / 2)
    with pytest.raises(ValueError, match="max_response_tokens"):
        _loss(b, loss_type="dr_grpo", max_response_tokens=None)


@pytest.mark.parametrize(("loss_type", "level"), VARIANTS)
def test_edges_empty_one_token_equal_rewards_and_invalid_samples(loss_type, level):
    # row 0: empty response; row 1: one token (the sequence ratio is the token ratio); row 2: A = 0 (a group of equal
    # rewards); row 3: invalid with a huge advantage. Only row 1 counts: ratio exp(0.5) = 1.648721, A = -1.
    b = _one(
        [[0.0, -1.0, -1.0], [0.0, -1.0, -2.0], [0.0, -1.0, -1.0], [0.0, -1.0, -1.0]],
        [[0.0, -1.2, -1.3], [0.0, -1.0, -2.5], [0.0, -1.5, -1.5], [0.0, -1.5, -1.5]],
        [[0.0, 3.0, 3.0], [0.0, -1.0, -1.0], [0.0, 0.0, 0.0], [0.0, 100.0, 100.0]],
        token_mask=[[True, False, False], [False, False, True], [False, True, True], [False, True, True]],
        sample_mask=[True, True, True, False],
    )
    loss, _ = _loss(
        b, loss_type=loss_type, importance_sampling_level=level, global_valid_toks=3.0, global_valid_seqs=3.0
    )
    grad = torch.autograd.grad(loss, b.logprobs)[0]
    # PPO-clip and GSPO: -min(-r, -1.2) = r = 1.648721; CISPO: -sg(clip(r)) * A * log pi = -1.2 * -1 * -2.0 = -2.4
    per_token = -2.4 if loss_type == "cispo" else math.exp(0.5)
    expected = {"dapo": per_token / 3, "cispo": per_token / 3, "grpo": per_token / 3, "dr_grpo": per_token / (3 * 4)}[
        loss_type
    ]
    assert loss.item() == pytest.approx(expected)
    assert (
        torch.count_nonzero(grad[[0, 2, 3]]) == 0
    )  # no gradient from the empty, the zero-advantage or the invalid row
    assert grad[1, 2].item() != 0.0


def test_approx_entropy_is_importance_weighted_to_the_current_policy():
    # NeMo-RL: mean over valid tokens of -exp(curr - gen) * curr; curr = -1, gen = -1.5: exp(0.5) * 1 = 1.648721
    b = _one([[0.0, -1.0]], [[0.0, -1.0]], [[0.0, 1.0]], gen=[[0.0, -1.5]])
    _, sums = _loss(b, global_valid_toks=1.0)
    assert sums["approx_entropy"].item() == pytest.approx(math.exp(0.5))


def test_sampling_importance_ratio_is_reported_with_the_correction_off():
    # w = exp(prev - gen) = exp(-1 - (-1.5)) = exp(0.5): reported whether or not the loss uses it
    b = _one([[0.0, -1.0]], [[0.0, -1.0]], [[0.0, 1.0]], gen=[[0.0, -1.5]])
    off_loss, off = _loss(b, global_valid_toks=1.0)
    on_loss, on = _loss(b, global_valid_toks=1.0, use_importance_sampling_correction=True)
    assert (
        off["sampling_importance_ratio"].item()
        == pytest.approx(math.exp(0.5))
        == on["sampling_importance_ratio"].item()
    )
    assert off_loss.item() == pytest.approx(-1.0) and on_loss.item() == pytest.approx(-math.exp(0.5))


def test_sequence_level_sampling_importance_ratio_is_a_sum_over_sequences():
    # GSPO: w_i = exp(sum_t (prev - gen)): row 0 exp(0.2 + 0.3) = exp(0.5) on 2 tokens, row 1 exp(0) = 1 on 1 token;
    # a sum over the 2 valid sequences, exp(0.5) + 1 (tokens would count row 0 twice)
    b = _one(
        [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]],
        [[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]],
        [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]],
        gen=[[0.0, -1.2, -1.3], [0.0, -1.0, -1.0]],
        token_mask=[[False, True, True], [False, False, True]],
    )
    _, sums = _loss(b, loss_type="grpo", importance_sampling_level="sequence")
    assert sums["sampling_importance_ratio"].item() == pytest.approx(math.exp(0.5) + 1)
    assert sums["valid_seqs"].item() == 2.0 and sums["valid_toks"].item() == 3.0


def test_metrics_stay_finite_in_float32_with_a_huge_gap_on_a_masked_sample():
    # the masked-out sample's logprob gap of 100 nats: exp(100) overflows float32, and exp(100) * 0 would be NaN
    curr = torch.tensor([[0.0, -1.0], [0.0, -1.0]], requires_grad=True)
    b = LossInputs(
        logprobs=curr,
        prev_logprobs=curr.detach().clone(),
        reference_policy_logprobs=curr.detach().clone(),
        generation_logprobs=torch.tensor([[0.0, -1.0], [0.0, -101.0]]),
        advantages=torch.tensor([[0.0, 1.0], [0.0, 1.0]]),
        token_mask=torch.ones(2, 2, dtype=torch.bool),
        sample_mask=torch.tensor([True, False]),
    )
    loss, sums = _loss(b, global_valid_toks=1.0)
    assert all(math.isfinite(float(v)) for v in sums.values() if v.numel() == 1), sums
    assert sums["token_mult_prob_error"].item() == 1.0 and sums["approx_entropy"].item() == 1.0
    assert math.isfinite(loss.item())


def test_clip_fractions_count_the_tokens_whose_ratio_the_clip_cut():
    # ratios exp(0.5) (A = +1: high), exp(-0.5) = 0.607 (A = -1: low), exp(0.5) with A = -1 (not cut by PPO; the
    # dual clip c = 1.5 cuts it: high), exp(0.1) (inside)
    b = _one([[0.0, 0.0, 0.0, 0.0, 0.0]], [[0.0, -0.5, 0.5, -0.5, -0.1]], [[0.0, 1.0, -1.0, -1.0, 1.0]])
    _, plain = _loss(b, global_valid_toks=4.0)
    assert (plain["clip_fraction/low"].item(), plain["clip_fraction/high"].item()) == (1.0, 1.0)
    _, dual = _loss(b, global_valid_toks=4.0, ratio_clip_c=1.5)
    assert (dual["clip_fraction/low"].item(), dual["clip_fraction/high"].item()) == (1.0, 2.0)
    _, cispo = _loss(b, global_valid_toks=4.0, loss_type="cispo")  # CISPO: every clamped weight, whatever A's sign
    assert (cispo["clip_fraction/low"].item(), cispo["clip_fraction/high"].item()) == (1.0, 2.0)


# --------------------------------------------------------------------------------------- the KL term's gradient
def _expected_kl_gradient(kl_type: str, gradient: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On-policy over a vocabulary of 5: the exact expectation over y ~ pi of the gradient of the KL term with respect
    to the logits, beside grad KL(pi || pi_ref) and grad KL(pi_ref || pi)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, generator=g, dtype=torch.float64), 0)
    logp = torch.log_softmax(logits, 0)
    expected = (logp.exp().detach() * kl_penalty(logp, ref, kl_type, gradient=gradient)).sum()  # sum_y pi(y) L(y)
    (got,) = torch.autograd.grad(expected, logits)
    logp = torch.log_softmax(logits, 0)
    (reverse,) = torch.autograd.grad((logp.exp() * (logp - ref)).sum(), logits)
    logp = torch.log_softmax(logits, 0)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - logp)).sum(), logits)
    return got, reverse, forward


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_reverse_kl_gives_the_gradient_of_kl_policy_reference(kl_type):
    got, reverse, forward = _expected_kl_gradient(kl_type, "reverse_kl")
    assert torch.allclose(got, reverse, rtol=0, atol=1e-14)
    assert not torch.allclose(got, forward, atol=1e-3)


def test_the_estimator_convention_k3_k2_and_k1():
    got, reverse, forward = _expected_kl_gradient("k3", "estimator")
    assert torch.allclose(got, forward, rtol=0, atol=1e-14)  # k3 as a loss: grad KL(pi_ref || pi)
    got, reverse, _ = _expected_kl_gradient("k2", "estimator")
    assert torch.allclose(got, reverse, rtol=0, atol=1e-14)  # k2 as a loss: grad KL(pi || pi_ref)
    got, *_ = _expected_kl_gradient("k1", "estimator")
    assert torch.allclose(
        got, torch.zeros(5, dtype=torch.float64), atol=1e-15
    )  # k1 as a loss: nothing (the config refuses it)


def test_the_kl_value_is_the_same_under_both_gradients_and_a_clamped_value_has_no_gradient():
    curr = torch.tensor([-1.0, -30.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.5, -1.0], dtype=torch.float64)  # logr = 0.5 and 29 (clamped to 20, then the estimate to 10)
    a, b = kl_penalty(curr, ref, "k3"), kl_penalty(curr, ref, "k3", gradient="reverse_kl")
    assert torch.equal(a, b)
    assert b[1].item() == 10.0
    (grad,) = torch.autograd.grad(kl_penalty(curr, ref, "k1", gradient="reverse_kl").sum(), curr)
    assert grad[1].item() == 0.0  # clamped: neither the estimator nor its weight carries a gradient
    assert grad[0].item() == pytest.approx(-0.5 + 1.0)  # k1 + d k1 / d curr = (curr - ref) + 1
    with pytest.raises(ValueError, match="unknown KL gradient"):
        kl_penalty(curr, ref, "k3", gradient="forward")
