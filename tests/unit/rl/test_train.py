"""Training-step invariants on a tiny random model with the real tokenizer."""

from __future__ import annotations

import copy

import pytest
import torch

from rl.config import config_from_dict
from rl.logprobs import batched_logprobs, forward_logprobs
from rl.train import make_optimizer, train_on_batch


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
    from rl.model import load_model

    return load_model(tiny_model_dir).double()


def _batch(n=8, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, width + 1, (n,), generator=g)
    ids = torch.randint(3, 1000, (n, width), generator=g)
    pos = torch.arange(width)[None]
    valid = pos < lengths[:, None]
    ids = torch.where(valid, ids, torch.full_like(ids, 2))
    token_mask = valid & (pos >= 4)
    adv = torch.randn(n, 1, generator=g, dtype=torch.float64).expand(n, width).contiguous()
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(n, dtype=torch.bool),
        "advantages": adv,
        "generation_logprobs": torch.zeros(n, width, dtype=torch.float64),
        "reference_policy_logprobs": torch.full((n, width), -5.0, dtype=torch.float64),
    }


def _cfg(mbs):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
            "optim": {"lr": 1e-3, "train_micro_batch_size": mbs, "train_global_batch_size": 8, "max_grad_norm": 0.0},
            "loss": {"reference_policy_kl_penalty": 0.1},
            "model": {"precision": "float32"},
        }
    )


@pytest.mark.parametrize("token_level", [True, False])
def test_micro_batches_1x8_and_8x1_give_the_same_update(tiny64, token_level):
    results = []
    for mbs in (8, 1):
        model = copy.deepcopy(tiny64)
        cfg = _cfg(mbs)
        cfg.loss.token_level_loss = token_level
        opt, sched = make_optimizer(model, cfg)
        metrics = train_on_batch(model, opt, sched, _batch(), cfg)
        results.append((model, metrics))
    (a, ma), (b, mb) = results
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-10)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-10)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max().item() < 1e-10, name
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), tiny64.parameters()))


def test_extra_padding_changes_nothing(tiny64):
    batch = _batch()
    lp = forward_logprobs(tiny64, batch["input_ids"], batch["input_lengths"], precision="float32", first_token=4)
    wide = torch.cat([batch["input_ids"], torch.full((8, 5), 7)], 1)
    lp_wide = forward_logprobs(tiny64, wide, batch["input_lengths"], precision="float32", first_token=4)
    assert torch.allclose(lp_wide[:, :12], lp, atol=1e-12)
    assert (lp_wide[:, 12:] == 0).all()


def test_logprobs_skip_only_positions_before_the_first_response_token(tiny64):
    batch = _batch()
    full = forward_logprobs(tiny64, batch["input_ids"], batch["input_lengths"], precision="float32", first_token=1)
    cut = batched_logprobs(tiny64, batch["input_ids"], batch["input_lengths"], batch["token_mask"], batch_size=3, precision="float32")
    mask = batch["token_mask"]
    assert torch.allclose(cut[mask], full[mask].to(cut.dtype), atol=1e-12)
