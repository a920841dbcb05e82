"""``ToolEnvironment``: a multi-turn environment whose model may call a sandboxed Python tool before answering.

Per sample and turn, the last assistant message decides (NeMo-RL's multi-turn ``EnvironmentInterface`` contract,
``nemo_rl/environments/code_environment.py`` for the tool-observation shape):

* tool call(s) -> run them in the sandbox (``sandbox.evaluate``), observation ``{"role": "tool", "content": result}``,
  reward 0, not terminated;
* a tool call that does not parse -> observation ``{"role": "user", "content": PARSE_ERROR_PREFIX + why + format}``,
  reward 0, not terminated;
* no tool call -> the final answer: reward 1.0 if it equals ``metadata[answer_key]`` (``answers.answers_match``),
  else 0.0; terminated;
* a turn whose call(s) would take the sample past ``max_tool_calls`` attempts (run calls plus unparsable ones) ->
  terminated with reward 0, nothing run.

The per-sample state lives only in the returned metadata: ``tool_calls`` (calls run), ``tool_errors`` (of those, the
ones that failed) and ``parse_errors``; the metadata of a terminated sample is returned too (with its final counts),
for ``global_post_process_and_metrics``. It needs the multi-turn rollout loop (``grpo.max_rollout_turns > 1``): a
single-turn rollout would score the first reply only.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rl.environments.interfaces import EnvironmentInterface, EnvironmentReturn, RewardError
from rl.environments.tools.answers import answers_match, final_answer
from rl.environments.tools.parsing import (
    TOOL_NAME,
    ParseError,
    ToolCall,
    parse_tool_calls,
    tool_schema,
)
from rl.environments.tools.sandbox import ToolResult, evaluate

PARSE_ERROR_PREFIX = "Your tool call could not be parsed: "
"""Start of the user message that answers an unparsable tool call."""

COUNTS = ("tool_calls", "tool_errors", "parse_errors")
"""The metadata keys this environment keeps per sample."""


def _sample(i: int, meta: dict | None) -> str:
    row = meta.get("row_id") if isinstance(meta, dict) else None
    return f"sample {i} of the batch" + (f" (row_id {row!r})" if row is not None else "")


class ToolEnvironment(EnvironmentInterface):
    """A task answered with the help of a sandboxed ``python`` tool; ``reward_weights == {"correct": 1.0}``.

    Args:
        answer_key: the metadata key of the reference answer (the dataset column).
        max_tool_calls: tool-call attempts allowed per sample (parse errors count); one more ends it with reward 0.
        timeout_s: wall-clock seconds per tool call (the sandbox kills the call's processes after it).
        memory_mb: address-space limit of a tool call's process, MiB.
        max_output: characters of tool output returned to the model.
        max_workers: tool calls of one batch run at once (threads, each waiting on its own subprocess).
        tokenizer: None (parse the fallback ``<tool_call>{json}</tool_call>`` format), or a tokenizer object or
            model path whose ``response_template`` parses its own tool-call format (transformers >= 5).
        tools: the tool schemas given to the template (default ``[tool_schema()]``).

    Raises:
        ValueError: a limit is not positive.
    """

    reward_name = "correct"
    reward_weights = {"correct": 1.0}  # a class attribute: the config reads it before any environment is built

    def __init__(
        self,
        *,
        answer_key: str = "answer",
        max_tool_calls: int = 4,
        timeout_s: float = 5.0,
        memory_mb: int = 256,
        max_output: int = 2000,
        max_workers: int = 4,
        tokenizer: Any = None,
        tools: list[dict] | None = None,
    ) -> None:
        limits = {"max_tool_calls": max_tool_calls, "timeout_s": timeout_s, "memory_mb": memory_mb}
        limits |= {"max_output": max_output, "max_workers": max_workers}
        bad = {k: v for k, v in limits.items() if not v > 0}
        if bad:
            msg = f"ToolEnvironment: {bad} must be positive; set the environment kwargs to positive numbers."
            raise ValueError(msg)
        self.answer_key = answer_key
        self.max_tool_calls = int(max_tool_calls)
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.max_output = int(max_output)
        self.max_workers = int(max_workers)
        self.tools = [tool_schema()] if tools is None else tools
        if isinstance(tokenizer, str):
            from rl.model import load_tokenizer

            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.reward_weights = dict(type(self).reward_weights)

    def _parse(self, log: list[dict]) -> list[ToolCall]:
        prefix = ""
        if self.tokenizer is not None and getattr(self.tokenizer, "response_template", None) is not None:
            prompt = [{k: v for k, v in m.items() if k != "token_ids"} for m in log[:-1]]
            prefix = self.tokenizer.apply_chat_template(
                prompt, tools=self.tools, add_generation_prompt=True, tokenize=False
            )
        return parse_tool_calls(log[-1]["content"], tokenizer=self.tokenizer, prefix=prefix, tools=self.tools)

    def _run(self, call: ToolCall) -> ToolResult:
        if call.name != TOOL_NAME:
            return ToolResult(ok=False, output="", error=f"unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}")
        code = call.arguments.get("code")
        if not isinstance(code, str):
            error = f"the {TOOL_NAME!r} tool needs the argument 'code' (a string), got arguments {call.arguments!r}"
            return ToolResult(ok=False, output="", error=error)
        return evaluate(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output=self.max_output)

    def _check(self, i: int, log: list[dict], meta: Any) -> None:
        if not isinstance(meta, dict) or self.answer_key not in meta:
            keys = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
            msg = (
                f"ToolEnvironment: {_sample(i, meta)} has no {self.answer_key!r} in its metadata (it has {keys}). "
                f"The reference answer is read from metadata[{self.answer_key!r}]: give the dataset an "
                f"{self.answer_key!r} column, or set the environment's kwargs.answer_key to the column that holds it."
            )
            raise RewardError(msg)
        if not log or log[-1].get("role") != "assistant" or not isinstance(log[-1].get("content"), str):
            last = log[-1].get("role") if log else None
            msg = (
                f"ToolEnvironment: the message log of {_sample(i, meta)} does not end with an assistant message "
                f"with string content (its last role is {last!r}); step must be called after each generation turn."
            )
            raise RewardError(msg)

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """One turn of ``B`` samples (see the module docstring).

        Returns:
            ``EnvironmentReturn`` with ``rewards == {"correct": [B] float32}`` (0.0 until a sample answers),
            ``terminateds`` ``[B]`` bool, metadata ``[B]`` (the input's plus ``tool_calls``, ``tool_errors``,
            ``parse_errors``), ``answers`` the extracted final answer of terminated samples (None otherwise) and
            no stop strings.

        Raises:
            RewardError: a sample's metadata lacks ``answer_key`` or its log does not end with an assistant message
                (naming the first such sample by index and ``row_id``).
        """
        import torch

        if len(message_log_batch) != len(metadata):
            msg = (
                f"ToolEnvironment.step: {len(message_log_batch)} message logs but {len(metadata)} metadata entries; "
                "pass one metadata dict per sample."
            )
            raise RewardError(msg)
        n = len(metadata)
        for i, (log, meta) in enumerate(zip(message_log_batch, metadata)):
            self._check(i, log, meta)
        out_meta = [{**meta, **{k: int(meta.get(k, 0)) for k in COUNTS}} for meta in metadata]
        observations: list[dict[str, str]] = [{"role": "environment", "content": ""} for _ in range(n)]
        rewards = [0.0] * n
        done = [False] * n
        answers: list[str | None] = [None] * n
        jobs: list[tuple[int, ToolCall]] = []
        for i, log in enumerate(message_log_batch):
            m = out_meta[i]
            attempts = m["tool_calls"] + m["parse_errors"]
            try:
                calls = self._parse(log)
            except ParseError as e:
                m["parse_errors"] += 1
                if attempts + 1 > self.max_tool_calls:
                    done[i] = True  # past the cap: ends with reward 0
                    continue
                observations[i] = {"role": "user", "content": PARSE_ERROR_PREFIX + str(e)}
                continue
            if not calls:
                answers[i] = final_answer(log[-1]["content"])
                rewards[i] = float(answers_match(answers[i], m[self.answer_key]))
                done[i] = True
            elif attempts + len(calls) > self.max_tool_calls:
                done[i] = True  # past the cap: ends with reward 0, nothing run
            else:
                m["tool_calls"] += len(calls)
                jobs.extend((i, c) for c in calls)
        if jobs:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(jobs))) as pool:
                results = list(pool.map(self._run, [c for _, c in jobs]))
            per_sample: dict[int, list[ToolResult]] = {}
            for (i, _), r in zip(jobs, results):
                per_sample.setdefault(i, []).append(r)
            for i, rs in per_sample.items():
                out_meta[i]["tool_errors"] += sum(not r.ok for r in rs)
                content = rs[0].text() if len(rs) == 1 else "\n".join(f"[{k + 1}] {r.text()}" for k, r in enumerate(rs))
                observations[i] = {"role": "tool", "content": content}
        return EnvironmentReturn(
            observations=observations,
            metadata=out_meta,
            next_stop_strings=[None] * n,
            rewards={self.reward_name: torch.tensor(rewards, dtype=torch.float32)},
            terminateds=torch.tensor(done, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(self, batch: dict) -> tuple[dict, dict[str, float]]:
        """Metrics of a finished rollout: ``tool_calls`` (mean calls run per sample), ``tool_errors`` and
        ``parse_errors`` (counts over the batch).

        Read from ``batch["metadata"]`` (the last metadata ``step`` returned per sample) when every entry has the
        counts; else counted from ``batch["message_log"]`` (``"tool"`` messages, those with an ``Error:`` line, and
        user messages starting with ``PARSE_ERROR_PREFIX``; a tool message of several calls counts once there).
        The batch is returned unchanged; ``{}`` when it has neither.
        """
        metas = [m for m in batch.get("metadata") or [] if isinstance(m, dict)]
        if metas and all("tool_calls" in m for m in metas):
            calls = [int(m["tool_calls"]) for m in metas]
            errors = sum(int(m.get("tool_errors", 0)) for m in metas)
            parse = sum(int(m.get("parse_errors", 0)) for m in metas)
        elif batch.get("message_log"):
            logs = batch["message_log"]
            tool_msgs = [[m for m in log if m.get("role") == "tool"] for log in logs]
            calls = [len(t) for t in tool_msgs]
            errors = sum(("\nError: " in "\n" + m["content"]) for t in tool_msgs for m in t)
            parse = sum(
                m.get("role") == "user" and str(m.get("content", "")).startswith(PARSE_ERROR_PREFIX)
                for log in logs
                for m in log
            )
        else:
            return batch, {}
        metrics = {
            "tool_calls": sum(calls) / len(calls) if calls else 0.0,
            "tool_errors": float(errors),
            "parse_errors": float(parse),
        }
        return batch, metrics
