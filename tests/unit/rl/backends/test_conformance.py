"""The back-end contract, run against every installed back-end of each role (a new back-end proves the same
contract by being added to the registry). Tiny random Llama with the real tokenizer, float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane
from dataplane.codec import nested_from_values, pad_nested
from rl.backends import registry
from rl.backends.dataplane_policy import DataPlanePolicy
from rl.backends.interfaces import Generated, PolicyVersion
from rl.checkpoint import TrainerState
from rl.config import config_from_dict
from rl.lengths import model_max_len
from rl.model import load_tokenizer
from rl.rollout import STEP_SCHEMA


def _installed(table: dict, role: str) -> list:
    """Every back-end of ``role``: skipped when not installed; those that need CUDA are marked ``gpu``."""
    return [
        pytest.param(
            name,
            marks=[pytest.mark.skipif(bool(registry.missing_packages(role, name)), reason=f"{name} is not installed")]
            + ([pytest.mark.gpu] if spec.needs_cuda else []),
        )
        for name, spec in table.items()
    ]


LORA = {"rank": 4, "alpha": 8.0}
"""``policy.lora`` of the ``transformers+lora`` policy: the contract holds with a peft adapter too."""


def _cfg(tmp: Path | None = None, lora: dict | None = None, **generation):
    return config_from_dict(
        {
            "policy": {"lora": lora},
            "model": {"precision": "float32"},
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4},
            # the contract's reproducibility, asked for: vLLM seeds its requests on CUDA only when told to
            "generation": {
                "max_new_tokens": 6,
                "temperature": 0.7,
                "vllm_cfg": {"seed_per_request": True},
                **generation,
            },
            "optim": {"lr": 1e-2, "logprob_batch_size": 5, "train_micro_batch_size": 4},
            "dataplane": {"root": str(tmp or "unused")},
        }
    )


PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 30], [1, 4093, 198, 25, 1624], [1, 4093, 198, 55, 1624, 32, 2]]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module", params=_installed(registry.GENERATION_BACKENDS, "generation"))
def generator(request, tiny_model_dir, tok):
    gen = registry.load("generation", request.param)(_cfg(), tokenizer=tok, model_path=tiny_model_dir)
    gen.refit(PolicyVersion(step=0, path=tiny_model_dir))
    yield gen
    assert gen.shutdown() is True


def _policy_cfg(name: str, tmp: Path):
    return _cfg(tmp, lora=LORA if name.endswith("+lora") else None)


@pytest.fixture(
    params=[*_installed(registry.POLICY_BACKENDS, "policy"), pytest.param("transformers+lora", id="transformers+lora")]
)
def policy(request, tiny_model_dir, tok, tmp_path):
    backend = request.param.removesuffix("+lora")
    pol = registry.load("policy", backend)(
        _policy_cfg(request.param, tmp_path), tokenizer=tok, reference_path=tiny_model_dir
    )
    pol.load_checkpoint(PolicyVersion(step=0, path=tiny_model_dir), with_optimizer=True)
    yield pol
    pol.shutdown()


def _padded(gen) -> dict[str, torch.Tensor]:
    """Generated rows as the padded batch a policy reads."""
    lengths = torch.tensor([len(x) for x in gen.input_ids])  # [N]
    width = int(lengths.max())
    ids = torch.zeros(len(lengths), width, dtype=torch.int64)  # [N, S]
    token_mask = torch.zeros(len(lengths), width, dtype=torch.bool)  # [N, S]
    logprobs = torch.zeros(len(lengths), width)  # [N, S]
    for i, (x, m, lp) in enumerate(zip(gen.input_ids, gen.token_mask, gen.generation_logprobs)):
        ids[i, : len(x)], token_mask[i, : len(x)], logprobs[i, : len(x)] = x, m, lp
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(len(lengths), dtype=torch.bool),
        "generation_logprobs": logprobs,
    }


def _mult_prob_error(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """NeMo-RL's token_mult_prob_error: mean over masked tokens of exp(|a - b|)."""
    return float(torch.exp((a - b).abs())[mask].mean())


# ------------------------------------------------------------------------------------------------ generation
def test_generate_returns_group_contiguous_rows_with_masks_and_logprobs(generator, tok):
    g = 4
    out = generator.generate(PROMPTS, group_size=g, seed=3)
    n = len(PROMPTS) * g
    assert len(out.input_ids) == len(out.token_mask) == len(out.generation_logprobs) == len(out.response_token_ids) == n
    assert out.prompt_lengths.dtype == out.response_lengths.dtype == torch.int64 and out.truncated.dtype == torch.bool
    eos = tok.eos_token_id
    for i in range(n):
        prompt = PROMPTS[i // g]
        ids, mask, lp = out.input_ids[i], out.token_mask[i], out.generation_logprobs[i]
        assert ids.dtype == torch.int64 and mask.dtype == torch.bool and lp.dtype == torch.float32
        assert ids[: len(prompt)].tolist() == prompt and ids[len(prompt) :].tolist() == out.response_token_ids[i]
        assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()
        assert (lp[: len(prompt)] == 0).all() and (lp[len(prompt) :] <= 0).all()
        r = int(out.response_lengths[i])
        assert 1 <= r <= 6 and len(ids) == len(prompt) + r
        ended = out.response_token_ids[i][-1] == eos
        assert bool(out.truncated[i]) == (not ended) and (ended or r == 6)
        assert eos not in out.response_token_ids[i][:-1]  # nothing after an eos


def test_a_prompt_past_the_models_positions_is_refused(generator, tiny_model_dir):
    limit = model_max_len(tiny_model_dir)  # 512: the tiny model's max_position_embeddings
    fits, too_long = [1] * (limit - 6), [1] * (limit - 5)  # + max_new_tokens 6
    with pytest.raises(
        ValueError,
        match=(
            rf"^config generation.max_new_tokens: 6 plus the longest prompt's {limit - 5} tokens is more than the "
            rf"{limit} tokens of the model's max_position_embeddings"
        ),
    ):
        generator.generate([PROMPTS[0], too_long], group_size=1, seed=0)
    assert max(len(ids) for ids in generator.generate([fits], group_size=1, seed=0).input_ids) <= limit


def test_the_seed_fixes_the_completions(generator):
    a = generator.generate(PROMPTS, group_size=4, seed=11)
    b = generator.generate(PROMPTS, group_size=4, seed=11)
    c = generator.generate(PROMPTS, group_size=4, seed=12)
    assert a.response_token_ids == b.response_token_ids
    assert all(torch.equal(x, y) for x, y in zip(a.generation_logprobs, b.generation_logprobs))
    assert a.response_token_ids != c.response_token_ids
    assert len({tuple(r) for r in a.response_token_ids[:4]}) > 1  # the G completions of a prompt differ


def test_generation_logprobs_are_the_policys_temperature_scaled_logprobs(generator, policy):
    out = generator.generate(PROMPTS, group_size=4, seed=5)
    batch = _padded(out)
    lp = policy.get_logprobs(batch)  # at generation.temperature = 0.7
    assert lp.shape == batch["input_ids"].shape
    assert _mult_prob_error(lp, batch["generation_logprobs"], batch["token_mask"]) == pytest.approx(1.0, abs=1e-3)


def test_greedy_follows_the_policys_argmax(generator, policy):
    out = generator.generate(PROMPTS, group_size=1, seed=0, greedy=True)
    batch = _padded(out)
    top = policy.get_topk_logits(batch, k=1).topk_indices[..., 0]  # [N, S-1], position t predicts t+1
    for i, p in enumerate(PROMPTS):
        r = int(out.response_lengths[i])
        assert batch["input_ids"][i, len(p) : len(p) + r].tolist() == top[i, len(p) - 1 : len(p) - 1 + r].tolist()


def test_refit_changes_the_weights_in_place_and_from_a_folder(generator, policy, tmp_path, tiny_model_dir):
    old = generator.generate(PROMPTS, group_size=2, seed=1)
    batch = _padded(old)
    before = policy.get_logprobs(batch)
    batch.update(
        advantages=torch.randn(batch["input_ids"].shape[0], 1).expand_as(before).contiguous(),
        reference_policy_logprobs=before,
    )
    policy.prepare_for_training()
    policy.train(batch)
    policy.finish_training()
    assert policy.weight_version == 1
    after = policy.get_logprobs(batch)
    assert _mult_prob_error(after, before, batch["token_mask"]) > 1.01  # lr 1e-2 moved the policy

    generator.refit(PolicyVersion(step=1, path="unused-when-weights-are-given"), weights=policy.named_weights())  # warm
    assert generator.weight_version == 1
    warm = generator.generate(PROMPTS, group_size=2, seed=1)
    fresh = _padded(warm)
    assert _mult_prob_error(
        policy.get_logprobs(fresh), fresh["generation_logprobs"], fresh["token_mask"]
    ) == pytest.approx(1.0, abs=1e-3)

    folder = str(tmp_path / "step_1")
    policy.save_checkpoint(folder)
    generator.refit(PolicyVersion(step=1, path=folder))  # cold: from the folder, into the live engine
    cold = generator.generate(PROMPTS, group_size=2, seed=1)
    assert cold.response_token_ids == warm.response_token_ids
    generator.refit(PolicyVersion(step=0, path=tiny_model_dir))  # back to the base weights for the other tests
    assert generator.generate(PROMPTS, group_size=2, seed=1).response_token_ids == old.response_token_ids


# ---------------------------------------------------------------------------------------------------- policy
def test_logprobs_are_zero_outside_the_token_mask_and_topk_is_the_plain_forwards(policy, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    batch = _padded(_fixed_rows())
    lp = policy.get_logprobs(batch)
    assert lp.dtype == torch.float32 and (lp[~batch["token_mask"]] == 0).all() and (lp[batch["token_mask"]] < 0).all()
    ref = policy.get_reference_policy_logprobs(batch)
    assert torch.allclose(ref, lp, atol=1e-5)  # at step 0 the policy is the reference policy

    top = policy.get_topk_logits(batch, k=3)
    n, s = batch["input_ids"].shape
    assert top.topk_logits.shape == top.topk_indices.shape == (n, s - 1, 3) and top.topk_indices.dtype == torch.int64
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=(batch["input_ids"] != -1).long()).logits[
            :, :-1
        ]  # [N, S-1, V]
    for i, length in enumerate(batch["input_lengths"].tolist()):
        want = logits[i, : length - 1].topk(3, -1)
        assert torch.allclose(top.topk_logits[i, : length - 1], want.values, atol=1e-4)
        assert torch.equal(top.topk_indices[i, : length - 1], want.indices)
        assert (top.topk_logits[i, length - 1 :] == 0).all()


def test_a_checkpoint_round_trip_resumes_training_exactly(policy, tok, tiny_model_dir, tmp_path, request):
    batch = _train_batch(policy)
    policy.prepare_for_training()
    metrics = policy.train(batch)
    policy.finish_training()
    assert {"loss", "grad_norm", "probs_ratio", "kl_penalty", "lr"} <= set(metrics)
    url = str(tmp_path / "ckpt")
    policy.save_checkpoint(url, trainer_state=TrainerState(step=1, mlflow_run_id="r", extra={}))
    cfg = _policy_cfg(request.node.callspec.params["policy"], tmp_path)
    other = type(policy)(cfg, tokenizer=tok, reference_path=tiny_model_dir)
    other.load_checkpoint(PolicyVersion(step=1, path=url), with_optimizer=True)
    assert other.has_optimizer_state(PolicyVersion(step=1, path=url))
    assert torch.equal(other.get_logprobs(batch), policy.get_logprobs(batch))
    for p in (policy, other):  # one more step each: the optimizer state came back too
        p.prepare_for_training()
        p.train(batch)
        p.finish_training()
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(policy.named_weights(), other.named_weights()))

    weights_only = str(tmp_path / "weights")
    policy.save_checkpoint(weights_only)
    with pytest.raises(RuntimeError, match="checkpoint_period: 1"):
        other.load_checkpoint(PolicyVersion(step=2, path=weights_only), with_optimizer=True)


def test_from_meta_entry_points_write_delta_columns_under_the_same_ids(policy, tmp_path):
    rows = _fixed_rows()
    lengths = torch.tensor([len(x) for x in rows.input_ids])
    dp = DataPlane(str(tmp_path / "dp"), "run")
    dp.register_partition("step_000001", fields=STEP_SCHEMA)
    meta = dp.put(
        "step_000001",
        {
            F.INPUT_IDS: nested_from_values(torch.cat(rows.input_ids), lengths),
            F.INPUT_LENGTHS: lengths,
            F.TOKEN_MASK: nested_from_values(torch.cat(rows.token_mask), lengths),
            F.SAMPLE_MASK: torch.ones(len(lengths), dtype=torch.bool),
        },
        group_size=1,
    )
    prev = DataPlanePolicy(policy, dp).get_logprobs_from_meta(meta)
    ref = DataPlanePolicy(policy, dp).get_reference_policy_logprobs_from_meta(meta)
    assert prev.sample_ids == ref.sample_ids == meta.sample_ids
    got = dp.read(prev.join(ref), [F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS], layout="jagged")
    batch = _padded(rows)
    assert torch.equal(pad_nested(got[F.PREV_LOGPROBS], 0.0), policy.get_logprobs(batch))
    assert torch.equal(pad_nested(got[F.REFERENCE_POLICY_LOGPROBS], 0.0), policy.get_reference_policy_logprobs(batch))


def test_fp8_calibration_and_shutdown_say_what_they_do(policy):
    with pytest.raises(NotImplementedError, match="no FP8 KV cache"):
        policy.calibrate_qkv_fp8_scales(_padded(_fixed_rows()))
    assert policy.shutdown() is True
    with pytest.raises(RuntimeError, match="holds no weights"):
        policy.get_logprobs(_padded(_fixed_rows()))


def _fixed_rows():
    responses = [[28, 9, 33, 2], [17, 4], [5, 6, 7]]
    return Generated.from_rows(PROMPTS, responses, [[-1.0] * len(r) for r in responses], [True, False, False])


def _train_batch(policy) -> dict[str, torch.Tensor]:
    batch = _padded(_fixed_rows())
    lp = policy.get_logprobs(batch)
    adv = torch.tensor([1.0, -0.5, -0.5])[:, None].expand_as(lp).contiguous()  # [N, S]
    return {**batch, "advantages": adv, "reference_policy_logprobs": lp, "generation_logprobs": lp}
