"""Mixed precision on a tiny random model with the real tokenizer: what ``auto`` resolves to, and the float32 LM
head under bf16 autocast (generation vs training logprobs in bf16: tests/unit/rl/test_rollout.py)."""

from __future__ import annotations

import pytest
import torch

from rl import precision


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
