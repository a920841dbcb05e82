"""`rl.lora`: the adapter peft injects, its merged weights, its saved form, and its errors. Tiny random Llama with the
real tokenizer, float32."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rl import lora
from rl.backends.hf.model import load_model


def _settings(rank=4, alpha=8.0, targets="all-linear", dropout=0.0):
    return SimpleNamespace(rank=rank, alpha=alpha, dropout=dropout, peft_target_modules=targets)


def _wrapped(folder, seed=0, **kw):
    return lora.wrap(load_model(folder, device="cpu"), _settings(**kw), seed=seed)


def _trained_adapter(model, seed=1):
    """Non-zero B matrices (a trained adapter's state), drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


IDS = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 30]])


def test_a_new_adapter_is_the_base_model_exactly_and_only_it_trains(tiny_model_dir):
    base = load_model(tiny_model_dir, device="cpu")
    with torch.no_grad():
        want = base(input_ids=IDS).logits
    rng = torch.get_rng_state()
    model = _wrapped(tiny_model_dir)
    assert torch.equal(torch.get_rng_state(), rng)  # the adapter's draw leaves the global RNG alone
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, want)  # B = 0: W + (alpha/r) B A = W
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 2 layers x 7 projections (q, k, v, o, gate, up, down), an A and a B each; the LM head is not adapted
    assert len(trainable) == 2 * 7 * 2
    other = _wrapped(tiny_model_dir)  # the same seed: the same adapter in every process of a run
    for (n, a), (m, b) in zip(model.named_parameters(), other.named_parameters()):
        assert n == m and torch.equal(a, b)
    third = _wrapped(tiny_model_dir, seed=1)
    a_of = dict(third.named_parameters())
    assert not torch.equal(a_of[next(iter(sorted(trainable)))], dict(model.named_parameters())[sorted(trainable)[0]])


def test_merged_weights_are_the_base_names_with_w_plus_scaled_ba(tiny_model_dir):
    model = _wrapped(tiny_model_dir, rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    _trained_adapter(model)
    base_names = set(load_model(tiny_model_dir, device="cpu").state_dict())
    merged = dict(lora.merged_weights(model))
    assert set(merged) == base_names
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    w, a, b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = w + (8.0 / 4) * (b @ a)  # Hu et al. 2021 eq. 3 with peft's scaling alpha / r
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], want, atol=1e-7)
    assert torch.equal(
        merged["model.layers.0.self_attn.k_proj.weight"],
        model.get_base_model().state_dict()["model.layers.0.self_attn.k_proj.weight"],
    )  # not a target: the base tensor itself
    # the merged model computes what the adapted one does
    plain = load_model(tiny_model_dir, device="cpu")
    plain.load_state_dict(merged)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=1e-5)
    with torch.no_grad(), lora.adapter_disabled(model):  # the reference policy: the base weights
        assert torch.equal(model(input_ids=IDS).logits, load_model(tiny_model_dir, device="cpu")(input_ids=IDS).logits)


def test_a_saved_adapter_loads_back_exactly_and_merges_like_the_live_one(tiny_model_dir, tmp_path):
    model = _wrapped(tiny_model_dir)
    _trained_adapter(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert lora.is_adapter_folder(tmp_path / "ckpt") and not lora.is_adapter_folder(tiny_model_dir)
    saved = (tmp_path / "ckpt" / lora.ADAPTER_WEIGHTS).stat().st_size
    full = sum(p.numel() * 4 for p in load_model(tiny_model_dir, device="cpu").parameters())
    assert saved < full / 5  # the adapter, not the model

    back = lora.load_policy(load_model(tiny_model_dir, device="cpu"), tmp_path / "ckpt", _settings(), seed=7)
    for (n, a), (m, b) in zip(model.named_parameters(), back.named_parameters()):
        assert n == m and torch.equal(a, b)  # the saved A, not the seed-7 draw
    live = dict(lora.merged_weights(model))
    cold = lora.merged_model(tiny_model_dir, tmp_path / "ckpt", device="cpu").state_dict()
    assert all(torch.equal(live[k], cold[k]) for k in live)  # warm and cold refits give the same weights


def test_a_saved_adapter_of_another_config_is_refused(tiny_model_dir, tmp_path):
    model = _wrapped(tiny_model_dir, rank=4)
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"has r=4 but policy.lora asks for 8: resume with the config"):
        lora.load_policy(load_model(tiny_model_dir, device="cpu"), tmp_path / "ckpt", _settings(rank=8), seed=0)
    config = json.loads((tmp_path / "ckpt" / lora.ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0


def test_target_modules_the_model_lacks_name_its_linear_layers(tiny_model_dir):
    with pytest.raises(ValueError) as err:
        _wrapped(tiny_model_dir, targets=["query_key_value"])
    text = str(err.value)
    assert "policy.lora: peft cannot put a LoRA adapter on LlamaForCausalLM" in text
    assert "'q_proj'" in text and "'down_proj'" in text and "use 'all-linear'" in text


def test_a_run_start_refuses_targets_the_model_lacks_without_loading_weights(tiny_model_dir, monkeypatch):
    import safetensors.torch

    def no_weights(*a, **k):
        raise AssertionError("check_targets read the weights")

    monkeypatch.setattr(safetensors.torch, "load_file", no_weights)
    lora.check_targets(tiny_model_dir, _settings(targets=["q_proj", "v_proj"]))  # fine: nothing raised
    with pytest.raises(ValueError, match=r"target_modules \['c_attn'\].*its linear layers are named \['down_proj'"):
        lora.check_targets(tiny_model_dir, _settings(targets=["c_attn"]))


def test_the_lora_policy_is_its_own_reference_with_one_model_in_memory(tiny_model_dir, tmp_path):
    from rl.backends.hf.policy import HFPolicy
    from rl.backends.interfaces import PolicyVersion
    from rl.config import config_from_dict
    from rl.model import load_tokenizer

    cfg = config_from_dict(
        {"model": {"precision": "float32"}, "policy": {"lora": {"rank": 4}}, "dataplane": {"root": str(tmp_path)}}
    )
    pol = HFPolicy(cfg, tokenizer=load_tokenizer(tiny_model_dir), reference_path=tiny_model_dir)
    lengths = torch.tensor([IDS.shape[1]])
    batch = {"input_ids": IDS, "input_lengths": lengths, "token_mask": torch.ones_like(IDS, dtype=torch.bool)}
    before = pol.get_reference_policy_logprobs(batch)  # a reference pod's first call: the base model alone
    base = pol._reference
    pol.load_checkpoint(PolicyVersion(step=0, path=tiny_model_dir), with_optimizer=True)
    assert pol._reference is None and pol.model is base  # the loaded base became the policy's: one model
    _trained_adapter(pol._peft)
    assert torch.equal(pol.get_reference_policy_logprobs(batch), before)  # the adapter disabled: the base
    assert not torch.equal(pol.get_logprobs(batch), before)  # the adapter on: the policy
    assert pol._reference is None
    trained = [p for p in pol.model.parameters() if p.requires_grad]
    assert {id(p) for g in pol._optimizer.param_groups for p in g["params"]} == {id(p) for p in trained}
    assert sum(p.numel() for p in trained) < sum(p.numel() for p in pol.model.parameters()) / 10


def test_an_unfinished_merge_leaves_the_callers_grad_mode_alone(tiny_model_dir):
    model = _wrapped(tiny_model_dir)
    weights = lora.merged_weights(model)
    for _ in range(3):  # a consumer that stops early (zip, an error) keeps its grad mode
        next(weights)
    assert torch.is_grad_enabled()
    del weights
