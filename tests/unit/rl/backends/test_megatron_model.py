"""The megatron back-end's model plumbing on CPU, with megatron-core's real ``GPTModel`` (it builds on CPU; its forward
needs CUDA, see ``tests/gpu/test_megatron.py``): an HF checkpoint goes into the model and comes back out as an HF folder
that ``from_pretrained`` loads with the same tensors, the trainer state of model-parallel shards round-trips through a
checkpoint, and unsupported architectures are refused with the fix.

The model is built in a spawned process: megatron-core's process groups are process-wide.
"""

from __future__ import annotations

import pytest
import torch

from rl import checkpoint
from rl.backends.megatron.convert import LlamaLayout
from rl.backends.megatron.model import (
    HFFolder,
    build_gpt_model,
    check_model,
    gather_hf_state_dict,
    head_matmul,
    init_model_parallel,
    load_hf_state_dict,
    rope_settings,
)
from rl.config import MegatronConfig
from tests.megatron_cpu import megatron_on_cpu

pytest.importorskip("megatron.core")


def _tiny_llama(path, *, tied: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _round_trip(rank: int, model_dir: str, out: str) -> None:
    """In a fresh process: HF folder -> GPTModel (CPU) -> gathered HF state dict -> HFFolder saved as a checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    del rank
    torch.set_num_threads(1)
    mcfg = MegatronConfig(
        make_vocab_size_divisible_by=64
    )  # 100 ids padded to 128: the padding is dropped on the way out
    init_model_parallel(mcfg, seed=0)  # no process group yet: starts a one-rank one
    init_model_parallel(mcfg, seed=0)  # again: nothing to do
    hf_config = AutoConfig.from_pretrained(model_dir)
    layout = LlamaLayout.from_hf_config(hf_config)
    model = build_gpt_model(layout, hf_config, mcfg, device="cpu")
    assert model.embedding.word_embeddings.weight.shape == (128, 64)
    assert float(model.rotary_pos_emb.inv_freq[1]) == pytest.approx(
        50000.0 ** (-2 / 16)
    )  # rope_theta reached the model
    load_hf_state_dict(model, AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), layout, mcfg)
    # the core attention is torch's SDPA, with the local spec's unfused attention's values (4 heads, 2 key-value groups)
    attention = model.decoder.layers[0].self_attention.core_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(7, 3, heads, 16, generator=gen, dtype=torch.float64) for heads in (4, 2, 2)
    )  # [s, b, heads, head_dim]
    parent = type(attention).__mro__[1]
    with megatron_on_cpu():  # the parent's score buffer is placed on CUDA otherwise
        sdpa_diff = (attention(q, k, v, None) - parent.forward(attention, q, k, v, None)).abs().max().item()
    gathered = gather_hf_state_dict(model, layout, mcfg)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    state = checkpoint.TrainerState(step=3, mlflow_run_id="r", extra={})
    shards = checkpoint.ShardedOptimizerState({"megatron-tp0-pp0": opt.state_dict()})
    checkpoint.save(
        f"{out}/ckpt", model=HFFolder(hf_config, gathered), tokenizer=_NoTokenizer(), optimizer=shards, state=state
    )
    again = torch.optim.AdamW(model.parameters())
    checkpoint.load_trainer_state(f"{out}/ckpt", again, None, shard="megatron-tp0-pp0")
    saved, loaded = opt.state_dict()["state"], again.state_dict()["state"]
    same = saved.keys() == loaded.keys() and all(
        saved[i].keys() == loaded[i].keys() and all(torch.equal(saved[i][k], loaded[i][k]) for k in saved[i])
        for i in saved
    )
    torch.save(
        {
            "gathered": gathered,
            "optimizer_state_equal": same,
            "attention": type(attention).__name__,
            "sdpa_diff": sdpa_diff,
        },
        f"{out}/result.pt",
    )


class _NoTokenizer:
    def save_pretrained(self, folder) -> None:
        del folder


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_an_hf_checkpoint_goes_through_gptmodel_and_back_to_an_identical_hf_folder(tmp_path, tied):
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    model_dir = _tiny_llama(tmp_path / "hf", tied=tied)
    mp.spawn(_round_trip, args=(model_dir, str(tmp_path)), nprocs=1, join=True)
    result = torch.load(tmp_path / "result.pt")
    original = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").state_dict()
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    assert ("lm_head.weight" in result["gathered"]) is not tied  # the keys save_pretrained writes
    assert result["optimizer_state_equal"]
    assert result["attention"] == "SDPAttention" and result["sdpa_diff"] < 1e-12


def test_the_trainer_state_of_one_back_end_is_refused_by_the_other(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_tiny_llama(tmp_path / "hf", tied=True))
    opt = torch.optim.AdamW(model.parameters())
    state = checkpoint.TrainerState(step=1, mlflow_run_id="r", extra={})
    checkpoint.save(str(tmp_path / "plain"), model=model, tokenizer=_NoTokenizer(), optimizer=opt, state=state)
    checkpoint.save(
        str(tmp_path / "sharded"),
        model=model,
        tokenizer=_NoTokenizer(),
        optimizer=checkpoint.ShardedOptimizerState({"megatron-tp0-pp0": opt.state_dict()}),
        state=state,
    )
    with pytest.raises(
        RuntimeError,
        match=(
            r"holds one unsplit optimizer \(the transformers back-end\), but this policy needs shard 'megatron-tp0-pp0'"
        ),
    ):
        checkpoint.load_trainer_state(str(tmp_path / "plain"), opt, None, shard="megatron-tp0-pp0")
    with pytest.raises(
        RuntimeError, match=r"holds the shards \['megatron-tp0-pp0'\], but this policy needs one unsplit optimizer"
    ):
        checkpoint.load_trainer_state(str(tmp_path / "sharded"), opt, None)
    with pytest.raises(
        RuntimeError,
        match=r"needs shard 'megatron-tp1-pp0' .*resume with the policy.backend and policy.megatron_cfg parallel sizes",
    ):
        checkpoint.load_trainer_state(str(tmp_path / "sharded"), opt, None, shard="megatron-tp1-pp0")


@pytest.mark.parametrize(
    ("change", "mcfg", "match"),
    [
        (
            {"hidden_act": "gelu"},
            {},
            r"model: hidden_act 'gelu' is not supported by the megatron back-end .*use policy.backend 'transformers'",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            {},
            r"RoPE .*yarn.* is not supported .*use policy.backend 'transformers'",
        ),
        (
            {"model_type": "gpt2"},
            {},
            r"model_type 'gpt2' is not supported by the megatron back-end \(only llama, mistral, qwen2 are\)",
        ),
        (
            {},
            {"tensor_model_parallel_size": 2},
            r"tensor_model_parallel_size: 2 does not divide the model's 9 attention heads; use one of 1, 3",
        ),
        ({}, {"pipeline_model_parallel_size": 4}, r"pipeline_model_parallel_size: 4 does not divide"),
    ],
)
def test_start_run_refuses_what_the_megatron_backend_cannot_run(change, mcfg, match):
    """``check_model`` (called by ``start_run``, before any GPU task) on SmolLM2-135M's shapes: 9 heads, 3 key-value
    heads, 30 layers."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ValueError, match=match):
        check_model(config, MegatronConfig(**mcfg))
    assert (
        check_model(
            LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536),
            MegatronConfig(tensor_model_parallel_size=3),
        ).num_query_groups
        == 3
    )


def test_llama3_rope_scaling_maps_to_megatrons():
    from transformers import LlamaConfig

    config = LlamaConfig(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    )
    assert rope_settings(config) == {"rotary_base": 500000.0, "rope_scaling": True, "rope_scaling_factor": 32.0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_megatron_head_matmul_is_a_linear_layer_in_the_compute_dtype_with_float32_logits(dtype):
    """``head_matmul`` (the LM head on the wanted positions): float32 logits of the operands rounded to the compute
    dtype, and the two backward matmuls of a linear layer, against float64 autograd on the same rounded operands."""

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=gen, requires_grad=True)
    w = torch.randn(40, 16, generator=gen, requires_grad=True)
    out = head_matmul(x, w, dtype)
    assert out.dtype == torch.float32 and out.shape == (5, 40)
    xr, wr = (t.detach().to(dtype).double().requires_grad_() for t in (x, w))
    ref = xr @ wr.T
    assert (out.double() - ref).abs().max().item() < (
        0.1 if dtype == torch.bfloat16 else 1e-5
    )  # bf16 product rounded once
    grad = torch.randn(5, 40, generator=gen)
    out.backward(grad)
    ref.backward(grad.double())
    tol = 0.2 if dtype == torch.bfloat16 else 1e-5
    assert x.grad.dtype == w.grad.dtype == torch.float32
    assert (x.grad.double() - xr.grad).abs().max().item() < tol and (w.grad.double() - wr.grad).abs().max().item() < tol
