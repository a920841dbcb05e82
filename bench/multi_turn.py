"""What the multi-turn loop costs: K turns of T tokens (`rl.multi_turn.multi_turn_groups`, an environment that
answers "ok" and ends the episode at turn K) against one turn of the same tokens, side by side in one process, on the
transformers generation back-end. Two one-turn baselines:

* ``one turn of K*T tokens``: the same generated tokens, without the environment's;
* ``one turn, same tokens``: the same tokens in all: the prompt followed by the K - 1 environment replies' tokens
  (prefilled, as the loop prefills them), then K * T generated. The loop's own cost is its time over this one's.

    python -m bench.multi_turn [--model DIR | --random-shape 135M] [--prompts 8] [--group 4] [--turns 4]
                               [--tokens 16] [--repeats 3] [--device cpu] [--json PATH] [--out PATH.md]
                               [--backend transformers | vllm] [--prompt-tokens 0]

``--backend vllm`` measures what vLLM's prefix cache saves across turns instead: the same K-turn episodes on one
engine, with the cache as the back-end runs it (a turn's prompt, the conversation so far, hits the blocks its earlier
turns filled) and with the cache emptied before every turn (``LLM.reset_prefix_cache``: each turn prefills the whole
conversation, though the G completions of a prompt still share its prefill within a call). vLLM caches whole
blocks only (128 tokens on the CPU), so a conversation shorter than a block has nothing to re-use: ``--prompt-tokens``
lengthens each prompt, as a document or a long task statement would.

A random-weight model (``--random-shape``, ``bench.megatron.SIZES``, the SmolLM2 tokenizer) rarely produces eos, so
every turn runs to T tokens and both sides generate the same number of tokens; the real model stops where it likes.
Each side runs once as a warm-up and ``--repeats`` times timed (median, min, max). The multi-turn side keeps each
row's KV cache between turns (`rl/backends/hf/kv_reuse.py`), so a turn prefills only the environment's reply: its
extra cost is those tokens, each turn's call and the loop's own work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rl.environments import EnvironmentInterface, EnvironmentReturn


class Ok(EnvironmentInterface):
    """Answers "ok" until the episode's turn ``turns``, then ends it; reward 0."""

    reward_weights = {"ok": 1.0}

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns

    def step(self, message_log_batch: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        import torch

        n = len(message_log_batch)
        done = [sum(m["role"] == "assistant" for m in log) >= self.turns for log in message_log_batch]
        return EnvironmentReturn(
            observations=[{"role": "user", "content": "ok"}] * n,
            metadata=list(metadata),
            next_stop_strings=[None] * n,
            rewards=torch.zeros(n),
            terminateds=torch.tensor(done),
            answers=[None] * n,
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model")
    which.add_argument("--random-shape", default="135M", choices=["135M", "1B"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="T, tokens per turn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="lengthen each prompt by this many random digits, its own per prompt (SmolLM2: a token each)",
    )
    p.add_argument("--json")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if min(args.prompts, args.group, args.turns, args.tokens, args.repeats) < 1:
        p.error("every count must be at least 1")
    import os

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch

    from bench.megatron import random_llama
    from rl.backends.hf.generation import HFGeneration
    from rl.backends.interfaces import PolicyVersion
    from rl.config import DEFAULT_MODEL, config_from_dict
    from rl.data import Problem
    from rl.model import load_tokenizer, resolve_model
    from rl.multi_turn import ChatTurns, multi_turn_groups
    from rl.prompts import render_prompt

    with tempfile.TemporaryDirectory(prefix="bench-multi-turn-") as tmp:
        path = args.model or random_llama(Path(tmp) / "model", args.random_shape, resolve_model(DEFAULT_MODEL))
        tok = load_tokenizer(path)
        k, t = args.turns, args.tokens

        def cfg(turns: int, tokens: int) -> Any:
            return config_from_dict(
                {
                    "model": {"name": path},
                    "grpo": {
                        "num_prompts_per_step": args.prompts,
                        "num_generations_per_prompt": args.group,
                        "max_rollout_turns": turns,
                        "max_total_sequence_length": 4096,
                    },
                    "generation": {"max_new_tokens": tokens},
                    "env": {"tasks": {"chain_sum": {"environment": {"class": "bench.multi_turn:Ok"}}}},
                }
            )

        rng = random.Random(0)

        def question(i: int) -> str:
            digits = "".join(rng.choices("0123456789", k=args.prompt_tokens))
            return f"Count to {i + 3}." + (f" {digits}" if digits else "")

        problems = [
            Problem(question=question(i), answer="", entry={}, task="chain_sum", row_id=f"bench:{i}")
            for i in range(args.prompts)
        ]
        replies = ChatTurns(tok, apply_chat_template=True).observation_ids(
            {"role": "user", "content": "ok"}, ended_with_eos=False
        ) * (k - 1)  # what the loop prefills between turns (a random model's turn rarely ends with eos)
        same = "one turn, same tokens"
        if args.backend == "vllm":
            from rl.backends.vllm.generation import VLLMGeneration

            engine = VLLMGeneration(cfg(k, t), tokenizer=tok, model_path=path)
            engine.refit(PolicyVersion(step=0, path=path))
            cached, emptied = f"{k} turns, prefix cache kept", f"{k} turns, prefix cache emptied every turn"
            sides = {cached: cfg(k, t), emptied: cfg(k, t)}
            gens = {cached: engine, emptied: EmptiedEveryCall(engine)}
        else:
            sides = {"one turn of K*T tokens": cfg(1, k * t), same: cfg(1, k * t), f"{k} turns of T tokens": cfg(k, t)}
            gens = {}
            for name, c in sides.items():
                gens[name] = HFGeneration(c, tokenizer=tok, model_path=path)
                gens[name].refit(PolicyVersion(step=0, path=path))

        def run(name: str, seed: int) -> tuple[float, int, int]:
            c, gen = sides[name], gens[name]
            t0 = time.perf_counter()
            if c.grpo.max_rollout_turns == 1:
                d = c.data
                prompts = [
                    render_prompt(tok, p, system_prompt=d.system_prompt, apply_chat_template=d.apply_chat_template)
                    for p in problems
                ]
                extra = replies if name == same else []
                out = gen.generate([[*p, *extra] for p in prompts], group_size=args.group, seed=seed)
                tokens, env_tokens = int(out.response_lengths.sum()), len(extra) * len(prompts) * args.group
            else:
                if args.backend == "vllm":
                    empty_prefix_cache(engine)  # no side starts from blocks the other filled
                g = multi_turn_groups(
                    gen, tok, problems, c, group_size=args.group, greedy=False, seed=seed, envs={"chain_sum": Ok(k)}
                )
                tokens, env_tokens = sum(g.response_lengths), sum(g.environment_tokens)
            return time.perf_counter() - t0, tokens, env_tokens

        rows = []
        for name in sides:
            run(name, 0)  # warm-up
        timed: dict[str, list[tuple[float, int, int]]] = {name: [] for name in sides}
        for r in range(args.repeats):
            for name in sides:
                timed[name].append(run(name, r + 1))
        base = statistics.median(s for s, _, _ in timed[next(iter(sides))])
        base_same = statistics.median(s for s, _, _ in timed[same]) if same in timed else base
        for name, runs in timed.items():
            secs = [s for s, _, _ in runs]
            rows.append(
                {
                    "side": name,
                    "s": statistics.median(secs),
                    "min": min(secs),
                    "max": max(secs),
                    "generated_tokens": statistics.median_low(n for _, n, _ in runs),
                    "environment_tokens": statistics.median_low(e for _, _, e in runs),
                    "vs_one_turn": statistics.median(secs) / base,
                    "vs_same_tokens": statistics.median(secs) / base_same,
                }
            )
    record = {
        "bench": "multi_turn",
        "model": args.model or f"random {args.random_shape}",
        "rows": args.prompts * args.group,
        "turns": k,
        "tokens_per_turn": t,
        "prompt_tokens": args.prompt_tokens,
        "device": args.device,
        "backend": args.backend,
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "sides": rows,
    }
    text = table(record)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def empty_prefix_cache(engine: Any) -> None:
    """Empty the prefix cache of a started ``VLLMGeneration``'s engine (vLLM's ``LLM.reset_prefix_cache``)."""
    engine._llm.reset_prefix_cache()  # noqa: SLF001 (a measurement, not something the back-end offers)


class EmptiedEveryCall:
    """A vLLM generation back-end whose prefix cache is emptied before every ``generate`` call (each turn)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        empty_prefix_cache(self.engine)
        return self.engine.generate(*args, **kwargs)


def table(r: dict[str, Any]) -> str:
    vllm = r.get("backend") == "vllm"
    title = "vLLM's prefix cache across turns" if vllm else "Multi-turn loop against one turn"
    lines = [
        f"# {title} ({r['model']}, {r['rows']} rows, K = {r['turns']}, T = "
        f"{r['tokens_per_turn']}"
        + (f", prompts lengthened by {r['prompt_tokens']} tokens" if r.get("prompt_tokens") else "")
        + f", {r['device']}, {r['torch_threads']} threads; median of {r['repeats']})",
        "",
        "| side | s (median) | min - max | generated tokens | environment tokens | time vs "
        + ("the cache kept |" if vllm else "one turn | vs same tokens |"),
        "|---|---|---|---|---|---|" + ("" if vllm else "---|"),
    ]
    lines += [
        f"| {x['side']} | {x['s']:.3f} | {x['min']:.3f} - {x['max']:.3f} | {x['generated_tokens']:,} | "
        f"{x['environment_tokens']:,} | {x['vs_one_turn']:.2f} |" + ("" if vllm else f" {x['vs_same_tokens']:.2f} |")
        for x in r["sides"]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
