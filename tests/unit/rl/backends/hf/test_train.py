"""Training-step invariants on a tiny random model with the real tokenizer."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import rl.backends.engine as engine
from rl.backends.hf.logprobs import batched_logprobs, forward_logprobs
from rl.backends.hf.model import load_model
from rl.backends.hf.train import make_optimizer, train_on_batch
from rl.config import config_from_dict
from rl.loss import kl_penalty


@pytest.fixture(scope="module")
def tiny64(tiny_model_dir):
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


@pytest.mark.parametrize(
    ("loss_type", "level"),
    [
        ("dapo", "token"),
        ("grpo", "token"),
        ("dr_grpo", "token"),
        ("cispo", "token"),
        ("grpo", "sequence"),
        ("grpo", "sequence_token"),
    ],
)
def test_micro_batches_1x8_and_8x1_give_the_same_update(tiny64, loss_type, level):
    results = []
    for mbs in (8, 1):
        model = copy.deepcopy(tiny64)
        cfg = _cfg(mbs)
        cfg.loss.loss_type, cfg.loss.importance_sampling_level = loss_type, level
        opt, sched = make_optimizer(model, cfg)
        metrics = train_on_batch(model, opt, sched, _batch(), cfg)
        results.append((model, metrics))
    (a, ma), (b, mb) = results
    # Not bit-equal even in float64: transformers' Llama rounds to float32 inside RMSNorm and the eager softmax, so
    # the 1e-16 differences of differently blocked matmuls can flip a float32 rounding (gradients then differ by
    # ~1e-8 relative; measured 2.3e-10 on the grad norm, 6e-7 on a parameter after one lr-1e-3 AdamW step). A
    # mis-scaled micro-batch sum is off by a factor (e.g. 8) in the grad norm and by ~lr in the parameters.
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-9, abs=1e-10)  # CISPO's loss holds log pi itself (~ -7 here)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-8)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max().item() < 1e-5, name
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), tiny64.parameters()))


def test_extra_padding_changes_nothing(tiny64):
    batch = _batch()
    lp = forward_logprobs(
        tiny64, batch["input_ids"], batch["input_lengths"], precision="float32", token_mask=batch["token_mask"]
    )
    wide = torch.cat([batch["input_ids"], torch.full((8, 5), 7)], 1)
    wide_mask = torch.cat([batch["token_mask"], torch.ones(8, 5, dtype=torch.bool)], 1)  # padding is never wanted
    lp_wide = forward_logprobs(tiny64, wide, batch["input_lengths"], precision="float32", token_mask=wide_mask)
    assert torch.allclose(lp_wide[:, :12], lp, atol=1e-12)
    assert (lp_wide[:, 12:] == 0).all()


def test_logprobs_are_computed_exactly_on_the_wanted_tokens(tiny64):
    batch = _batch()
    ids, lengths, mask = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    full = forward_logprobs(tiny64, ids, lengths, precision="float32")
    with torch.no_grad():  # the model's own forward and log_softmax
        logits = tiny64(input_ids=ids, attention_mask=(torch.arange(12)[None] < lengths[:, None]).long()).logits
    expected = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [M, S-1]
    valid = (torch.arange(12)[None] < lengths[:, None])[:, 1:]
    assert torch.allclose(full[:, 1:][valid], expected[valid], atol=1e-10)
    assert (full[:, 0] == 0).all() and (full[:, 1:][~valid] == 0).all()
    cut = batched_logprobs(tiny64, ids, lengths, mask, batch_size=3, precision="float32")
    assert torch.allclose(cut[mask], full[mask].to(cut.dtype), atol=1e-12)
    assert (cut[~mask] == 0).all()


def test_shared_prompts_are_encoded_once_with_the_same_values_and_gradients(tiny64):
    g = torch.Generator().manual_seed(5)
    rows, masks = [], []
    for prompt_len in (5, 3, 7):  # three groups of 3 completions, prompts of different lengths
        prompt = torch.randint(3, 1000, (prompt_len,), generator=g).tolist()
        for _ in range(3):
            response = torch.randint(3, 1000, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            rows.append(prompt + response)
            masks.append([False] * prompt_len + [True] * len(response))
    width = max(map(len, rows))
    ids = torch.tensor([r + [2] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [False] * (width - len(m)) for m in masks])
    lengths = torch.tensor([len(r) for r in rows])
    weights = torch.randn(ids.shape, generator=g, dtype=torch.float64)

    calls = []
    hook = tiny64.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[:2]))
    try:
        ours = forward_logprobs(tiny64, ids, lengths, precision="float32", token_mask=mask)
    finally:
        hook.remove()
    assert calls[0] == (3, 6)  # 3 distinct prefixes (prompt minus its last token), left-padded to 6
    assert calls[1][0] == 9  # then every row's suffix
    ours_grads = torch.autograd.grad((ours * weights).sum(), list(tiny64.parameters()))

    logits = tiny64(input_ids=ids, attention_mask=(torch.arange(width)[None] < lengths[:, None]).long()).logits
    plain = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [M, S-1]
    plain = torch.cat([torch.zeros(9, 1, dtype=plain.dtype), plain], 1) * mask
    plain_grads = torch.autograd.grad((plain * weights).sum(), list(tiny64.parameters()))
    assert torch.allclose(ours, plain, atol=1e-10)
    for a, b in zip(ours_grads, plain_grads, strict=True):
        # HF's eager attention takes its softmax in float32 even in a float64 model: the prefix's gradient (summed
        # over the group before that softmax's backward, instead of after) differs at float32 rounding only
        assert ((a - b).norm() / b.norm()).item() < 1e-6


def test_the_update_follows_the_plain_forward_gradient_of_the_grpo_loss(tiny64):
    """train_on_batch's gradient (shared-prompt forward, packed LM head, row-wise embedding gradients into the tied
    input/output embedding) equals the GRPO loss differentiated through the model's own full forward."""

    class Capture(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.0})

        def step(self, closure=None):
            self.grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]

    batch, cfg = _batch(seed=3), _cfg(4)
    batch["reference_policy_logprobs"] = torch.full_like(batch["reference_policy_logprobs"], -10.0)  # KL unclamped
    model = copy.deepcopy(tiny64)
    opt = Capture(list(model.parameters()))
    metrics = train_on_batch(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), batch, cfg)

    ids, lengths, tm = batch["input_ids"], batch["input_lengths"], batch["token_mask"]
    logits = tiny64(input_ids=ids, attention_mask=(torch.arange(12)[None] < lengths[:, None]).long()).logits
    lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [M, S-1]
    per_token = -batch["advantages"][:, 1:] * torch.exp(lp - lp.detach()) + 0.1 * kl_penalty(
        lp, batch["reference_policy_logprobs"][:, 1:]
    )
    mask = tm[:, 1:].double()
    loss = (per_token * mask).sum() / mask.sum()
    plain = torch.autograd.grad(loss, list(tiny64.parameters()))
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-9)
    assert tiny64.get_input_embeddings().weight is tiny64.get_output_embeddings().weight  # the tied case is covered
    for (name, _), a, b in zip(tiny64.named_parameters(), opt.grads, plain, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 1e-6, name  # float32 attention softmax, as in the test above


def test_the_update_accumulates_indexed_gradients_reproducibly(tiny64, monkeypatch):
    """Identical runs of the default job at 2 threads ended ~1 ulp apart: on CPU with >1 thread the backward of
    ``x[idx]`` with repeated indices (``index_put_(accumulate=True)``: the shared-prompt KV select of
    ``forward_logprobs``, ``weight[targets]`` in the LM head) adds with unordered atomics once it spans 32,768
    elements. The update runs with torch's deterministic algorithms (that kernel then runs serially) on the CPU
    unless ``optim.deterministic`` is false, and leaves the setting as it found it."""

    seen = []
    real = engine.micro_batch_loss

    def probe(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "micro_batch_loss", probe)
    cfg = _cfg(4)
    for switch, expected in ((None, True), (False, False), (True, True)):
        seen.clear()
        run = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, deterministic=switch))
        model = copy.deepcopy(tiny64)
        opt, sched = make_optimizer(model, run)
        train_on_batch(model, opt, sched, _batch(), run)
        assert seen == [expected, expected], switch
        assert torch.are_deterministic_algorithms_enabled() is False
    assert engine.resolve_deterministic(cfg, "cuda") is False  # CUDA's default (docs/gpu.md)

    # the kernel itself, at the size of SmolLM2's LM head: 20 of 20 repeats differed without the setting here
    torch.set_num_threads(2)  # the conftest pins 1; the race needs two
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(49152, 576, generator=gen, requires_grad=True)
        targets = torch.randint(3, 60, (1000,), generator=gen)  # repeated, as digits and EOS are
        grad = torch.randn(1000, 576, generator=gen)
        digests = set()
        with engine.update_settings(cfg, "cpu"):
            for _ in range(10):
                weight.grad = None
                weight[targets].backward(grad)
                digests.add(hash(weight.grad.numpy().tobytes()))
    finally:
        torch.set_num_threads(1)
    assert len(digests) == 1
