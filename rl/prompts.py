"""Where a run's prompts come from and how they become token ids: reasoning-gym's problem stream, or the user's
dataset prepared into the run's storage (`rl.datasets`), both addressed by a position in the training stream.

Owns the prompt source of a config and the rendering of a prompt (chat template, messages, or raw text); no model
code, no scoring.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, Protocol

from dataplane import paths
from dataplane.urls import check_root, redact
from rl.config import GRPOConfig
from rl.data import Problem, prompt_token_ids, train_problems, val_problems
from rl.lengths import MODEL_LIMIT


class PromptSource(Protocol):
    """The training stream and the validation problems of a run."""

    def problems(self, start: int, count: int) -> list[Problem]:
        """Positions ``start .. start + count - 1`` of the training stream (unbounded: epochs follow each other)."""
        ...

    def epoch(self, position: int) -> int:
        """The epoch (from 0) that stream position ``position`` falls in."""
        ...

    def validation(self, count: int) -> list[Problem]:
        """``count`` held-out problems (all of them when a validation file has fewer)."""
        ...


class ReasoningGymPrompts:
    """reasoning-gym's problems (:mod:`rl.data`): an unbounded stream, one endless epoch."""

    def __init__(self, cfg: GRPOConfig) -> None:
        self.d = cfg.data

    def problems(self, start: int, count: int) -> list[Problem]:
        d = self.d
        return train_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.seed,
            val_fraction=d.val_fraction,
            start=start,
            count=count,
        )

    def epoch(self, position: int) -> int:
        return 0

    def validation(self, count: int) -> list[Problem]:
        d = self.d
        return val_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.val_seed,
            val_fraction=d.val_fraction,
            count=count,
        )


class FilePrompts:
    """The user's dataset, prepared into the run's storage by ``start_run`` (:func:`prepare_prompts`): the training
    stream shuffled per epoch from ``data.seed`` (:class:`rl.datasets.PromptStream`), each read touching only the
    row groups it needs."""

    def __init__(self, cfg: GRPOConfig, *, root: str, run_id: str) -> None:
        from rl.datasets import PromptStream, open_split

        self.cfg, self.so = cfg, cfg.dataplane.storage_options
        self.keys = column_keys(cfg)
        train_url, self.validation_url = prepared_urls(root, run_id)
        self.stream = PromptStream(
            open_split(train_url, storage_options=self.so),
            seed=cfg.data.seed,
            keys=self.keys,
            storage_options=self.so,
            shuffle=cfg.data.shuffle,
        )

    def problems(self, start: int, count: int) -> list[Problem]:
        return self.stream.problems(start, count)

    def epoch(self, position: int) -> int:
        return self.stream.epoch(position)

    def validation(self, count: int) -> list[Problem]:
        from rl.datasets import first_rows, open_split

        split = open_split(self.validation_url, storage_options=self.so)
        return first_rows(split, count, keys=self.keys, storage_options=self.so)


def column_keys(cfg: GRPOConfig) -> Any:
    """The dataset's column mapping (:class:`rl.datasets.ColumnKeys`) from ``data``."""
    from rl.datasets import ColumnKeys

    d = cfg.data
    return ColumnKeys(
        prompt_key=d.prompt_key, answer_key=d.answer_key, task_key=d.task_key, default_task=cfg.default_task
    )


def prepared_urls(root: str, run_id: str) -> tuple[str, str]:
    """``(train, validation)``: the folders of a run's prepared prompt datasets, ``{root}/{run_id}/prompts/...``."""
    base = paths.join(paths.run_dir(check_root(root), run_id), "prompts")
    return paths.join(base, "train"), paths.join(base, "validation")


def prompt_source(cfg: GRPOConfig, *, root: str | None = None, run_id: str | None = None) -> PromptSource:
    """The run's prompts: :class:`ReasoningGymPrompts` without ``data.train``, else :class:`FilePrompts` (which needs
    the run's ``root`` and ``run_id``; one per process and run).

    Raises:
        ValueError: ``data.train`` is set but no run is named.
    """
    if not cfg.data.from_files:
        return ReasoningGymPrompts(cfg)
    if root is None or run_id is None:
        msg = "a file dataset (data.train) is read from its prepared copy in a run's storage: pass root and run_id"
        raise ValueError(msg)
    key = (json.dumps(cfg.to_dict()["data"], sort_keys=True), root, run_id)
    found = _SOURCES.get(key)
    if found is None:  # one per process: its stream keeps the row groups it read
        found = _SOURCES[key] = FilePrompts(cfg, root=root, run_id=run_id)
    return found


_SOURCES: dict[tuple[str, str, str], FilePrompts] = {}


def prompt_messages(problem: Problem, *, system_prompt: str, apply_chat_template: bool) -> list[dict[str, str]]:
    """The prompt as chat messages, as the environments see it: a messages prompt as it is; a text prompt as
    ``[system, user]`` (no system message when ``system_prompt`` is empty or the template is off)."""
    if problem.messages is not None:
        return [dict(m) for m in problem.messages]
    system = [{"role": "system", "content": system_prompt}] if system_prompt and apply_chat_template else []
    return [*system, {"role": "user", "content": problem.question}]


def render_prompt(tokenizer: Any, problem: Problem, *, system_prompt: str, apply_chat_template: bool) -> list[int]:
    """The prompt's token ids: the chat template over :func:`prompt_messages` with the assistant turn opened, or
    (a text prompt with ``apply_chat_template`` false, for base models) the raw text as the tokenizer encodes it.

    A text prompt with a non-empty system prompt renders exactly as :func:`rl.data.prompt_token_ids`.
    """
    if problem.messages is None and not apply_chat_template:
        return [int(t) for t in tokenizer(problem.question)["input_ids"]]
    if problem.messages is None and system_prompt:
        return prompt_token_ids(tokenizer, problem.question, system_prompt)
    messages = prompt_messages(problem, system_prompt=system_prompt, apply_chat_template=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def fits_checker(tokenizer: Any, cfg: GRPOConfig, max_prompt_tokens: int) -> Callable[[list[Problem]], list[bool]]:
    """``fits(problems) -> [bool]``: whether each prompt, rendered (:func:`render_prompt`), has at most
    ``max_prompt_tokens`` tokens.

    A token covers at least one byte of text for byte-level BPE and byte-fallback tokenizers, so a prompt whose UTF-8
    bytes plus the template's own tokens (and a margin of 8 for merges at its edges) fit is accepted without being
    tokenized: only long prompts are rendered, and checking a large dataset of short prompts costs a pass over its
    text. The back-ends check every prompt they are given again (:func:`rl.lengths.check_fits`).
    ``fits.explain(problem)`` says why a prompt does not fit: its tokens, the limit
    (``generation.vllm_cfg.max_model_len`` where it is the one) and the fixes.
    """
    d = cfg.data
    empty = Problem(question="", answer="", entry={})
    overhead = len(
        render_prompt(tokenizer, empty, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
    )

    def text_bytes(p: Problem) -> int:
        if p.messages is not None:
            return sum(len(m["content"].encode()) + 8 for m in p.messages)  # each message adds its role's tokens
        return len(p.question.encode())

    def fits(problems: list[Problem]) -> list[bool]:
        out = []
        for p in problems:
            if text_bytes(p) + overhead + 8 <= max_prompt_tokens:
                out.append(True)
                continue
            ids = render_prompt(tokenizer, p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
            out.append(len(ids) <= max_prompt_tokens)
        return out

    g = cfg.generation
    context = max_prompt_tokens + g.max_new_tokens
    vllm_limit = g.backend == "vllm" and context == g.vllm_cfg.max_model_len
    limit_name = "generation.vllm_cfg.max_model_len" if vllm_limit else MODEL_LIMIT

    def explain(problem: Problem) -> str:
        n = len(
            render_prompt(tokenizer, problem, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
        )
        fixes = [f"raise {limit_name} to at least {n + g.max_new_tokens}"] if vllm_limit else []
        fixes += [f"lower generation.max_new_tokens to at most {context - n}"] if context - n >= 1 else []
        fixes += ["shorten the prompt" + ("" if vllm_limit else " (or use a model with a longer context)")]
        return (
            f"the prompt has {n} tokens, which with generation.max_new_tokens={g.max_new_tokens} is more than the "
            f"{context} tokens of {limit_name}; {', '.join(fixes)}, or set data.on_overlong_prompt: skip to drop "
            "such prompts"
        )

    fits.explain = explain  # type: ignore[attr-defined]  # the refusal's message (rl.datasets.prepare)
    return fits


def prepare_prompts(
    cfg: GRPOConfig,
    *,
    root: str,
    run_id: str,
    tokenizer: Any | None,
    max_prompt_tokens: int | None,
    resume: bool = False,
) -> tuple[Any, Any]:
    """Read, check and prepare ``data.train`` and the validation prompts (``data.validation``, or the
    ``data.val_fraction`` share of ``data.train`` held out by content hash) into the run's storage
    (:func:`prepared_urls`), where every later task streams them from (:class:`FilePrompts`). A prepared copy that is
    already complete (a resumed run, a retried task) is reused as it is.

    Args:
        cfg: the run's config (``data``, ``env``, ``dataplane.storage_options``).
        root, run_id: the run's storage.
        tokenizer: the model's tokenizer, to check prompt lengths (None: unchecked, e.g. a hub model id).
        max_prompt_tokens: the most tokens a prompt may have (the context minus ``generation.max_new_tokens``).
        resume: the run is resumed: its complete copies are used as its first start made them, even if the source
            changed since (a warning says so), so that it sees the prompts an uninterrupted run sees.

    Returns:
        ``(train, validation)``, each a :class:`rl.datasets.PreparedSplit`.

    Raises:
        rl.datasets.DatasetError: any bad input, naming the file, row and column (see :mod:`rl.datasets`).
    """
    from rl.datasets import DatasetError, open_split, prepare_split

    d = cfg.data
    if resume:
        try:
            copies = tuple(
                open_split(u, storage_options=cfg.dataplane.storage_options) for u in prepared_urls(root, run_id)
            )
        except DatasetError:  # not prepared (or not completely) by the run's first start: prepare it now
            copies = ()
        if copies:
            if copies[0].source != redact(d.train or ""):
                print(
                    f"[grpoflow] warning: resuming with the prompts prepared from {copies[0].source} at the run's "
                    f"start, not data.train={redact(d.train or '')!r}",
                    file=sys.stderr,
                    flush=True,
                )
            return copies[0], copies[1]
    keys = column_keys(cfg)
    tasks = set(cfg.task_specs()) if d.task_key is not None else None
    fits = fits_checker(tokenizer, cfg, max_prompt_tokens) if tokenizer is not None and max_prompt_tokens else None
    # what the length check depends on: a copy checked for another tokenizer, template or limit is prepared again
    fits_key = json.dumps(
        [getattr(tokenizer, "name_or_path", ""), max_prompt_tokens, d.system_prompt, d.apply_chat_template]
    )
    train_url, val_url = prepared_urls(root, run_id)
    held_out = d.validation is None
    common = {
        "keys": keys,
        "storage_options": cfg.dataplane.storage_options,
        "hf_config_name": d.hf_config_name,
        "tasks": tasks,
        "fits": fits,
        "on_overlong_prompt": d.on_overlong_prompt,
        "val_fraction": d.val_fraction if held_out else None,
        "fits_key": fits_key if fits is not None else "",
    }
    out = []
    for split, spec, url, hf_split, keep in (
        ("train", d.train, train_url, d.train_split, "train" if held_out else "all"),
        (
            "validation",
            d.validation or d.train,
            val_url,
            d.train_split if held_out else d.validation_split,
            "val" if held_out else "all",
        ),
    ):
        print(f"[grpoflow] preparing the {split} prompts from {spec}", file=sys.stderr, flush=True)
        prepared = prepare_split(spec, out_url=url, split=split, hf_split=hf_split, keep=keep, **common)
        c = prepared.counts
        print(
            f"[grpoflow] {split} prompts: {prepared.num_rows} rows of {c.get('rows_read', 0)} read "
            f"({c.get('held_out', 0)} held out, {c.get('skipped_overlong', 0)} too long, skipped)",
            file=sys.stderr,
            flush=True,
        )
        out.append(prepared)
    return out[0], out[1]
