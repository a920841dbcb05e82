"""The LM head of `rl.backends.hf.lm_head`: exact where it claims to be, gradients equal to autograd's, bf16 close to
float32."""

from __future__ import annotations

import pytest
import torch

from rl.backends.hf.lm_head import EXACT_TOP_K, LMHead, lm_head
from rl.backends.hf.model import load_model


def _reference(hidden, weight, targets, temperature):
    """log_softmax(hidden @ W.T / T)[target] by plain autograd."""
    return (hidden @ weight.T / temperature).log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_float64_head_matches_autograd_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=g)
    upstream = torch.randn(7, generator=g, dtype=torch.float64)
    head = LMHead(weight=weight, compute_dtype=torch.float64)
    ours = head.token_logprobs(hidden, targets, temperature)
    ref = _reference(hidden, weight, targets, temperature)
    assert torch.allclose(ours, ref, atol=1e-12)
    gh, gw = torch.autograd.grad((ours * upstream).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    assert torch.allclose(gh, rh, atol=1e-12) and torch.allclose(gw, rw, atol=1e-12)


def test_bf16_head_corrects_the_logits_that_decide_the_logprob():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 96, generator=g) * 2
    weight = torch.randn(4000, 96, generator=g)  # logits of magnitude ~20-60, where bf16 output rounding bites
    targets = torch.randint(0, 4000, (64,), generator=g)
    exact = hidden @ weight.T  # [T, V] float32
    head = LMHead(weight=weight, compute_dtype=torch.bfloat16)
    logits = head.logits(hidden)
    top = exact.topk(EXACT_TOP_K // 2, -1).indices  # the k largest are recomputed (half of k: clear of bf16 near-ties)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=0)  # the top-k are float32-exact
    assert torch.allclose(
        head.target_logits(hidden, targets), exact.gather(1, targets[:, None]).squeeze(1), rtol=1e-5, atol=1e-5
    )
    ref = _reference(hidden, weight, targets, 1.0)
    plain = (hidden.bfloat16() @ weight.bfloat16().T).float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    ours = head.token_logprobs(hidden, targets)
    err, plain_err = (ours - ref).abs().mean().item(), (plain - ref).abs().mean().item()
    assert err < plain_err / 5, (err, plain_err)


def test_bf16_head_gradients_are_close_to_float32():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(32, 64, generator=g, requires_grad=True)
    weight = (torch.randn(1000, 64, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 1000, (32,), generator=g)
    ours = LMHead(weight=weight, compute_dtype=torch.bfloat16).token_logprobs(hidden, targets, 0.7)
    ref = _reference(hidden, weight, targets, 0.7)
    gh, gw = torch.autograd.grad(ours.sum(), (hidden, weight))
    rh, rw = torch.autograd.grad(ref.sum(), (hidden, weight))
    assert gh.dtype == gw.dtype == torch.float32
    assert ((gh - rh).norm() / rh.norm()).item() < 1e-2
    assert ((gw - rw).norm() / rw.norm()).item() < 1e-2


def test_a_head_that_is_not_a_bias_free_linear_map_is_refused(tiny_model_dir):
    model = load_model(tiny_model_dir)
    assert lm_head(model, "float32").weight is model.get_output_embeddings().weight
    head = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features, bias=True))
    with pytest.raises(ValueError, match="not a bias-free linear map"):
        lm_head(model, "float32")


def test_an_enclosing_autocast_block_does_not_change_the_exact_logits():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, 64, generator=g)
    weight = torch.randn(500, 64, generator=g)
    targets = torch.randint(0, 500, (16,), generator=g)
    head = LMHead(weight=weight, compute_dtype=torch.bfloat16)
    plain = head.token_logprobs(hidden, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # train_on_batch and generation run the head inside one
        inside = head.token_logprobs(hidden, targets)
    assert inside.dtype == torch.float32
    assert torch.equal(inside, plain)
