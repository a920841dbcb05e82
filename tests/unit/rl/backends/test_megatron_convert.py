"""The HF <-> megatron-core weight mapping (`rl.backends.megatron.convert`): bit-identical round trips (whole, tensor-
parallel shards, pipeline stages), the layout checked by hand and against HF's own head indexing, and real
megatron-core ``GPTModel`` stages (world 1, tensor-parallel 2, pipeline-parallel 2 over gloo) that take the converted
weights with their own names and shapes, give them back, and compute HF's logits.

Tiny random models: a tied and an untied Llama and a tied Qwen2 with q/k/v biases; 100-id vocabulary padded to 128.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from rl.backends.megatron.convert import (
    LlamaLayout,
    check_parallel_layout,
    hf_to_megatron,
    megatron_to_hf,
    merge_pipeline_stages,
    merge_tensor_parallel,
    pipeline_stage_layers,
    shard_tensor_parallel,
    split_pipeline_stage,
)
from tests.megatron_cpu import megatron_on_cpu

MODELS = ("llama-tied", "llama-untied", "qwen2")
VOCAB, PADDED = 100, 128
"""The models' vocabulary and its padding (``padded_vocab_size(64, t)`` for t = 1 and 2: two ranks get 64 rows each)."""
EMBEDDING, OUTPUT_LAYER = "embedding.word_embeddings.weight", "output_layer.weight"
LAYER_WEIGHTS = [  # megatron-core's names of a decoder layer's weights (local layer spec), Qwen2 adds linear_qkv.bias
    "input_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
    "pre_mlp_layernorm.weight",
    "self_attention.linear_proj.weight",
    "self_attention.linear_qkv.weight",
]


def _hf_model(name: str):
    """(config, model) of a tiny HF model; every weight random (norms near 1, biases too) so that a swap shows."""
    import transformers

    sizes = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if name == "qwen2":
        config, cls = transformers.Qwen2Config(**sizes, tie_word_embeddings=True), transformers.Qwen2ForCausalLM
    else:
        config, cls = (
            transformers.LlamaConfig(**sizes, tie_word_embeddings=name == "llama-tied"),
            transformers.LlamaForCausalLM,
        )
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + ("norm" in key))
    return config, model


@pytest.fixture(scope="module")
def hf_models():
    return {name: _hf_model(name) for name in MODELS}


def _saved(config, model) -> dict[str, torch.Tensor]:
    """The state dict ``save_pretrained`` writes: a tied model's ``lm_head.weight`` left out."""
    return {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}


def _assert_identical(got, want) -> None:
    """Same keys, and every tensor bit-identical (values and dtype)."""
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def _megatron(hf_models, name: str) -> tuple[LlamaLayout, dict[str, torch.Tensor]]:
    config, model = hf_models[name]
    layout = LlamaLayout.from_hf_config(config)
    return layout, hf_to_megatron(model.state_dict(), layout, padded_vocab_size=PADDED)


# --- the whole model ---


@pytest.mark.parametrize("te_layernorm", [False, True])
@pytest.mark.parametrize("name", MODELS)
def test_hf_megatron_hf_is_bit_identical(hf_models, name, te_layernorm):
    config, model = hf_models[name]
    layout = LlamaLayout.from_hf_config(config)
    mc = hf_to_megatron(model.state_dict(), layout, padded_vocab_size=PADDED, te_layernorm=te_layernorm)
    layer = [n for n in LAYER_WEIGHTS if "layernorm" not in n] + (
        ["self_attention.linear_qkv.bias"] if name == "qwen2" else []
    )
    if te_layernorm:  # Transformer Engine fuses each layernorm into the next linear layer
        layer += ["self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"]
    else:
        layer += ["input_layernorm.weight", "pre_mlp_layernorm.weight"]
    top = [EMBEDDING, "decoder.final_layernorm.weight"] + ([] if config.tie_word_embeddings else [OUTPUT_LAYER])
    assert sorted(mc) == sorted(top + [f"decoder.layers.{i}.{n}" for i in range(2) for n in layer])
    assert mc[EMBEDDING].shape == (PADDED, 64) and not mc[EMBEDDING][VOCAB:].any()  # [V_pad, H], padding rows zero
    _assert_identical(megatron_to_hf(mc, layout, te_layernorm=te_layernorm), _saved(config, model))


def test_results_never_alias_their_inputs(hf_models):
    """Every function returns tensors of its own (a caller may train or free the input in place)."""
    layout, mc = _megatron(hf_models, "qwen2")
    hf = hf_models["qwen2"][1].state_dict()
    shard = shard_tensor_parallel(mc, layout, rank=1, size=2)
    stage = split_pipeline_stage(mc, layout, rank=1, size=2)
    pairs = [  # (inputs, outputs)
        (hf, hf_to_megatron(hf, layout)),
        (mc, megatron_to_hf(mc, layout)),
        (mc, shard),
        (shard, merge_tensor_parallel([shard], layout)),
        (mc, stage),
        (stage, merge_pipeline_stages([split_pipeline_stage(mc, layout, rank=0, size=2), stage], layout)),
    ]
    for inputs, outputs in pairs:
        assert not {t.untyped_storage().data_ptr() for t in outputs.values()} & {
            t.untyped_storage().data_ptr() for t in inputs.values()
        }


def test_round_trip_keeps_bfloat16(hf_models):
    config, model = hf_models["qwen2"]
    layout = LlamaLayout.from_hf_config(config)
    hf = {k: v.bfloat16() for k, v in _saved(config, model).items()}
    mc = hf_to_megatron(hf, layout, padded_vocab_size=PADDED)
    assert {v.dtype for v in mc.values()} == {torch.bfloat16}
    _assert_identical(megatron_to_hf(mc, layout), hf)


@pytest.mark.parametrize("name", ["llama-tied", "llama-untied"])
def test_megatron_to_hf_is_what_save_pretrained_writes(hf_models, name, tmp_path):
    from safetensors.torch import load_file

    config, model = hf_models[name]
    model.save_pretrained(tmp_path)
    layout, mc = _megatron(hf_models, name)
    _assert_identical(megatron_to_hf(mc, layout), load_file(tmp_path / "model.safetensors"))


def _hand_layout(vocab_size: int = 2) -> LlamaLayout:
    """One layer, hidden size 1, 4 query heads in 2 groups of head_dim 1, MLP width 2: every row is one number."""
    return LlamaLayout(
        num_layers=1,
        hidden_size=1,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=1,
        ffn_hidden_size=2,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        qkv_bias=True,
    )


def _col(*values: float) -> torch.Tensor:
    """A weight [n, 1] with the given rows."""
    return torch.tensor(values, dtype=torch.float32)[:, None]


def _hand_hf(vocab_size: int = 2) -> dict[str, torch.Tensor]:
    """q rows 0-3, k rows 10-11, v rows 20-21 (biases 100 more), gate rows 30-31, up rows 40-41; the rest 7s."""
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": torch.full((vocab_size, 1), 7.0),
        p + "self_attn.q_proj.weight": _col(0, 1, 2, 3),
        p + "self_attn.k_proj.weight": _col(10, 11),
        p + "self_attn.v_proj.weight": _col(20, 21),
        p + "self_attn.q_proj.bias": torch.tensor([100.0, 101, 102, 103]),
        p + "self_attn.k_proj.bias": torch.tensor([110.0, 111]),
        p + "self_attn.v_proj.bias": torch.tensor([120.0, 121]),
        p + "self_attn.o_proj.weight": torch.full((1, 4), 7.0),
        p + "mlp.gate_proj.weight": _col(30, 31),
        p + "mlp.up_proj.weight": _col(40, 41),
        p + "mlp.down_proj.weight": torch.full((1, 2), 7.0),
        p + "input_layernorm.weight": torch.full((1,), 7.0),
        p + "post_attention_layernorm.weight": torch.full((1,), 7.0),
        "model.norm.weight": torch.full((1,), 7.0),
    }


def test_qkv_and_fc1_by_hand():
    layout = _hand_layout()
    mc = hf_to_megatron(_hand_hf(), layout)
    qkv, fc1 = "decoder.layers.0.self_attention.linear_qkv.", "decoder.layers.0.mlp.linear_fc1.weight"
    assert mc[qkv + "weight"][:, 0].tolist() == [
        0,
        1,
        10,
        20,
        2,
        3,
        11,
        21,
    ]  # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert mc[qkv + "bias"].tolist() == [100, 101, 110, 120, 102, 103, 111, 121]
    assert mc[fc1][:, 0].tolist() == [30, 31, 40, 41]  # cat(gate, up)
    shards = [shard_tensor_parallel(mc, layout, rank=r, size=2) for r in range(2)]
    assert [s[qkv + "weight"][:, 0].tolist() for s in shards] == [
        [0, 1, 10, 20],
        [2, 3, 11, 21],
    ]  # one query group each
    assert [s[qkv + "bias"].tolist() for s in shards] == [[100, 101, 110, 120], [102, 103, 111, 121]]
    assert [s[fc1][:, 0].tolist() for s in shards] == [[30, 40], [31, 41]]  # cat(gate_r, up_r)
    _assert_identical(megatron_to_hf(merge_tensor_parallel(shards, layout), layout), _hand_hf())


def test_query_heads_sit_in_their_key_value_group(hf_models):
    """HF's head h is rows h*d..(h+1)*d of q_proj and attends with key-value head h // (nq / nkv) (``repeat_kv``);
    megatron's group g holds its query heads in order, then k_g, then v_g."""
    model = hf_models["llama-tied"][1]
    layout, mc = _megatron(hf_models, "llama-tied")
    hf, d = model.state_dict(), layout.head_dim  # 4 heads, 2 groups, d 16
    qkv = mc["decoder.layers.1.self_attention.linear_qkv.weight"].view(2, 4, d, 64)  # [nkv, nq / nkv + 2, d, H]
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    for head, group, slot in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]:
        assert torch.equal(qkv[group, slot], q[head * d : (head + 1) * d])
    for group in range(2):
        assert torch.equal(qkv[group, 2], k[group * d : (group + 1) * d]) and torch.equal(
            qkv[group, 3], v[group * d : (group + 1) * d]
        )
    layer = "decoder.layers.1."
    assert torch.equal(
        mc[layer + "mlp.linear_fc1.weight"],
        torch.cat([hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]),
    )
    assert torch.equal(mc[layer + "pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert torch.equal(mc[layer + "self_attention.linear_proj.weight"], hf["model.layers.1.self_attn.o_proj.weight"])


# --- tensor parallelism ---


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_shards_have_megatrons_shapes_and_merge_back(hf_models, name):
    layout, mc = _megatron(hf_models, name)
    shards = [shard_tensor_parallel(mc, layout, rank=r, size=2) for r in range(2)]
    # what VocabParallelEmbedding, ColumnParallelLinear ([out / t, in]) and RowParallelLinear ([out, in / t]) allocate
    layer = {
        "input_layernorm.weight": (64,),
        "self_attention.linear_qkv.weight": ((4 + 2 * 2) * 16 // 2, 64),  # (nq + 2 nkv) d / t rows
        "self_attention.linear_proj.weight": (64, 4 * 16 // 2),
        "pre_mlp_layernorm.weight": (64,),
        "mlp.linear_fc1.weight": (2 * 128 // 2, 64),
        "mlp.linear_fc2.weight": (64, 128 // 2),
    } | ({"self_attention.linear_qkv.bias": ((4 + 2 * 2) * 16 // 2,)} if layout.qkv_bias else {})
    want = {EMBEDDING: (PADDED // 2, 64), "decoder.final_layernorm.weight": (64,)} | (
        {} if layout.tie_word_embeddings else {OUTPUT_LAYER: (PADDED // 2, 64)}
    )
    want |= {f"decoder.layers.{i}.{n}": shape for i in range(2) for n, shape in layer.items()}
    for shard in shards:
        assert {k: tuple(v.shape) for k, v in shard.items()} == want
    assert torch.equal(shards[1][EMBEDDING], mc[EMBEDDING][PADDED // 2 :])  # rank 1: vocabulary rows 64-127
    _assert_identical(merge_tensor_parallel(shards, layout), mc)
    _assert_identical(merge_tensor_parallel([shard_tensor_parallel(mc, layout, rank=0, size=1)], layout), mc)


def test_merge_tensor_parallel_refuses_layernorms_that_differ(hf_models):
    layout, mc = _megatron(hf_models, "llama-tied")
    shards = [shard_tensor_parallel(mc, layout, rank=r, size=2) for r in range(2)]
    shards[1]["decoder.layers.0.input_layernorm.weight"][3] += 1
    with pytest.raises(
        ValueError,
        match=(
            r"^decoder.layers.0.input_layernorm.weight is replicated over the tensor-parallel ranks but ranks \[1\] "
            r"differ from rank 0$"
        ),
    ):
        merge_tensor_parallel(shards, layout)
    del shards[1][EMBEDDING]
    with pytest.raises(
        ValueError, match=r"^tensor-parallel rank 1 has other weights than rank 0: embedding.word_embeddings.weight$"
    ):
        merge_tensor_parallel(shards, layout)


def test_shard_tensor_parallel_refuses_an_unpadded_vocabulary():
    layout = _hand_layout(vocab_size=3)
    mc = hf_to_megatron(_hand_hf(vocab_size=3), layout)
    msg = (
        r"^embedding.word_embeddings.weight: dimension 0 of shape \(3, 1\) does not split into 2 equal parts \(pad the "
        r"vocabulary to LlamaLayout.padded_vocab_size\)$"
    )
    with pytest.raises(ValueError, match=msg):
        shard_tensor_parallel(mc, layout, rank=0, size=2)
    assert shard_tensor_parallel(
        hf_to_megatron(_hand_hf(vocab_size=3), layout, padded_vocab_size=4), layout, rank=1, size=2
    )[EMBEDDING].tolist() == [[7], [0]]


# --- pipeline parallelism ---


def test_pipeline_stage_layers():
    assert [pipeline_stage_layers(4, rank=r, size=2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert pipeline_stage_layers(4, rank=0, size=1) == range(4)
    with pytest.raises(
        ValueError,
        match=(
            r"^config policy.megatron_cfg.pipeline_model_parallel_size: 3 does not divide the model's 4 layers; use "
            r"one of 1, 2, 4$"
        ),
    ):
        pipeline_stage_layers(4, rank=0, size=3)
    with pytest.raises(ValueError, match=r"^pipeline stage 2 does not exist: there are 2 stages$"):
        pipeline_stage_layers(4, rank=2, size=2)


@pytest.mark.parametrize("name", MODELS)
def test_pipeline_stages_hold_their_layers_and_merge_back(hf_models, name):
    layout, mc = _megatron(hf_models, name)
    first, last = (split_pipeline_stage(mc, layout, rank=r, size=2) for r in range(2))
    layer = LAYER_WEIGHTS + (["self_attention.linear_qkv.bias"] if layout.qkv_bias else [])
    assert sorted(first) == sorted([EMBEDDING] + [f"decoder.layers.0.{n}" for n in layer])
    assert sorted(last) == sorted(
        ["decoder.final_layernorm.weight", OUTPUT_LAYER] + [f"decoder.layers.0.{n}" for n in layer]
    )
    for n in layer:  # the last stage's local layer 0 is global layer 1
        assert torch.equal(first[f"decoder.layers.0.{n}"], mc[f"decoder.layers.0.{n}"]) and torch.equal(
            last[f"decoder.layers.0.{n}"], mc[f"decoder.layers.1.{n}"]
        )
    assert torch.equal(
        last[OUTPUT_LAYER], mc[EMBEDDING if layout.tie_word_embeddings else OUTPUT_LAYER]
    )  # tied: megatron's shared copy
    _assert_identical(merge_pipeline_stages([first, last], layout), mc)
    whole = split_pipeline_stage(mc, layout, rank=0, size=1)
    assert (OUTPUT_LAYER in whole) == (not layout.tie_word_embeddings)  # one stage: no copy of tied embeddings
    _assert_identical(merge_pipeline_stages([whole], layout), mc)


def test_merge_pipeline_stages_refuses_a_tied_copy_that_differs(hf_models):
    layout, mc = _megatron(hf_models, "llama-tied")
    stages = [split_pipeline_stage(mc, layout, rank=r, size=2) for r in range(2)]
    stages[1][OUTPUT_LAYER][5, 5] += 1
    msg = (
        r"^the last pipeline stage's output_layer.weight \(the tied copy of the word embeddings\) differs from the "
        r"first stage's embedding.word_embeddings.weight$"
    )
    with pytest.raises(ValueError, match=msg):
        merge_pipeline_stages(stages, layout)
    stages[0]["decoder.final_layernorm.weight"] = stages[1].pop("decoder.final_layernorm.weight")
    with pytest.raises(
        ValueError, match=r"^pipeline stage 0 of 2 has decoder.final_layernorm.weight, which belongs to the last stage$"
    ):
        merge_pipeline_stages(stages, layout)


@pytest.mark.parametrize("name", MODELS)
def test_tensor_and_pipeline_parallel_together_merge_back(hf_models, name):
    """Two stages of two tensor-parallel ranks, cut and merged in the order the back-end uses."""
    layout, mc = _megatron(hf_models, name)
    parts = [
        [
            split_pipeline_stage(shard_tensor_parallel(mc, layout, rank=t, size=2), layout, rank=p, size=2)
            for t in range(2)
        ]
        for p in range(2)
    ]
    assert torch.equal(
        parts[1][1][OUTPUT_LAYER],
        parts[0][1][EMBEDDING] if layout.tie_word_embeddings else mc[OUTPUT_LAYER][PADDED // 2 :],
    )
    _assert_identical(merge_pipeline_stages([merge_tensor_parallel(stage, layout) for stage in parts], layout), mc)


# --- errors ---


def test_megatron_to_hf_names_unknown_and_missing_keys(hf_models):
    layout, mc = _megatron(hf_models, "llama-tied")
    mc["decoder.layers.0.mlp.linear_fc1._extra_state"] = None  # megatron's state_dict() has these: ignored
    mc["decoder.layers.0.mlp.router.weight"] = torch.zeros(1)
    del mc["decoder.final_layernorm.weight"]
    with pytest.raises(
        ValueError,
        match=(
            r"^megatron state dict does not fit the model layout: missing decoder.final_layernorm.weight; unknown "
            r"decoder.layers.0.mlp.router.weight$"
        ),
    ):
        megatron_to_hf(mc, layout)
    del mc["decoder.layers.0.mlp.router.weight"]
    mc["decoder.final_layernorm.weight"] = torch.ones(63)
    with pytest.raises(
        ValueError,
        match=r"^megatron state dict has wrong shapes: decoder.final_layernorm.weight \(63,\) \(expected \(64,\)\)$",
    ):
        megatron_to_hf(mc, layout)


def test_hf_to_megatron_names_unknown_and_missing_keys(hf_models):
    config, model = hf_models["llama-untied"]
    layout, hf = LlamaLayout.from_hf_config(config), model.state_dict()
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older transformers saved these: ignored
    hf["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    del hf["lm_head.weight"]
    with pytest.raises(
        ValueError,
        match=(
            r"^Hugging Face state dict does not fit the model layout: missing lm_head.weight; unknown "
            r"model.layers.0.self_attn.o_proj.bias$"
        ),
    ):
        hf_to_megatron(hf, layout)
    with pytest.raises(ValueError, match=r"^padded_vocab_size 64 is smaller than the vocabulary \(100\)$"):
        hf_to_megatron(model.state_dict(), layout, padded_vocab_size=64)
    tied = hf_models["llama-tied"][1].state_dict() | {"lm_head.weight": torch.zeros(VOCAB, 64)}
    with pytest.raises(
        ValueError, match=r"^tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight$"
    ):
        hf_to_megatron(tied, LlamaLayout.from_hf_config(hf_models["llama-tied"][0]))


def _layout(heads: int, groups: int, ffn: int, layers: int = 4) -> LlamaLayout:
    return LlamaLayout(
        num_layers=layers,
        hidden_size=8 * heads,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=8,
        ffn_hidden_size=ffn,
        vocab_size=10,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize(
    ("layout", "tp", "pp", "message"),
    [
        (
            _layout(9, 3, 48),
            2,
            1,
            "tensor_model_parallel_size: 2 does not divide the model's 9 attention heads; use one of 1, 3 (they divide "
            "its 9 attention heads, 3 key-value heads and 48 MLP channels)",
        ),
        (
            _layout(9, 3, 48),
            9,
            1,
            "tensor_model_parallel_size: 9 does not divide the model's 3 key-value heads; use one of 1, 3 (they divide "
            "its 9 attention heads, 3 key-value heads and 48 MLP channels)",
        ),
        (
            _layout(4, 4, 6),
            4,
            1,
            "tensor_model_parallel_size: 4 does not divide the model's 6 MLP channels; use one of 1, 2 (they divide "
            "its 4 attention heads, 4 key-value heads and 6 MLP channels)",
        ),
        (
            _layout(4, 2, 8, layers=6),
            2,
            4,
            "pipeline_model_parallel_size: 4 does not divide the model's 6 layers; use one of 1, 2, 3, 6",
        ),
        (_layout(4, 2, 8), 0, 1, "tensor_model_parallel_size: is 0; use 1 or more"),
    ],
)
def test_check_parallel_layout_says_what_to_use(layout, tp, pp, message):
    with pytest.raises(ValueError) as err:
        check_parallel_layout(layout, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    assert str(err.value) == f"config policy.megatron_cfg.{message}"


def test_check_parallel_layout_accepts_even_splits():
    check_parallel_layout(_layout(9, 3, 48, layers=6), tensor_model_parallel_size=3, pipeline_model_parallel_size=3)


# --- the layout of a HF config ---


def test_layout_from_hf_configs(hf_models):
    import transformers

    assert LlamaLayout.from_hf_config(hf_models["llama-untied"][0]) == LlamaLayout(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=16,
        ffn_hidden_size=128,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    qwen2 = LlamaLayout.from_hf_config(hf_models["qwen2"][0])
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings
    mistral = transformers.MistralConfig(
        vocab_size=10,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
    )
    assert LlamaLayout.from_hf_config(mistral).head_dim == 32  # its own head_dim, not hidden_size / heads (16)
    bare = types.SimpleNamespace(
        model_type="llama",
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=None,
        head_dim=None,
        intermediate_size=96,
        vocab_size=10,
        tie_word_embeddings=False,
    )
    mha = LlamaLayout.from_hf_config(bare)
    assert (mha.num_query_groups, mha.head_dim) == (4, 16)  # no key-value heads: multi-head attention


def test_layout_from_hf_config_refuses_what_it_cannot_map():
    import transformers

    tail = "is not supported by the megatron back-end"
    with pytest.raises(
        ValueError,
        match=(
            rf"^model: model_type 'gpt2' {tail} \(only llama, mistral, qwen2 are\); use policy.backend 'transformers'$"
        ),
    ):
        LlamaLayout.from_hf_config(transformers.GPT2Config())
    with pytest.raises(
        ValueError,
        match=(
            rf"^model: attention_bias=True \(biases on q_proj, k_proj, v_proj and o_proj\) {tail} \(q/k/v biases alone "
            rf"are, as in Qwen2\)"
        ),
    ):
        LlamaLayout.from_hf_config(transformers.LlamaConfig(attention_bias=True))
    with pytest.raises(ValueError, match=rf"^model: mlp_bias=True \(biases on the MLP projections\) {tail}"):
        LlamaLayout.from_hf_config(transformers.LlamaConfig(mlp_bias=True))
    with pytest.raises(ValueError, match=r"^LlamaLayout: 3 key-value heads do not divide 4 attention heads$"):
        _layout(4, 3, 8)


@pytest.mark.parametrize(
    ("vocab", "multiple", "tp", "padded"),
    [
        (100, 128, 1, 128),
        (100, 64, 2, 128),
        (100, 128, 2, 256),
        (128, 128, 1, 128),
        (49152, 128, 8, 49152),
        (151936, 128, 1, 151936),
        (151936, 128, 3, 152064),
    ],
)
def test_padded_vocab_size_is_megatrons(vocab, multiple, tp, padded):
    """Megatron-LM's ``_vocab_size_with_padding``: the next multiple of ``multiple * tp`` (SmolLM2's 49152, Qwen2.5's
    151936)."""
    layout = dataclasses.replace(_layout(4, 2, 8), vocab_size=vocab)
    assert layout.padded_vocab_size(multiple, tp) == padded


# --- real megatron-core GPTModel stages ---


def _gpt_model(layout: LlamaLayout, eps: float, tp: int, pp: int):
    """This rank's stage of megatron-core's GPTModel (local layer spec, float32, CPU initialisation, no dropout)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        use_cpu_initialization=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        layernorm_epsilon=eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    return GPTModel(
        config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=PADDED,
        max_sequence_length=64,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=layout.tie_word_embeddings,
        rotary_base=10000,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    ).eval()


def _gathered_logits(gpt, ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, S, V_pad] of a (tensor-parallel) one-stage GPTModel: each rank computes [B, S, V_pad / t]."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    s = ids.shape[1]
    future = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # [1, 1, S, S], True = masked
    with torch.no_grad():
        local = gpt(ids, torch.arange(s).expand_as(ids), future)
    parts = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _load_into_gpt_model(
    layout: LlamaLayout, hf: dict[str, torch.Tensor], eps: float, ids: torch.Tensor, tp: int, pp: int
) -> dict:
    """Build this rank's GPTModel stage, load its converted share of ``hf``; report the model's own weights (before and
    after), the load result, and (one stage) its logits."""
    from megatron.core import parallel_state

    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    mc = shard_tensor_parallel(hf_to_megatron(hf, layout, padded_vocab_size=PADDED), layout, rank=tp_rank, size=tp)
    mine = split_pipeline_stage(mc, layout, rank=pp_rank, size=pp)
    with megatron_on_cpu():  # tests/megatron_cpu.py: megatron-core's CUDA placements on the CPU
        gpt = _gpt_model(layout, eps, tp, pp)
        fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in gpt.state_dict().items()}
        loaded = gpt.load_state_dict(mine, strict=False)
        logits = _gathered_logits(gpt, ids) if pp == 1 else None
    return {
        "ranks": (pp_rank, tp_rank),
        "mine": {k: tuple(v.shape) for k, v in mine.items()},
        "fresh": fresh,
        "missing": loaded.missing_keys,
        "unexpected": loaded.unexpected_keys,
        "state": {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in gpt.state_dict().items()},
        "logits": logits,
    }


def _megatron_rank(rank: int, world: int, tp: int, pp: int, store: str, folder: str) -> None:
    """One gloo rank of ``world``: megatron-core's process groups, then every model through
    :func:`_load_into_gpt_model`."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        inputs = torch.load(f"{folder}/inputs.pt", weights_only=False)
        report = {name: _load_into_gpt_model(*model, inputs["ids"], tp, pp) for name, model in inputs["models"].items()}
        torch.save(report, f"{folder}/rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _ids() -> torch.Tensor:
    """Token ids [2, 9] the logits are compared on."""
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", params=[(1, 1), (2, 1), (1, 2)], ids=["world1", "tp2", "pp2"])
def megatron_ranks(request, hf_models, tmp_path_factory):
    """``(tp, pp, reports)``: every rank's report (rank order) of every model from real GPTModel stages."""
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    tp, pp = request.param
    folder = tmp_path_factory.mktemp(f"megatron-tp{tp}-pp{pp}")
    models = {
        name: (LlamaLayout.from_hf_config(c), m.state_dict(), c.rms_norm_eps) for name, (c, m) in hf_models.items()
    }
    torch.save({"models": models, "ids": _ids()}, folder / "inputs.pt")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        mp.spawn(_megatron_rank, args=(tp * pp, tp, pp, str(folder / "store"), str(folder)), nprocs=tp * pp, join=True)
    return tp, pp, [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(tp * pp)]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_converted_weights_fit_the_gpt_model(megatron_ranks, name):
    """Each rank's converted share has exactly the names and shapes of its GPTModel stage (``_extra_state`` aside)."""
    tp, pp, reports = megatron_ranks
    for report in (r[name] for r in reports):
        own = {k: tuple(v.shape) for k, v in report["fresh"].items() if not k.endswith("_extra_state")}
        assert report["mine"] == own, report["ranks"]
        assert report["missing"] == [] and report["unexpected"] == []
        assert all(v is None for k, v in report["fresh"].items() if k.endswith("_extra_state"))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_gpt_model_weights_give_back_the_hf_weights(megatron_ranks, hf_models, name):
    """The stages' ``state_dict()`` (with ``_extra_state``), merged over tensor-parallel ranks and then stages, is the
    HF state dict bit for bit."""
    tp, pp, reports = megatron_ranks
    layout = LlamaLayout.from_hf_config(hf_models[name][0])
    by_rank = {r[name]["ranks"]: r[name]["state"] for r in reports}  # (pp rank, tp rank) -> state dict
    stages = [merge_tensor_parallel([by_rank[p, t] for t in range(tp)], layout) for p in range(pp)]
    _assert_identical(megatron_to_hf(merge_pipeline_stages(stages, layout), layout), _saved(*hf_models[name]))
    if tp == pp == 1:  # the model's own state_dict(), _extra_state entries and all
        _assert_identical(megatron_to_hf(by_rank[0, 0], layout), _saved(*hf_models[name]))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_gpt_model_computes_the_hf_logits(megatron_ranks, hf_models, name):
    """The forward pass confirms the mapping: megatron's logits on the loaded weights are HF's (float32 round-off)."""
    tp, pp, reports = megatron_ranks
    if pp > 1:
        pytest.skip(
            "a pipeline runs its forward through megatron's schedule: tests/unit/rl/backends/test_megatron_policy.py "
            "checks it"
        )
    with torch.no_grad():
        want = hf_models[name][1](_ids()).logits  # [B, S, V]
    for report in (r[name] for r in reports):
        assert report["logits"].shape == (2, 9, PADDED)
        torch.testing.assert_close(report["logits"][..., :VOCAB], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-tied", "qwen2"])
def test_last_pipeline_stage_starts_with_a_copy_of_the_tied_embeddings(megatron_ranks, name):
    """megatron-core's own convention, which `split_pipeline_stage` follows: with tied embeddings the last stage's
    ``output_layer.weight`` is the first stage's word embeddings (all-reduced at construction)."""
    tp, pp, reports = megatron_ranks
    if pp == 1:
        assert all(
            OUTPUT_LAYER not in r[name]["fresh"] for r in reports
        )  # one stage: the embedding is the output layer
        return
    first, last = reports[0][name]["fresh"], reports[-1][name]["fresh"]
    assert EMBEDDING not in last and OUTPUT_LAYER not in first
    assert torch.equal(last[OUTPUT_LAYER], first[EMBEDDING])
