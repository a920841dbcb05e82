"""Does GRPO learn? Held-out greedy accuracy of the real model before and after training, with 95% CIs.

    python -m bench.learning [--cfg configs/learning.yaml]

Runs the `grpo` workflow (Flyte local executor) with the given config, which validates at step 0 and every
`val_period` steps on `data.num_val_problems` questions held out by content, then reads the curve back
from MLflow and prints a markdown table (also written to bench/results/learning.md).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p observed over n trials."""
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return centre - half, centre + half


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cfg", default="configs/learning.yaml")
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    from rl.config import load_config
    from workflows.grpo import grpo

    cfg = load_config(args.cfg)
    t0 = time.time()
    summary = grpo(cfg=cfg)
    wall = time.time() - t0
    client = MlflowClient(cfg.tracking.uri)
    acc = sorted((m.step, m.value) for m in client.get_metric_history(summary.mlflow_run_id, "validation/accuracy"))
    step_time = [m.value for m in client.get_metric_history(summary.mlflow_run_id, "timing/train/total_step_time")]
    rewards = sorted((m.step, m.value) for m in client.get_metric_history(summary.mlflow_run_id, "train/reward"))
    n = cfg.data.num_val_problems
    lines = [
        f"Command: `python -m bench.learning --cfg {args.cfg}`; MLflow run `{summary.mlflow_run_id}` in `{cfg.tracking.uri}`.",
        f"Wall time {wall / 60:.1f} min for {summary.final_step} steps (median step {sorted(step_time)[len(step_time) // 2]:.1f} s), "
        f"{n} held-out questions ({cfg.data.dataset} {cfg.data.dataset_kwargs}, split by content).",
        "",
        "| step | greedy accuracy | 95% CI |",
        "|---:|---:|---|",
    ]
    for step, value in acc:
        lo, hi = wilson(value, n)
        lines.append(f"| {step} | {value:.3f} | [{lo:.3f}, {hi:.3f}] |")
    lines += ["", "Training reward per step: " + ", ".join(f"{v:.3f}" for _, v in rewards)]
    text = "\n".join(lines)
    print(text)
    out = Path("bench/results/learning.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
