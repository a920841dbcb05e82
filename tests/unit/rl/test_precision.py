"""Mixed precision on a tiny random model with the real tokenizer: what ``auto`` resolves to, the bf16 trunk (the LM
head: tests/unit/rl/test_lm_head.py; generation vs training logprobs in bf16: tests/unit/rl/test_rollout.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from rl import precision
from rl.backends.hf.lm_head import lm_head
from rl.backends.hf.logprobs import hidden_states
from rl.backends.hf.model import load_model
from rl.model import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_explicit_precisions_are_kept_and_auto_follows_the_cpu_flags():
    assert precision.resolve("float32") == "float32"
    assert precision.resolve("bfloat16") == "bfloat16"
    expected = "bfloat16" if precision.cpu_has_native_bf16() else "float32"
    assert precision.resolve("auto", "cpu") == expected
    with pytest.raises(ValueError, match="'fp16' is not one of"):
        precision.resolve("fp16")


def test_bf16_runs_the_trunk_in_bf16_and_the_head_matmul_in_bf16(tiny):
    model, _ = tiny
    seen = {}

    def record(module, inputs, output):
        seen["trunk"] = output.dtype

    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(record)
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    try:
        with torch.no_grad():
            hidden = hidden_states(model, ids, torch.ones_like(ids), precision="bfloat16")
    finally:
        hook.remove()
    assert seen == {"trunk": torch.bfloat16}
    assert hidden.shape == (1, 5, model.config.hidden_size)
    assert lm_head(model, "bfloat16").compute_dtype == torch.bfloat16
    assert lm_head(model, "float32").compute_dtype == torch.float32
    with torch.no_grad():  # outside the block the model is float32 again
        assert model(input_ids=ids).logits.dtype == torch.float32


def test_auto_leaves_a_float64_model_in_float64(tiny):
    model = copy.deepcopy(tiny[0]).double()
    with torch.no_grad(), precision.autocast(model, "auto"):
        assert model(input_ids=torch.tensor([[1, 5, 9]])).logits.dtype == torch.float64
