"""Mixed precision: what ``auto`` resolves to, the float32 LM head under bf16 autocast, and generation vs
training logprobs agreeing in bf16 on a tiny random model with the real tokenizer."""

from __future__ import annotations

import pytest
import torch

from rl import precision
from rl.config import config_from_dict


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from rl.model import load_model, load_tokenizer

    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_explicit_precisions_are_kept_and_auto_follows_the_cpu_flags():
    assert precision.resolve("float32") == "float32"
    assert precision.resolve("bfloat16") == "bfloat16"
    expected = "bfloat16" if precision.cpu_has_native_bf16() else "float32"
    assert precision.resolve("auto", "cpu") == expected
    with pytest.raises(ValueError, match="'fp16' is not one of"):
        precision.resolve("fp16")


def test_bf16_runs_the_trunk_in_bf16_and_the_lm_head_in_float32(tiny):
    model, _ = tiny
    head = model.get_output_embeddings()
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = output.dtype

        return hook

    hooks = [model.model.layers[0].mlp.down_proj.register_forward_hook(record("trunk")), head.register_forward_hook(record("head"))]
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    try:
        with torch.no_grad(), precision.autocast(model, "bfloat16"):
            logits = model(input_ids=ids).logits
    finally:
        for h in hooks:
            h.remove()
    assert seen == {"trunk": torch.bfloat16, "head": torch.float32}
    assert logits.dtype == torch.float32
    assert "forward" not in vars(head)  # the float32 override is gone after the block
    with torch.no_grad():
        assert model(input_ids=ids).logits.dtype == torch.float32


def test_auto_leaves_a_float64_model_in_float64(tiny):
    import copy

    model = copy.deepcopy(tiny[0]).double()
    with torch.no_grad(), precision.autocast(model, "auto"):
        assert model(input_ids=torch.tensor([[1, 5, 9]])).logits.dtype == torch.float64


def test_bf16_training_forward_agrees_with_bf16_generation_logprobs(tiny):
    from dataplane.codec import pad_nested
    from rl.logprobs import batched_logprobs
    from rl.rollout import sample_step, to_columns

    model, tok = tiny
    cfg = config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 3},
            "generation": {"max_new_tokens": 6},
            "model": {"precision": "bfloat16"},
        }
    )
    torch.manual_seed(0)
    groups, mask, _ = sample_step(model, tok, cfg, step=1)
    cols = to_columns(groups, mask, group_size=3, weight_version=0)
    ids = pad_nested(cols["input_ids"], tok.pad_token_id)  # [N, S]
    token_mask = pad_nested(cols["token_mask"], False)  # [N, S]
    gen = pad_nested(cols["generation_logprobs"], 0.0)  # [N, S]
    bf16 = batched_logprobs(model, ids, cols["input_lengths"], token_mask, batch_size=4, precision="bfloat16")
    fp32 = batched_logprobs(model, ids, cols["input_lengths"], token_mask, batch_size=4, precision="float32")
    # token_mult_prob_error (NeMo-RL): mean over response tokens of exp(|logprob - generation logprob|)
    mult = torch.exp((bf16 - gen).abs())[token_mask].mean().item()
    assert mult == pytest.approx(1.0, abs=1e-2)
    assert not torch.equal(bf16, fp32)  # the bf16 path really ran in bf16
    assert torch.exp((bf16 - fp32).abs())[token_mask].mean().item() == pytest.approx(1.0, abs=2e-2)
