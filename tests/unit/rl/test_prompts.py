"""Rendering prompts (chat template, messages, raw text), the prompt-length check that skips tokenizing short
prompts, and preparing a user's dataset with too-long prompts refused or skipped."""

from __future__ import annotations

import json
import random

import pytest

from rl.config import config_from_dict
from rl.data import Problem, prompt_token_ids
from rl.model import load_tokenizer
from rl.prompts import fits_checker, prepare_prompts, prompt_messages, render_prompt

RF = {"reward_functions": [{"function": "tests.rewards:earnable"}]}


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _p(text: str, messages=None) -> Problem:
    return Problem(question=text, answer="", entry={}, messages=messages)


def test_a_text_prompt_renders_as_before_and_raw_or_as_messages_when_asked(tok):
    q = "What is 3 + 4?"
    assert render_prompt(tok, _p(q), system_prompt="Be brief.", apply_chat_template=True) == prompt_token_ids(
        tok, q, "Be brief."
    )
    assert render_prompt(tok, _p(q), system_prompt="Be brief.", apply_chat_template=False) == tok(q)["input_ids"]
    messages = ({"role": "user", "content": q},)
    want = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert render_prompt(tok, _p(q, messages), system_prompt="ignored", apply_chat_template=True) == list(want)
    assert prompt_messages(_p(q), system_prompt="", apply_chat_template=True) == [{"role": "user", "content": q}]


def test_the_length_check_agrees_with_tokenizing_every_prompt(tok):
    """Prompts of every length around the limit, ASCII, accented and emoji text, and messages: the check that skips
    tokenizing prompts whose bytes fit says exactly what rendering each one says."""
    cfg = config_from_dict({})
    limit = 120
    fits = fits_checker(tok, cfg, limit)
    rng = random.Random(0)
    words = ["7", "plus", "été", "🙂", "x" * 9, "\n", "  "]
    problems = [_p(" ".join(rng.choice(words) for _ in range(k))) for k in range(0, 160, 3)]
    problems += [_p("q", ({"role": "system", "content": "s" * k}, {"role": "user", "content": "u"})) for k in (10, 400)]
    exact = [
        len(render_prompt(tok, p, system_prompt=cfg.data.system_prompt, apply_chat_template=True)) <= limit
        for p in problems
    ]
    assert fits(problems) == exact
    assert any(exact) and not all(exact)  # both sides of the limit were checked


def _dataset(tmp_path, rows):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("policy", ["refuse", "skip"])
def test_too_long_prompts_are_refused_naming_the_row_or_skipped_and_counted(tmp_path, tok, policy):
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    rows[7]["prompt"] = "very long " * 200
    cfg = config_from_dict(
        {
            "data": {"train": _dataset(tmp_path, rows), "on_overlong_prompt": policy, "answer_key": "answer"},
            "env": RF,
            "dataplane": {"root": str(tmp_path / "dp")},
        }
    )
    prepare = lambda: prepare_prompts(  # noqa: E731
        cfg, root=cfg.dataplane.root, run_id="r1", tokenizer=tok, max_prompt_tokens=100
    )
    if policy == "refuse":
        with pytest.raises(ValueError, match=r"prompts\.jsonl") as err:
            prepare()
        assert "prompt" in str(err.value) and ("row 7" in str(err.value) or "line 8" in str(err.value))
        assert "on_overlong_prompt" in str(err.value)
        return
    train, validation = prepare()
    skipped = train.counts["skipped_overlong"] + validation.counts["skipped_overlong"]
    assert skipped == 1
    assert train.num_rows + validation.num_rows == 19
