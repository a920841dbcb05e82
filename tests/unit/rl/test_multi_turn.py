"""The multi-turn rollout loop (`rl/multi_turn.py`) with the real transformers generation back-end on a tiny random
model and scripted environments: the token layout of an episode (prompt, assistant and environment turns, which
tokens train), rewards summed over turns, the three ends of an episode, stop strings, the faults an environment can
cause, and that the loss and its gradient never see environment tokens."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch

from dataplane import fields as F
from rl.backends.engine import micro_batch_loss
from rl.backends.hf.generation import HFGeneration
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.data import Problem
from rl.environments import EnvironmentInterface, EnvironmentReturn
from rl.model import load_tokenizer
from rl.multi_turn import ChatTurns, EnvironmentFault, cut_at_stop_string, multi_turn_groups
from rl.rollout import episode_metrics


class Echo(EnvironmentInterface):
    """Replies "go on (turn k)" until turn ``until``, rewarding 0.25 per turn; counts turns in the metadata."""

    reward_weights = {"turn": 1.0}

    def __init__(self, until: int = 3, *, role: str = "user", fault: str = "") -> None:
        self.until, self.role, self.fault = until, role, fault

    def step(self, message_log_batch, metadata):  # noqa: ANN001, ANN201
        if self.fault == "raise":
            raise ValueError("the game server is down")
        if self.fault == "hang":
            time.sleep(5)
        n = len(message_log_batch)
        k = [m.get("k", 0) + 1 for m in metadata]
        obs = [{"role": self.role, "content": f"go on (turn {x})"} for x in k]
        if self.fault == "malformed":
            obs[0] = {"role": "user", "content": 7}
        done = torch.tensor([x >= self.until for x in k])
        count = n - 1 if self.fault == "short" else n
        return EnvironmentReturn(
            observations=obs[:count],
            metadata=[{**m, "k": x} for m, x in zip(metadata, k, strict=True)][:count],
            next_stop_strings=[None] * count,
            rewards={"turn": torch.full((count,), 0.25)},
            terminateds=done[:count],
            answers=[None] * count,
        )


class Parity(Echo):
    """:class:`Echo` rewarding a turn 1 when the reply has an even number of characters, else 0: a tiny random model's
    groups mix rewards, so its updates move the policy (the async and data-parallel tests)."""

    def step(self, message_log_batch, metadata):  # noqa: ANN001, ANN201
        ret = super().step(message_log_batch, metadata)
        even = [float(len(log[-1]["content"]) % 2 == 0) for log in message_log_batch]
        return dataclasses.replace(ret, rewards={"turn": torch.tensor(even)})


@pytest.fixture(scope="module")
def gen(tiny_model_dir):
    cfg = config_from_dict({"generation": {"max_new_tokens": 6}})
    tok = load_tokenizer(tiny_model_dir)
    g = HFGeneration(cfg, tokenizer=tok, model_path=tiny_model_dir)
    g.refit(PolicyVersion(step=0, path=tiny_model_dir))
    return g, tok


def _cfg(**grpo):
    return config_from_dict(
        {
            "grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "max_rollout_turns": 4, **grpo},
            "generation": {"max_new_tokens": 6},
            "env": {
                "tasks": {"chain_sum": {"environment": {"class": "tests.unit.rl.test_multi_turn:Echo"}}},
                "timeout_s": 1,
            },
        }
    )


PROBLEMS = [
    Problem(question="Say a number.", answer="", entry={}, task="chain_sum", row_id="train:0"),
    Problem(question="Say two numbers.", answer="", entry={}, task="chain_sum", row_id="train:1"),
]


def test_an_episode_is_prompt_then_assistant_and_environment_turns_and_only_the_models_tokens_train(gen):
    g, tok = gen
    cfg = _cfg()
    env = Echo(until=3)
    out = multi_turn_groups(g, tok, PROBLEMS, cfg, group_size=2, greedy=True, seed=1, envs={"chain_sum": env})
    turns = ChatTurns(tok, apply_chat_template=True)
    assert out.turns == [3, 3, 3, 3] and out.truncated == [False] * 4 and out.truncated_by == [""] * 4
    assert out.rewards == [0.75] * 4 and all(c == {"turn": 0.75} for c in out.reward_components)
    for i in range(4):
        ids, mask, lp = out.input_ids[i].tolist(), out.token_mask[i], out.generation_logprobs[i]
        p = out.prompt_lengths[i]
        assert not mask[:p].any() and (lp[:p] == 0).all()
        assert (
            int(mask.sum()) == out.response_lengths[i]
            and len(ids) == p + out.response_lengths[i] + (out.environment_tokens[i])
        )
        assert (lp[mask] < 0).all() and (lp[~mask] == 0).all()  # logprobs on the model's tokens only
        # the environment's two replies, as the chat template renders a turn, between the model's turns
        runs, start = [], p
        for t in range(p, len(ids) + 1):
            if t == len(ids) or (t > start and bool(mask[t]) != bool(mask[start])):
                runs.append((bool(mask[start]), ids[start:t]))
                start = t
        assert [m for m, _ in runs] == [True, False, True, False, True]
        # a turn at the cap: all 6 new tokens and no EOS (Echo sets no stop strings)
        at_cap = sum(len(t) == 6 and t[-1] != tok.eos_token_id for m, t in runs if m)
        assert out.turns_at_max_new_tokens[i] == at_cap
        for k, (_, obs_ids) in zip((1, 2), runs[1::2], strict=True):
            ended = runs[(k - 1) * 2][1][-1] == tok.eos_token_id
            want = turns.observation_ids({"role": "user", "content": f"go on (turn {k})"}, ended_with_eos=ended)
            assert obs_ids == want
    assert out.env_metrics["episode/env_seconds"] >= 0
    assert 0 < sum(out.turns_at_max_new_tokens) <= 12  # the tiny random model rarely ends a turn in 6 tokens
    metrics = episode_metrics(out)
    assert metrics["turns_at_max_new_tokens_fraction"] == sum(out.turns_at_max_new_tokens) / 12
    text = turns.observation_text({"role": "user", "content": "hi"}, ended_with_eos=True)
    assert text == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # SmolLM2's ChatML


def test_an_episode_ends_by_turns_or_by_length_marked_truncated(gen):
    g, tok = gen
    out = multi_turn_groups(g, tok, PROBLEMS, _cfg(max_rollout_turns=2), group_size=2, greedy=True, seed=1,
                            envs={"chain_sum": Echo(until=9)})  # fmt: skip
    assert out.turns == [2] * 4 and out.truncated == [True] * 4 and out.truncated_by == ["turns"] * 4
    assert out.rewards == [0.5] * 4
    longest = max(len(x) for x in out.input_ids)
    cap = longest - 1  # too short for the last turn of the longest episode
    short = multi_turn_groups(g, tok, PROBLEMS, _cfg(max_total_sequence_length=cap), group_size=2, greedy=True,
                              seed=1, envs={"chain_sum": Echo(until=9)})  # fmt: skip
    assert all(len(x) <= cap for x in short.input_ids)
    assert "length" in short.truncated_by and all(t for t, by in zip(short.truncated, short.truncated_by) if by)


def test_the_same_seed_gives_the_same_episodes(gen):
    g, tok = gen
    runs = [
        multi_turn_groups(
            g, tok, PROBLEMS, _cfg(), group_size=2, greedy=False, seed=7, envs={"chain_sum": Echo(until=3)}
        )
        for _ in range(2)
    ]
    assert [x.tolist() for x in runs[0].input_ids] == [x.tolist() for x in runs[1].input_ids]


def test_a_completion_is_cut_after_the_first_stop_string(gen):
    _, tok = gen
    ids = tok("I move <move>up</move> and then down", add_special_tokens=False)["input_ids"]
    keep, text = cut_at_stop_string(tok, ids, ["</move>", "then"])
    assert text.endswith("</move>") and "then" not in text
    assert tok.decode(ids[:keep]) == text and keep < len(ids)
    assert cut_at_stop_string(tok, ids, None) == (len(ids), tok.decode(ids))
    assert cut_at_stop_string(tok, ids, ["never"])[0] == len(ids)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise", r"environment Echo of task 'chain_sum' raised on a batch of 4 samples \(first row 'train:0'\): "
                  "ValueError: the game server is down"),
        ("hang", r"did not return within env.timeout_s=1.0 s"),
        ("short", r"returned \{.*'observations': 3.*\} results for 4 samples"),
        ("malformed", r"malformed observation for sample 0 \(row 'train:0'\)"),
    ],
)  # fmt: skip
def test_an_environment_that_breaks_the_interface_fails_naming_itself_and_the_sample(gen, fault, message):
    g, tok = gen
    with pytest.raises(EnvironmentFault, match=message):
        multi_turn_groups(g, tok, PROBLEMS, _cfg(), group_size=2, greedy=True, seed=1,
                          envs={"chain_sum": Echo(until=3, fault=fault)})  # fmt: skip


def test_the_loss_and_its_gradient_do_not_depend_on_environment_tokens():
    """Observation positions (token_mask 0) may carry any logprob, reference logprob, generation logprob or
    advantage: the loss is the same and their logprobs get zero gradient."""
    cfg = config_from_dict({"loss": {"reference_policy_kl_penalty": 0.1}})
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0, 1, 0]], dtype=torch.bool)  # [2, 8]
    base = {
        F.REFERENCE_POLICY_LOGPROBS: -torch.rand(2, 8, generator=g),
        F.GENERATION_LOGPROBS: -torch.rand(2, 8, generator=g),
        F.ADVANTAGES: torch.randn(2, 1, generator=g).expand(2, 8).clone(),
        F.TOKEN_MASK: mask,
        F.SAMPLE_MASK: torch.tensor([True, True]),
    }
    logprobs = -torch.rand(2, 8, generator=g)
    losses, grads = [], []
    for noise in (0.0, 3.0):
        fields = {k: v.clone() for k, v in base.items()}
        lp = logprobs.clone()
        for name in (F.REFERENCE_POLICY_LOGPROBS, F.GENERATION_LOGPROBS, F.ADVANTAGES):
            fields[name][~mask] -= noise
        lp[~mask] -= noise
        lp.requires_grad_(True)
        out = micro_batch_loss(lp, fields, cfg, global_toks=float(mask[:, 1:].sum()), global_seqs=2.0)
        out.loss.backward()
        losses.append(out.loss.item())
        grads.append(lp.grad.clone())
    assert math.isclose(losses[0], losses[1], rel_tol=0, abs_tol=1e-7)
    assert torch.equal(grads[0], grads[1])
    assert (grads[0][~mask] == 0).all() and (grads[0][mask] != 0).any()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"grpo": {"max_rollout_turns": 0}}, "config grpo.max_rollout_turns: is 0; use 1"),
        ({"grpo": {"max_rollout_turns": 3, "max_total_sequence_length": 32}, "generation": {"max_new_tokens": 32}},
         "config grpo.max_total_sequence_length: 32 leaves no room for a prompt and a turn"),
        ({"grpo": {"max_rollout_turns": 3, "reward_shaping": {"enabled": True}}},
         "config grpo.reward_shaping.enabled: is true with grpo.max_rollout_turns 3"),
        ({"grpo": {"max_rollout_turns": 3, "max_total_sequence_length": 4096}, "generation": {"backend": "vllm"}},
         "longer than generation.vllm_cfg.max_model_len=2048"),
    ],
)  # fmt: skip
def test_multi_turn_settings_that_cannot_work_are_refused_at_config_time(extra, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        config_from_dict(extra)


@pytest.mark.parametrize("example", ["sliding_puzzle", "tool_arithmetic"])
def test_the_examples_configs_load_as_multi_turn_runs(example):
    from pathlib import Path

    from rl.config import load_config
    from rl.scoring import reward_names

    root = Path(__file__).resolve().parents[3]
    cfg = load_config(str(root / "examples" / example / "config.yaml"))
    assert cfg.grpo.max_rollout_turns > 1
    assert reward_names(cfg) == {"sliding_puzzle": {"puzzle": {"solved": 1.0}}, "tool_arithmetic": {
        "arith": {"correct": 1.0}}}[example]  # fmt: skip


class _NoReuse:
    """The back-end without its KV reuse: every turn prefills the whole conversation."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner

    def generate(self, prompts, *, group_size, seed, greedy=False, stop_strings=None):  # noqa: ANN001, ANN201
        return self.inner.generate(prompts, group_size=group_size, seed=seed, greedy=greedy, stop_strings=stop_strings)


def test_a_turn_reuses_the_kv_of_the_turns_before_it_and_gets_the_same_episodes(gen, monkeypatch):
    """With the transformers back-end's kept KV (``keep_kv`` / ``continues``) turn k prefills only what came after
    turn k - 1, and the greedy episodes equal those of a back-end that prefills every turn whole (float32)."""
    import transformers.models.llama.modeling_llama as llama

    g, tok = gen
    cfg = _cfg()
    fed: list[int] = []
    real = llama.LlamaModel.forward

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # prefills (decode steps feed one token)
            fed.append(ids.shape[1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "forward", counted)
    outs, prefilled = [], []
    for generator in (_NoReuse(g), g):
        fed.clear()
        outs.append(
            multi_turn_groups(
                generator, tok, PROBLEMS, cfg, group_size=2, greedy=True, seed=1, envs={"chain_sum": Echo(until=3)}
            )  # fmt: skip
        )
        prefilled.append(list(fed))
    plain, reused = outs
    assert [x.tolist() for x in reused.input_ids] == [x.tolist() for x in plain.input_ids]
    for a, b in zip(reused.generation_logprobs, plain.generation_logprobs, strict=True):
        assert torch.allclose(a, b, atol=1e-4)
    shortest = min(plain.prompt_lengths)
    (_, *again), (_, *continued) = prefilled  # turn 1 prefills the prompts; then turns 2 and 3
    assert len(again) == len(continued) == 2 and all(w > shortest for w in again), prefilled  # the whole conversation
    assert all(w < shortest for w in continued), prefilled  # only the environment's reply
