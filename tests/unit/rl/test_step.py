"""The GRPO step on one page (``rl/step.py``): the rollout's first put on a tiny random model with the real tokenizer,
the advantages written for a hand-made batch against values worked out by hand, and a whole step on- and
off-policy through the transformers back-ends and a data plane in a temporary folder."""

from __future__ import annotations

import math

import pytest
import torch

from dataplane import fields as F
from dataplane.client import DataPlane
from dataplane.codec import nested_from_values
from rl.advantages import advantages_for_step
from rl.backends import registry
from rl.backends.dataplane_policy import DataPlanePolicy
from rl.backends.hf.generation import HFGeneration
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.data import prompt_token_ids, train_problems
from rl.model import load_tokenizer
from rl.rollout import sample_step
from rl.step import grpo_step, rollout_to_batch, train_fields, write_advantages

B, G, T = 2, 3, 6


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _cfg(**sections):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": B, "num_generations_per_prompt": G},
            "generation": {"max_new_tokens": T},
            "model": {"precision": "float32"},
            **sections,
        }
    )


def _generator(cfg, tok, model_dir):
    gen = HFGeneration(cfg, tokenizer=tok, model_path=model_dir)
    gen.refit(PolicyVersion(step=0, path=model_dir))
    return gen


def test_rollout_to_batch_puts_and_seals_the_step_columns(tok, tiny_model_dir, tmp_path):
    cfg = _cfg()
    gen = _generator(cfg, tok, tiny_model_dir)
    dp = DataPlane(str(tmp_path / "dp"), "run-1")
    meta = rollout_to_batch(gen, tok, cfg, dataplane=dp, step=1)

    assert meta.partition_id == "step_000001" and meta.size() == B * G
    assert dp.schema("step_000001") == F.STEP_SCHEMA
    assert dp.sealed("step_000001") == meta  # a later process finds the batch as it was returned
    cols = dp.read(meta, list(F.ROLLOUT_FIELDS), layout="jagged")
    lengths, prompt_lengths = cols[F.INPUT_LENGTHS], cols[F.PROMPT_LENGTHS]  # [N] each
    assert meta.sequence_lengths == lengths.tolist()
    assert meta.extra_info["global_forward_pad_seqlen"] == max(lengths.tolist())

    # step 1's problems are training problems 0 .. B-1, each prompt G times, as the real tokenizer encodes them
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=B
    )
    prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems for _ in range(G)]  # [N][P_i]
    assert prompt_lengths.tolist() == [len(p) for p in prompts]
    response_lengths = lengths - prompt_lengths  # [N]
    assert all(1 <= r <= T for r in response_lengths.tolist())
    for i, (ids, mask, gen_lp) in enumerate(
        zip(cols[F.INPUT_IDS].unbind(), cols[F.TOKEN_MASK].unbind(), cols[F.GENERATION_LOGPROBS].unbind())
    ):
        p = len(prompts[i])
        assert ids[:p].tolist() == prompts[i]  # [L_i]: the prompt, then the response
        assert mask.tolist() == [False] * p + [True] * (len(ids) - p)  # only response tokens count
        assert torch.all(gen_lp[:p] == 0) and torch.all(gen_lp[p:] < 0)  # log pi of each sampled token
    assert cols[F.PROMPT_INDEX].tolist() == [0, 0, 0, 1, 1, 1]
    assert cols[F.GENERATION_INDEX].tolist() == [0, 1, 2, 0, 1, 2]
    assert cols[F.WEIGHT_VERSION].tolist() == [0] * (B * G)
    assert cols[F.SAMPLE_MASK].tolist() == [True] * (B * G)  # overlong filtering is off by default
    assert cols[F.PROMPT_TEXT] == [p.question for p in problems for _ in range(G)]

    info = meta.extra_info  # step 1 from version 0: age 1 - 1 - 0 = 0
    assert info["rollout/weight_version"] == 0.0 and info["rollout/avg_trajectory_age"] == 0.0
    assert info["rollout/generated_tokens"] == float(response_lengths.sum())
    assert info["rollout/reward"] == pytest.approx(float(cols[F.REWARDS].mean()))

    # the same completions as the rollout itself draws for step 1 (sampling is seeded from the step)
    groups, _, _ = sample_step(gen, tok, cfg, step=1)
    assert [x.tolist() for x in groups.input_ids] == [x.tolist() for x in cols[F.INPUT_IDS].unbind()]


def test_write_advantages_writes_each_samples_advantage_on_its_tokens(tmp_path):
    cfg = config_from_dict({"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 4}})
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])  # [N] = [B * G], B = 2, G = 4
    lengths = torch.tensor([3, 4, 5, 3, 2, 6, 4, 3])  # [N]
    prompt_lengths = torch.tensor([2, 2, 2, 2, 1, 1, 1, 1])  # [N]
    dp = DataPlane(str(tmp_path / "dp"), "run-1")
    dp.register_partition("step_000001", fields=F.STEP_SCHEMA)
    meta = dp.put(
        "step_000001",
        {
            F.INPUT_IDS: nested_from_values(torch.arange(int(lengths.sum())), lengths),  # [N, L_i]
            F.INPUT_LENGTHS: lengths,
            F.PROMPT_LENGTHS: prompt_lengths,
            F.REWARDS: rewards,
            F.SAMPLE_MASK: torch.ones(8, dtype=torch.bool),
        },
        group_size=4,
    )

    out, read, written = write_advantages(cfg, dp, meta)

    # leave-one-out baseline b_i and Bessel std s_i of the others in the group; A_i = (r_i - b_i) / (s_i + 1e-6)
    # where s_i > 0, else r_i - b_i:
    #   group [1, 0, 0, 0]: sample 0 sees [0, 0, 0]: b = 0, s = 0, A = 1; samples 1-3 see [1, 0, 0]: b = 1/3,
    #     s = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3), A = -(1/3) / sqrt(1/3) = -sqrt(1/3) = -0.57735
    #   group [1, 1, 0, 1]: samples 0, 1, 3 see [1, 0, 1]: b = 2/3, s = sqrt(1/3), A = +sqrt(1/3); sample 2 sees
    #     [1, 1, 1]: b = 1, s = 0, A = -1
    r3 = math.sqrt(1 / 3)
    a = (1 / 3) / (r3 + 1e-6)  # |r_i - b_i| / (s_i + eps) = 0.57735
    expected = [1.0, -a, -a, -a, a, a, -1.0, a]
    assert written.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    assert written.baseline.tolist() == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 2 / 3, 2 / 3, 1, 2 / 3])
    assert written.std.tolist() == pytest.approx([0, r3, r3, r3, r3, r3, 0, r3])
    # exactly what the estimator gives (rewards shaped and estimated as the run's config asks)
    direct = advantages_for_step(rewards, torch.ones(8, dtype=torch.bool), lengths - prompt_lengths, cfg)
    assert torch.equal(written.advantages, direct.advantages) and torch.equal(read, rewards)

    # written per token: every one of sample i's L_i tokens holds A_i
    per_token = dp.read(out, [F.ADVANTAGES], layout="jagged")[F.ADVANTAGES].unbind()
    assert [len(x) for x in per_token] == lengths.tolist()
    for x, adv in zip(per_token, written.advantages.tolist()):
        assert x.dtype == torch.float32 and x.tolist() == [pytest.approx(adv)] * len(x)
    assert F.ADVANTAGES in out.fields and out.sample_ids == meta.sample_ids
    assert [t["baseline"] for t in out.tags] == pytest.approx(written.baseline.tolist())
    assert [t["std"] for t in out.tags] == pytest.approx(written.std.tolist())


@pytest.mark.parametrize("rows_per_update", [None, 3])
def test_grpo_step_runs_every_stage_and_updates_the_policy(tok, tiny_model_dir, tmp_path, rows_per_update):
    cfg = _cfg(optim={"train_global_batch_size": rows_per_update, "lr": 1e-2})
    assert cfg.on_policy == (rows_per_update is None)  # 3 of 6 rows per update: two updates, pi_old computed
    gen = _generator(cfg, tok, tiny_model_dir)
    backend = registry.load("policy", "transformers")(cfg, tokenizer=tok, reference_path=tiny_model_dir)
    backend.load_checkpoint(PolicyVersion(step=0, path=tiny_model_dir), with_optimizer=True)
    backend.load_reference_policy()
    before = {k: v.detach().clone() for k, v in backend.named_weights()}
    dp = DataPlane(str(tmp_path / "dp"), "run-1")

    train_meta, metrics = grpo_step(cfg, generator=gen, tokenizer=tok, policy=DataPlanePolicy(backend, dp), step=1)

    assert list(train_fields(cfg)) == [f for f in F.DP_TRAIN_FIELDS if f != F.PREV_LOGPROBS or not cfg.on_policy]
    assert set(train_fields(cfg)) <= set(train_meta.fields)
    assert metrics["total_num_tokens"] == sum(train_meta.sequence_lengths)
    assert math.isfinite(metrics["loss"])
    if cfg.on_policy:  # one update, by the policy of step 0: the reference policy itself, so the KL to it is 0
        assert metrics["kl_penalty"] == pytest.approx(0.0, abs=1e-6)
    after = dict(backend.named_weights())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if not cfg.on_policy:  # pi_old of step 1 is the base model, which is also the reference policy
        lp = dp.read(train_meta, [F.PREV_LOGPROBS, F.REFERENCE_POLICY_LOGPROBS], layout="jagged")
        for prev, ref in zip(lp[F.PREV_LOGPROBS].unbind(), lp[F.REFERENCE_POLICY_LOGPROBS].unbind()):
            torch.testing.assert_close(prev, ref)
