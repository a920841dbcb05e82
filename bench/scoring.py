"""What scoring through the environments costs a default step: the reasoning-gym scorer called in this process, as
the rollout called it before environments existed (baseline), against ``rl.scoring.score_completions`` through the
environment and its reward worker processes, side by side in one process, on the 64 completions of a default step.

    python bench/scoring.py [--repeats 50] [--step-seconds 29.2] [--out bench/results/scoring.md]

Completions: for each of the default step's 8 chain_sum problems, its answer, a wrong number, the answer in
``<answer>`` tags, garbage and an empty string, cycled to 8 per problem (B x G = 8 x 8). Reported: the median over
``--repeats`` calls of each (warm: the workers started), the rewards' equality, the one-time start of the environments
(worker processes importing reasoning-gym; a process pays it once, a cluster's rollout pod once per step, while its
model generates), and each as a share of a default step of ``--step-seconds`` (the median step of ``bench/step.py``
at the default shape on the same machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl.config import config_from_dict  # noqa: E402
from rl.data import score  # noqa: E402
from rl.prompts import ReasoningGymPrompts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--step-seconds", type=float, default=29.2, help="a default step's median seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "scoring.md")
    args = parser.parse_args()

    from rl.scoring import close_environments, environments, score_completions

    cfg = config_from_dict({})
    d, g = cfg.data, cfg.grpo
    problems = ReasoningGymPrompts(cfg).problems(0, g.num_prompts_per_step)  # step 1's
    owners, responses = [], []
    for p in problems:
        kinds = [p.answer, f"It is {int(p.answer) + 1}", f"<answer>{p.answer}</answer>", "banana", ""]
        for i in range(g.num_generations_per_prompt):
            owners.append(p)
            responses.append(kinds[i % len(kinds)])
    ids = [[1, 2, 3]] * len(responses)

    t0 = time.perf_counter()
    envs = environments(cfg)
    start_s = time.perf_counter() - t0

    def direct() -> list[float]:
        return [score(p, r, d.dataset, d.dataset_kwargs, d.seed) for p, r in zip(owners, responses)]

    def through_envs() -> list[float]:
        return score_completions(envs, owners, responses, ids, cfg).rewards

    assert direct() == through_envs(), "the environment's rewards differ from the scorer's"
    timings: dict[str, list[float]] = {"direct": [], "envs": []}
    for _ in range(args.repeats):  # alternated, so that drift hits both alike
        for name, fn in (("direct", direct), ("envs", through_envs)):
            t0 = time.perf_counter()
            fn()
            timings[name].append(time.perf_counter() - t0)
    close_environments()
    base, ours = statistics.median(timings["direct"]), statistics.median(timings["envs"])
    step = args.step_seconds
    lines = [
        "# Scoring a default step through the environments",
        "",
        f"Command: `python bench/scoring.py --repeats {args.repeats} --step-seconds {step}` (repository root)  ",
        f"Machine: nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}; `env.num_workers` {cfg.env.num_workers}  ",
        f"Completions: {len(responses)} (B x G = {g.num_prompts_per_step} x {g.num_generations_per_prompt}) of the "
        f"default step's chain_sum problems; rewards identical: True ({sum(direct()):.0f} of {len(responses)} "
        "rewarded)",
        "",
        "| what | ms | share of a default step |",
        "|---|---|---|",
        f"| baseline: reasoning-gym's `score_answer` in the rollout's process (median of {args.repeats}) | "
        f"{base * 1e3:.2f} | {base / step:.4%} |",
        f"| `score_completions` through the environment's worker processes (median of {args.repeats}) | "
        f"{ours * 1e3:.2f} | {ours / step:.4%} |",
        f"| added per step (ratio {ours / base:.1f}x the baseline) | {(ours - base) * 1e3:.2f} | "
        f"{(ours - base) / step:.4%} |",
        f"| once per process: the environments' start (workers importing reasoning-gym) | {start_s * 1e3:.0f} | "
        f"{start_s / step:.2%} |",
        "",
        f"A default step: {step} s (`bench/step.py` at 8 x 8 x 32 tokens, float32, this machine). A local run starts "
        "the environments once; a cluster's rollout pod starts them while its model generates.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
