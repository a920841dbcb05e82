"""Does GRPO learn? Held-out greedy accuracy of the real model before and after training, with 95% CIs.

    python -m bench.learning [--cfg configs/learning.yaml] [--pass-at-k 8] [--from-run MLFLOW_RUN_ID]

Runs the `grpo` workflow (Flyte local executor) with the given config, which validates at step 0 and every
`val_period` steps on `data.num_val_problems` questions held out by content, then reads the curve and the
validation sample tables back from MLflow and prints a markdown table (also written to
bench/results/learning.md): accuracy per validation step against wall-clock minutes since the run started,
overall and per problem size (largest operand's digit count, e.g. 1-digit = the `a + b` problems with one-digit
terms). With ``--pass-at-k K`` it first measures the untrained model's pass@K on the same held-out questions
(K samples each at the config's temperature): the share of questions it can already solve sometimes, i.e. what
GRPO can sharpen into greedy accuracy without teaching anything new. A config with
``grpo.num_val_generations_per_prompt`` K > 0 adds a column: the share correct of K sampled completions per held-out
question at the config's temperature (``validation/sampled_accuracy``), where GRPO's sharpening shows before greedy
decoding moves.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections import defaultdict
from pathlib import Path

from rl.backends.hf.model import load_model
from rl.data import val_problems
from rl.model import load_tokenizer, resolve_model
from tasks.run_config import load_run_config


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p observed over n trials."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def size_of(question: str) -> str:
    """``"{d}-digit"`` for the largest number in the question's expression (after its last colon)."""
    numbers = re.findall(r"\d+", question.rsplit(":", 1)[-1])
    return f"{max(len(n) for n in numbers)}-digit" if numbers else "other"


def fmt(correct: list[bool]) -> str:
    if not correct:
        return "-"
    return fmt_share(sum(correct) / len(correct), len(correct))


def fmt_share(p: float, n: int) -> str:
    """``p`` observed over ``n`` trials with its 95% Wilson interval, as :func:`fmt` writes it."""
    lo, hi = wilson(p, n)
    return f"{p:.3f} [{lo:.2f}, {hi:.2f}]"


def pass_at_k(cfg, k: int) -> dict[str, list[bool]]:
    """Per size: for each held-out question, whether any of ``k`` samples of the untrained model is correct."""
    import torch

    from rl.rollout import generate_groups

    torch.manual_seed(0)
    path = resolve_model(cfg.model.name)
    model, tok = load_model(path), load_tokenizer(path)
    d = cfg.data
    problems = val_problems(
        dataset=d.dataset,
        dataset_kwargs=d.dataset_kwargs,
        seed=d.val_seed,
        val_fraction=d.val_fraction,
        count=d.num_val_problems,
    )
    out: dict[str, list[bool]] = defaultdict(list)
    for a in range(0, len(problems), 8):
        groups = generate_groups(model, tok, problems[a : a + 8], cfg, group_size=k, greedy=False)
        for j, p in enumerate(groups.problems):
            hit = any(r >= 1.0 for r in groups.rewards[j * k : (j + 1) * k])
            out["all"].append(hit)
            out[size_of(p.question)].append(hit)
    return out


def validation_tables(client, run_id: str) -> dict[int, dict[str, list[bool]]]:
    """step -> size -> correctness per held-out question, from the run's ``validation/step_*.json`` tables."""
    out = {}
    for art in client.list_artifacts(run_id, "validation"):
        step = int(re.search(r"step_(\d+)", art.path).group(1))
        doc = json.loads(Path(client.download_artifacts(run_id, art.path)).read_text())
        cols = doc["columns"]
        by: dict[str, list[bool]] = defaultdict(list)
        for row in doc["data"]:
            r = dict(zip(cols, row))
            by["all"].append(bool(r["correct"]))
            by[size_of(r["prompt"])].append(bool(r["correct"]))
        out[step] = by
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default="configs/learning.yaml")
    parser.add_argument("--pass-at-k", type=int, default=0, help="also measure the untrained model's pass@K (0: skip)")
    parser.add_argument("--out", default="bench/results/learning.md", help="markdown result file")
    parser.add_argument(
        "--from-run",
        metavar="MLFLOW_RUN_ID",
        help="train nothing: write the table of this MLflow run of --cfg's tracking store (e.g. one stopped early)",
    )
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    cfg = load_run_config(args.cfg)
    client = MlflowClient(cfg.tracking.uri)
    ceiling: dict[str, list[bool]] = {}
    if args.from_run:
        run_id, wall = args.from_run, None
    else:
        from workflows.grpo import grpo

        ceiling = pass_at_k(cfg, args.pass_at_k) if args.pass_at_k else {}
        t0 = time.time()
        run_id = grpo(cfg=cfg).mlflow_run_id
        wall = time.time() - t0
    text = report(cfg, client, run_id, args, wall=wall, ceiling=ceiling)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


def report(cfg, client, run_id: str, args, *, wall: float | None, ceiling: dict[str, list[bool]]) -> str:
    """The markdown table of the MLflow run ``run_id``: accuracy per validation step, overall and per size, the step
    time and the training rewards. ``wall``: the run's seconds (None: a run read back with ``--from-run``, whose
    steps are then counted from its metrics)."""
    from rl.precision import resolve

    run = client.get_run(run_id)
    history = {m.step: m for m in client.get_metric_history(run_id, "validation/accuracy")}
    step_time = sorted(m.value for m in client.get_metric_history(run_id, "timing/train/total_step_time"))
    rewards = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/reward"))
    tables = validation_tables(client, run_id)
    sampled = {m.step: m.value for m in client.get_metric_history(run_id, "validation/sampled_accuracy")}
    k = cfg.grpo.num_val_generations_per_prompt
    sizes = sorted({s for t in tables.values() for s in t if s != "all"})
    n = cfg.data.num_val_problems
    d = cfg.data
    source = f"{d.validation or d.train}" if d.train else f"{d.dataset} {d.dataset_kwargs}, split by content"
    steps = len(rewards)
    took = (
        f"wall time {wall / 60:.1f} min for {steps} steps"
        if wall is not None
        else f"{steps} of {cfg.grpo.max_num_steps} steps (read back from MLflow, run status {run.info.status})"
    )
    lines = [
        f"Command: `python -m bench.learning --cfg {args.cfg}"
        + (f" --pass-at-k {args.pass_at_k}" if args.pass_at_k else "")
        + (f" --from-run {args.from_run}" if args.from_run else "")
        + "`"
        + f"; MLflow run `{run_id}` in `{cfg.tracking.uri}`.",
        f"Precision {resolve(cfg.model.precision)}; {took} (median step {step_time[len(step_time) // 2]:.1f} s), "
        f"{n} held-out questions ({source}). Greedy accuracy with 95% Wilson intervals; minutes since the run "
        "started.",
        "",
        "| step | minutes | all | "
        + " | ".join(sizes)
        + " |"
        + (f" sampled (T={cfg.generation.temperature}) |" if sampled else ""),
        "|---:|---:|---|" + "---|" * len(sizes) + ("---|" if sampled else ""),
    ]
    for step, by in sorted(tables.items()):
        minutes = (history[step].timestamp - run.info.start_time) / 60_000 if step in history else float("nan")
        lines.append(
            f"| {step} | {minutes:.1f} | {fmt(by['all'])} | "
            + " | ".join(fmt(by.get(s, [])) for s in sizes)
            + " |"
            + (f" {fmt_share(sampled[step], n * k) if step in sampled else '-'} |" if sampled else "")
        )
    if ceiling:
        lines.append(
            f"| untrained pass@{args.pass_at_k} (T={cfg.generation.temperature}) | | {fmt(ceiling['all'])} | "
            + " | ".join(fmt(ceiling.get(s, [])) for s in sizes)
            + " |"
        )
    if sampled:
        lines += [
            "",
            f"Sampled: the share correct of {k} completions per held-out question at temperature "
            f"{cfg.generation.temperature} (`grpo.num_val_generations_per_prompt`; pass@1 as NeMo-RL's validation "
            f"samples it). Its interval counts the {n * k} completions as independent: narrower than the truth, since "
            "a question's completions are correlated.",
        ]
    lines += ["", "Held-out questions per size: " + ", ".join(f"{s} {len(tables[min(tables)][s])}" for s in sizes)]
    lines += ["", "Training reward per step: " + ", ".join(f"{v:.3f}" for _, v in rewards)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
