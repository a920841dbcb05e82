"""The shared training engine (`rl.backends.engine`): the update under a token budget (`rl.backends.micro_batch`)
equal to the row-count update, and the shared-prompt forward equal to the plain one. The back-ends' conformance and
data-parallel suites run through the same engine; the micro-batch planner's own tests are in ``test_micro_batch.py``."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rl.backends.engine import combine_step_metrics, make_optimizer
from rl.backends.hf import logprobs as lp
from rl.backends.hf.model import load_model
from rl.backends.hf.train import train_on_batch
from rl.backends.micro_batch import micro_batch_slices
from rl.config import config_from_dict
from tests.helpers import grouped_batch


def _cfg(**optim):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 3, "num_generations_per_prompt": 4},
            "optim": {"lr": 1e-3, "train_global_batch_size": 12, "max_grad_norm": 0.0, **optim},
            "loss": {"reference_policy_kl_penalty": 0.1},
            "model": {"precision": "float32"},
        }
    )


def test_an_update_under_a_token_budget_equals_the_row_count_update(tiny_model_dir):
    """A padded-token budget changes only which rows share a forward: loss, metrics and weights match the update in
    micro-batches of 4 rows (float64 model; transformers rounds to float32 inside RMSNorm and the eager softmax)."""

    base = load_model(tiny_model_dir).double()
    batch = grouped_batch(12, 14, prompt=5, seed=3)
    batch["prev_logprobs"] = batch["generation_logprobs"] + 0.01
    results = []
    for optim in (
        {"train_micro_batch_size": 4},
        {"train_max_tokens_per_micro_batch": 30},
        {"train_max_tokens_per_micro_batch": 10**6},
    ):
        model = copy.deepcopy(base)
        cfg = _cfg(**optim)
        opt, sched = make_optimizer(model, cfg)
        results.append((train_on_batch(model, opt, sched, batch, cfg), model))
    (m0, w0), *rest = results
    assert len(micro_batch_slices(batch["input_lengths"], max_rows=None, max_tokens=30)) > 3  # the budget did split
    for metrics, weights in rest:
        assert metrics.keys() == m0.keys()
        for k, v in m0.items():
            assert metrics[k] == pytest.approx(v, rel=1e-7, abs=1e-10), k
        for (name, p), q in zip(w0.named_parameters(), weights.parameters(), strict=True):
            assert (p - q).abs().max().item() < 1e-6, name


def test_the_shared_prompt_forward_equals_the_plain_one_and_runs_where_it_saves_tokens(tiny_model_dir, monkeypatch):
    model = load_model(tiny_model_dir).double()
    batch = grouped_batch(8, 16, prompt=9, seed=1)
    args = (batch["input_ids"], batch["input_lengths"])
    shared = lp.plan_forward(*args, batch["token_mask"], min_saving=0.0)
    plain = lp.plan_forward(*args, batch["token_mask"], min_saving=None)
    assert shared.prefix_ids is not None and shared.prefix_ids.shape[0] == 2  # two groups of 4: two prompts
    assert plain.prefix_ids is None and plain.suffix_ids.shape == batch["input_ids"].shape
    assert lp.plan_forward(*args, batch["token_mask"], min_saving=0.99).prefix_ids is None  # saves < 99%: plain
    distinct = lp.plan_forward(batch["input_ids"][::4], batch["input_lengths"][::4], batch["token_mask"][::4])
    assert distinct.prefix_ids is None  # no two rows share a prompt: nothing to save, the plain forward
    out = {}
    for name, saving in (("shared", 0.0), ("plain", 1.0)):
        monkeypatch.setitem(lp.SHARED_PREFIX_MIN_SAVING, "cpu", saving)
        out[name] = lp.forward_logprobs(model, *args, precision="float32", token_mask=batch["token_mask"])
    assert (out["shared"] - out["plain"]).abs().max().item() < 1e-6
    assert bool((out["plain"] != 0).eq(batch["token_mask"]).all())  # wanted tokens only (position 0 never)


def test_the_optimizer_is_fused_only_on_cuda(tiny_model_dir):
    opt, _ = make_optimizer(load_model(tiny_model_dir), _cfg())
    assert not opt.defaults.get("fused")


def test_sequence_errors_before_and_after_the_error_mask_skip_empty_responses(tiny_model_dir):
    """NeMo-RL's sequence logprob-error metrics: over valid samples with a response token, before the
    ``seq_logprob_error_threshold`` mask and after it, with the rows it masked counted (not every invalid row)."""

    model = load_model(tiny_model_dir).double()
    batch = grouped_batch(12, 14, prompt=5, seed=3)
    gap = torch.zeros(12, 1)
    gap[[4, 5, 9]] = 2.0  # exp(|gen - prev|) = exp(2) = 7.389 on every response token of these rows
    batch["prev_logprobs"] = batch["generation_logprobs"] + gap
    batch["token_mask"][0] = False  # an empty response: its error would read 0
    batch["sample_mask"][9] = False  # invalid before any mask (say, overlong-filtered): counted nowhere
    cfg = _cfg(train_micro_batch_size=4)
    cfg.loss.seq_logprob_error_threshold = 2.0
    metrics = train_on_batch(model, *make_optimizer(model, cfg), batch, cfg)
    assert metrics["min_seq_mult_prob_error"] == pytest.approx(1.0) and metrics[
        "max_seq_mult_prob_error"
    ] == pytest.approx(math.exp(2))
    assert metrics["mean_seq_mult_prob_error"] == pytest.approx(
        (8 + 2 * math.exp(2)) / 10
    )  # rows 1-3, 6-8, 10, 11 and 4, 5
    assert (
        metrics["max_seq_mult_prob_error_after_mask"]
        == pytest.approx(1.0)
        == metrics["min_seq_mult_prob_error_after_mask"]
    )
    assert metrics["num_masked_seqs_by_logprob_error"] == 2.0  # rows 4 and 5
    cfg.loss.seq_logprob_error_threshold = None
    plain = train_on_batch(model, *make_optimizer(model, cfg), batch, cfg)
    assert "max_seq_mult_prob_error_after_mask" not in plain and "num_masked_seqs_by_logprob_error" not in plain
    assert plain["min_seq_mult_prob_error"] == pytest.approx(1.0)


def test_step_metrics_divide_per_sequence_sums_by_sequences():
    errors = (torch.tensor([1.0, 2.0]), torch.tensor([1.0]))
    ranks = [
        (
            {
                "sampling_importance_ratio": 3.0,
                "probs_ratio": 4.0,
                "valid_toks": 4.0,
                "valid_seqs": 2.0,
                "clip_fraction/low": 1.0,
            },
            [0.5],
            errors,
            1,
        ),
        (
            {
                "sampling_importance_ratio": 1.0,
                "probs_ratio": 4.0,
                "valid_toks": 4.0,
                "valid_seqs": 2.0,
                "clip_fraction/low": 0.0,
            },
            [0.25],
            errors,
            0,
        ),
    ]
    tokens = combine_step_metrics(ranks, masking=False)
    seqs = combine_step_metrics(ranks, masking=True, per_sequence=frozenset({"sampling_importance_ratio"}))
    assert (
        tokens["sampling_importance_ratio"] == 0.5 and seqs["sampling_importance_ratio"] == 1.0
    )  # 4 / 8 tokens, 4 / 4 sequences
    assert tokens["probs_ratio"] == 1.0 and tokens["clip_fraction/low"] == 0.125 and tokens["loss"] == 0.75
    assert (
        seqs["max_seq_mult_prob_error"] == 2.0
        and seqs["max_seq_mult_prob_error_after_mask"] == 1.0
        and seqs["num_masked_seqs_by_logprob_error"] == 1.0
    )
