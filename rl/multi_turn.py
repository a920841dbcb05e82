"""Multi-turn rollouts: the model answers, the environment replies, and the model goes on until the environment ends
the episode; NeMo-RL's ``run_multi_turn_rollout`` (``nemo_rl/experience/rollouts.py``).

Each turn (:func:`multi_turn_groups`):

1. every active sample generates one assistant turn from its whole conversation so far (through the generation
   back-end's ``generate``, so the transformers loop and vLLM alike), stopping at eos or, where the environment gave
   them, at its ``next_stop_strings`` (the back-end stops the row there: vLLM's ``stop``, the transformers loop's
   `rl.backends.hf.stop_strings`; the completion is then cut right after the first stop string it contains);
2. the environment of each sample's task gets the message logs and metadata of its active samples
   (``EnvironmentInterface.step``); its rewards are summed over the turns (named ones per name);
3. a sample whose environment says ``terminated`` is done; the others get the environment's observation rendered as
   a chat turn (:class:`ChatTurns`) appended to their tokens, with ``token_mask`` 0 and no generation logprob, so
   that the loss never sees them;
4. a sample stops, marked truncated, after ``grpo.max_rollout_turns`` turns (``by turns``), or when its next turn
   could pass ``grpo.max_total_sequence_length`` (``by length``; an observation that does not fit is cut to fit).

An environment that raises, takes longer than ``env.timeout_s`` for a step, returns the wrong number of results or a
malformed observation fails the rollout with :class:`EnvironmentFault`, naming it, its task and the sample.

One sample is one row of jagged per-token columns (``input_ids``, ``token_mask``, ``generation_logprobs``): prompt,
then assistant and environment turns in order; advantages use the episode's total reward. A turn does not re-encode
the turns before it: the transformers back-end keeps each row's KV cache from one call to the next
(``keep_kv`` / ``continues``, `rl.backends.hf.kv_reuse`), vLLM's prefix cache does the same on its side.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rl.groups import Groups
from rl.prompts import prompt_messages, render_prompt
from rl.seeding import step_seed

if TYPE_CHECKING:
    from rl.backends.interfaces import GenerationBackend
    from rl.config import GRPOConfig
    from rl.data import Problem
    from rl.environments import EnvironmentInterface


class EnvironmentFault(RuntimeError):
    """An environment broke the interface during a multi-turn rollout (it raised, or returned the wrong number of
    results or a malformed observation); the message names the environment, the task and the sample."""


_PROBE = ("GRPOFLOW-USER-7f3a", "GRPOFLOW-ASSISTANT-7f3a")


class ChatTurns:
    """How an environment's message continues a conversation in tokens, as the model's chat template renders it.

    ``end_of_turn`` is what the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``); an
    observation's tokens are the rest of that end of turn (without the eos the model produced, if it did), then the
    message as the template renders a new turn, with the assistant's next turn opened. Without a chat template
    (``data.apply_chat_template: false``) an observation is its content on a line of its own.

    Raises:
        ValueError: the chat template does not render a conversation as the concatenation of its turns (then an
            observation has no tokens of its own).
    """

    def __init__(self, tokenizer: Any, *, apply_chat_template: bool) -> None:
        self.tokenizer, self.templated = tokenizer, apply_chat_template
        self.eos = tokenizer.eos_token or ""
        self.end_of_turn = "\n"
        self._before: str | None = None
        if apply_chat_template:
            user, assistant = _PROBE
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], tokenize=False
            )
            self.end_of_turn = text[text.rindex(assistant) + len(assistant) :]

    def observation_text(self, message: dict[str, str], *, ended_with_eos: bool) -> str:
        """The text that follows an assistant turn: the end of that turn, ``message``'s turn, the next turn opened."""
        end = self.end_of_turn
        if ended_with_eos and self.eos and end.startswith(self.eos):
            end = end[len(self.eos) :]
        if not self.templated:
            return f"{end}{message['content']}\n"
        base = [{"role": "system", "content": ""}]
        if self._before is None:  # the same for every observation: rendered once
            self._before = self.tokenizer.apply_chat_template(base, tokenize=False)
        before = self._before
        after = self.tokenizer.apply_chat_template([*base, message], tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            msg = (
                "the tokenizer's chat template does not render a conversation as its turns one after another, so an "
                "environment's message cannot be appended as tokens; use a model whose template does (ChatML, Llama)"
            )
            raise ValueError(msg)
        return end + after[len(before) :]

    def observation_ids(self, message: dict[str, str], *, ended_with_eos: bool) -> list[int]:
        """:meth:`observation_text` as token ids (special tokens in it parsed as such)."""
        text = self.observation_text(message, ended_with_eos=ended_with_eos)
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


@dataclass
class Episode:
    """One sample's conversation during a multi-turn rollout."""

    problem: Problem
    message_log: list[dict]
    metadata: dict[str, Any]
    input_ids: list[int]
    prompt_length: int
    token_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float = 0.0
    components: dict[str, float] = field(default_factory=dict)
    turns: int = 0
    assistant_tokens: int = 0
    environment_tokens: int = 0
    turns_at_max_new_tokens: int = 0
    """Its turns that ended at ``generation.max_new_tokens``, with neither EOS nor a stop string."""
    stop_strings: list[str] | None = None
    kv_row: int | None = None
    """Its row in the last generate call (whose KV the back-end may have kept: ``continues``)."""
    done: bool = False
    truncated: bool = False
    truncated_by: str = ""

    def __post_init__(self) -> None:
        self.token_mask = [False] * len(self.input_ids)
        self.logprobs = [0.0] * len(self.input_ids)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Append model tokens (with their logprobs) or, with ``logprobs`` None, environment tokens."""
        self.input_ids += ids
        self.token_mask += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def stop(self, by: str) -> None:
        self.done, self.truncated, self.truncated_by = True, True, by


def cut_at_stop_string(tokenizer: Any, ids: list[int], stop_strings: list[str] | None) -> tuple[int, str]:
    """The number of leading tokens of ``ids`` to keep, and their text: all of them, or up to and including the
    token that completes the first stop string found in the decoded text (vLLM's ``stop`` with
    ``include_stop_str_in_output``)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    hits = [text.find(s) + len(s) for s in stop_strings or () if s and s in text]
    if not hits:
        return len(ids), text
    end = min(hits)
    for k in range(1, len(ids) + 1):  # the shortest prefix whose text reaches the end of the stop string
        prefix = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if len(prefix) >= end:
            return k, prefix
    return len(ids), text


def multi_turn_groups(
    generator: GenerationBackend,
    tokenizer: Any,
    problems: list[Problem],
    cfg: GRPOConfig,
    *,
    group_size: int,
    greedy: bool,
    seed: int,
    envs: dict[str, EnvironmentInterface],
) -> Groups:
    """Run ``group_size`` episodes per problem, up to ``grpo.max_rollout_turns`` turns each (the module's loop).

    Turn 1 samples with ``seed`` (as a single-turn rollout does), turn t > 1 with ``step_seed(seed, t, "turn")``:
    the same seed gives the same episodes.

    Returns:
        :class:`rl.groups.Groups`: per sample the whole conversation's tokens, ``token_mask`` true on the model's
        tokens only, generation logprobs on those (0 elsewhere), the summed reward and named rewards, the
        conversation after the prompt as text (special tokens kept) in ``responses``, ``response_lengths`` = the
        model's tokens, ``turns``, ``turns_at_max_new_tokens``, ``environment_tokens`` and ``truncated_by``;
        ``env_metrics`` adds ``episode/env_seconds``.

    Raises:
        EnvironmentFault: an environment raised or broke the interface (naming it, the task and the sample).
        ValueError: a problem's task has no environment.
    """
    from rl.scoring import all_reward_names, episode_metadata

    d, g = cfg.data, cfg.grpo
    cap, names = g.max_total_sequence_length, all_reward_names(cfg)
    turns = ChatTurns(tokenizer, apply_chat_template=d.apply_chat_template or any(p.messages for p in problems))
    prompts = [
        render_prompt(tokenizer, p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
        for p in problems
    ]
    episodes = [
        Episode(
            problem=p,
            message_log=prompt_messages(p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template),
            metadata=episode_metadata(p, d.answer_key),
            input_ids=list(ids),
            prompt_length=len(ids),
            components=dict.fromkeys(names, math.nan),
        )
        for p, ids in zip(problems, prompts, strict=True)
        for _ in range(group_size)
    ]
    for e in episodes:
        if e.problem.task not in envs:
            msg = (
                f"row {e.problem.row_id!r} has task {e.problem.task!r}, which no environment scores (env.tasks has "
                f"{sorted(envs)}); add it to env.tasks or fix the row's data.task_key column"
            )
            raise ValueError(msg)
    env_seconds = 0.0
    for turn in range(1, g.max_rollout_turns + 1):
        for e in episodes:  # room for a whole turn, or the episode ends here
            if not e.done and len(e.input_ids) + cfg.generation.max_new_tokens > cap:
                e.stop("length")
        active = [e for e in episodes if not e.done]
        if not active:
            break
        reuse = getattr(generator, "reuses_kv", False) and turn < g.max_rollout_turns  # a later turn may continue
        keep = {"keep_kv": True} if reuse else {}
        if turn == 1 and len(active) == len(episodes):
            out = generator.generate(prompts, group_size=group_size, seed=seed, greedy=greedy, **keep)
        else:
            inputs = [list(e.input_ids) for e in active]
            if getattr(generator, "reuses_kv", False):
                keep["continues"] = [e.kv_row for e in active]
            if any(e.stop_strings for e in active):  # the back-end stops there; the cut below is exact either way
                keep["stop_strings"] = [e.stop_strings for e in active]
            out = generator.generate(inputs, group_size=1, seed=step_seed(seed, turn, "turn"), greedy=greedy, **keep)
        for i, e in enumerate(active):
            e.kv_row = i
            ids = [int(t) for t in out.response_token_ids[i]]
            lp = out.generation_logprobs[i][len(out.input_ids[i]) - len(ids) :].tolist()
            keep, text = cut_at_stop_string(tokenizer, ids, e.stop_strings)
            e.turns_at_max_new_tokens += bool(out.truncated[i]) and keep == len(ids)
            e.append(ids[:keep], lp[:keep])
            e.turns, e.assistant_tokens = turn, e.assistant_tokens + keep
            e.message_log.append({"role": "assistant", "content": text, "token_ids": ids[:keep]})
        t0 = time.perf_counter()
        _environment_turn(envs, active, turns, tokenizer, cap, cfg.env.timeout_s)
        env_seconds += time.perf_counter() - t0
    for e in episodes:
        if not e.done:
            e.stop("turns")
    metrics = {"episode/env_seconds": env_seconds}
    for task in sorted({e.problem.task for e in episodes}):
        mine = [e for e in episodes if e.problem.task == task]
        _, more = envs[task].global_post_process_and_metrics(
            {
                "rewards": torch.tensor([e.reward for e in mine]),
                "message_log": [e.message_log for e in mine],
                "metadata": [e.metadata for e in mine],
            }
        )
        metrics.update({f"{task}/{k}": float(v) for k, v in more.items()})
    return Groups(
        problems=list(problems),
        input_ids=[torch.tensor(e.input_ids, dtype=torch.int64) for e in episodes],
        generation_logprobs=[torch.tensor(e.logprobs, dtype=torch.float32) for e in episodes],
        token_mask=[torch.tensor(e.token_mask, dtype=torch.bool) for e in episodes],
        responses=[tokenizer.decode(e.input_ids[e.prompt_length :], skip_special_tokens=False) for e in episodes],
        rewards=[e.reward for e in episodes],
        reward_components=[e.components for e in episodes],
        truncated=[e.truncated for e in episodes],
        prompt_lengths=[e.prompt_length for e in episodes],
        response_lengths=[e.assistant_tokens for e in episodes],
        turns=[e.turns for e in episodes],
        turns_at_max_new_tokens=[e.turns_at_max_new_tokens for e in episodes],
        environment_tokens=[e.environment_tokens for e in episodes],
        truncated_by=[e.truncated_by for e in episodes],
        env_metrics=metrics,
    )


def _environment_turn(
    envs: dict[str, EnvironmentInterface],
    active: list[Episode],
    turns: ChatTurns,
    tokenizer: Any,
    cap: int,
    timeout_s: float,
) -> None:
    """Step each task's environment on its active episodes and apply what it returns (rewards, metadata, the end of
    the episode or the observation's tokens)."""
    from rl.environments import weighted_total

    by_task: dict[str, list[Episode]] = {}
    for e in active:
        by_task.setdefault(e.problem.task, []).append(e)
    for task, batch in by_task.items():
        env = envs[task]
        where = f"environment {type(env).__name__} of task {task!r}"
        ret = _step(env, batch, where, timeout_s)
        _check_return(ret, batch, where)
        total = weighted_total(ret.rewards, env.reward_weights, row_ids=[e.problem.row_id for e in batch])
        named = ret.rewards if isinstance(ret.rewards, dict) else {next(iter(env.reward_weights)): ret.rewards}
        for j, e in enumerate(batch):
            e.reward += float(total[j])
            for name, values in named.items():
                v = float(values[j])
                if not math.isnan(v):
                    e.components[name] = v if math.isnan(e.components.get(name, math.nan)) else e.components[name] + v
            if ret.metadata[j] is not None:
                e.metadata = ret.metadata[j]
            if bool(ret.terminateds[j]):
                e.done = True
                continue
            obs = ret.observations[j]
            ended = bool(e.input_ids) and e.input_ids[-1] == tokenizer.eos_token_id
            ids = turns.observation_ids(obs, ended_with_eos=ended)
            room = cap - len(e.input_ids)
            if len(ids) > room:  # cut to fit; the episode ends here
                e.append(ids[: max(room, 0)], None)
                e.environment_tokens += max(room, 0)
                e.stop("length")
                continue
            e.append(ids, None)
            e.environment_tokens += len(ids)
            e.message_log.append(dict(obs))
            e.stop_strings = ret.next_stop_strings[j]


def _step(env: EnvironmentInterface, batch: list[Episode], where: str, timeout_s: float) -> Any:
    """``env.step`` on ``batch`` in a thread of its own, given ``timeout_s`` seconds (``env.timeout_s``).

    Raises:
        EnvironmentFault: it raised, or did not return in time (its thread is left to finish on its own: a Python
            thread cannot be stopped; the rollout fails).
    """
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["ret"] = env.step([e.message_log for e in batch], [e.metadata for e in batch])
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            result["err"] = err

    thread = threading.Thread(target=run, name="grpoflow-environment-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    first = f"a batch of {len(batch)} samples (first row {batch[0].problem.row_id!r})"
    if thread.is_alive():
        msg = f"{where} did not return within env.timeout_s={timeout_s} s on {first}; make its step faster or raise it"
        raise EnvironmentFault(msg)
    if "err" in result:
        err = result["err"]
        msg = f"{where} raised on {first}: {type(err).__name__}: {err}"
        raise EnvironmentFault(msg) from err
    return result["ret"]


def _check_return(ret: Any, batch: list[Episode], where: str) -> None:
    """Raises EnvironmentFault unless ``ret`` has one well-formed entry per sample of ``batch``."""
    n = len(batch)
    sizes = {
        "observations": len(ret.observations),
        "metadata": len(ret.metadata),
        "next_stop_strings": len(ret.next_stop_strings),
        "terminateds": len(ret.terminateds),
    }
    rewards = ret.rewards.values() if isinstance(ret.rewards, dict) else [ret.rewards]
    sizes |= {"rewards": min((len(r) for r in rewards), default=0)}
    wrong = {k: v for k, v in sizes.items() if v != n}
    if wrong:
        msg = f"{where} returned {wrong} results for {n} samples (first row {batch[0].problem.row_id!r}): give one each"
        raise EnvironmentFault(msg)
    for j, (e, obs) in enumerate(zip(batch, ret.observations, strict=True)):
        if bool(ret.terminateds[j]):
            continue
        ok = isinstance(obs, dict) and isinstance(obs.get("role"), str) and isinstance(obs.get("content"), str)
        if not ok:
            msg = (
                f"{where} returned a malformed observation for sample {j} (row {e.problem.row_id!r}): {obs!r:.200}; "
                'give {"role": "user" or "tool", "content": str} for every sample it does not terminate'
            )
            raise EnvironmentFault(msg)
        stops = ret.next_stop_strings[j]
        if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            msg = f"{where} returned next_stop_strings {stops!r:.200} for row {e.problem.row_id!r}: give a list of str"
            raise EnvironmentFault(msg)
