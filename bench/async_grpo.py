"""Async GRPO: step time and held-out accuracy against wall-clock for max_trajectory_age_steps a = 0, 1, 2 on the
same config, side by side in one run.

    python -m bench.async_grpo [--cfg configs/learning.yaml] [--steps 10] [--val-period 5] [--ages 0 1 2]

Each age runs the `grpo` workflow (Flyte's local executor) in a fresh process, one after the other, on the real
model: a = 0 is the synchronous trainer; a > 0 generates later steps on the trajectory collector's thread while the
trainer trains (importance-sampling correction on). Reads MLflow back and prints a markdown table (also written to
bench/results/async_grpo.md):

- step interval: wall-clock seconds between consecutive steps' ends (the train task's metric timestamps), median
  over the steps after the first (the first also loads the models);
- generation wait: seconds the trainer waited for its step's batch (``timing/train/generation``), median;
- held-out greedy accuracy at each validation, against minutes since the run started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_RUN = """
import json, sys
from tasks.run_config import run_config_from_dict
from workflows.grpo import grpo
summary = grpo(cfg=run_config_from_dict(json.loads(sys.argv[1])))
print("RUN_ID", summary.mlflow_run_id)
"""


def _config(path: str, steps: int, val_period: int, age: int, tracking_uri: str, root: str) -> dict:
    import yaml

    cfg = yaml.safe_load(Path(path).read_text()) or {}
    cfg.setdefault("grpo", {}).update(
        max_num_steps=steps, val_period=val_period, val_at_start=True, max_trajectory_age_steps=age
    )
    cfg.setdefault("loss", {})["use_importance_sampling_correction"] = age > 0
    cfg.setdefault("checkpointing", {}).update(checkpoint_period=steps, keep_last_k=1)
    cfg["tracking"] = {
        **cfg.get("tracking", {}),
        "uri": tracking_uri,
        "experiment_name": "grpoflow-async-bench",
        "run_name": f"age-{age}",
    }
    cfg["dataplane"] = {"root": root}
    return cfg


def _measure(client, run_id: str) -> dict:
    run = client.get_run(run_id)
    ends = sorted((m.step, m.timestamp) for m in client.get_metric_history(run_id, "train/loss"))
    intervals = [(b[1] - a[1]) / 1000 for a, b in zip(ends, ends[1:])]
    waits = [m.value for m in client.get_metric_history(run_id, "timing/train/generation")]
    ages = [m.value for m in client.get_metric_history(run_id, "train/avg_trajectory_age")]
    accuracy = sorted(
        (m.step, (m.timestamp - run.info.start_time) / 60_000, m.value)
        for m in client.get_metric_history(run_id, "validation/accuracy")
    )
    return {
        "interval": statistics.median(intervals),
        "wait": statistics.median(waits),
        "age": sum(ages) / len(ages),
        "accuracy": accuracy,
        "minutes": (ends[-1][1] - run.info.start_time) / 60_000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cfg", default="configs/learning.yaml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-period", type=int, default=5)
    parser.add_argument("--ages", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="bench/results/async_grpo.md")
    args = parser.parse_args()

    from mlflow.tracking import MlflowClient

    work = Path(tempfile.mkdtemp(prefix="grpoflow-async-bench-"))
    uri = f"sqlite:///{work}/mlflow.db"
    root = Path(__file__).resolve().parents[1]
    results = {}
    for age in args.ages:
        cfg = _config(args.cfg, args.steps, args.val_period, age, uri, str(work / f"dp-{age}"))
        print(f"[bench] a = {age} ...", flush=True)
        proc = subprocess.run(
            [sys.executable, "-c", _RUN, json.dumps(cfg)],
            cwd=root,
            env=dict(os.environ),
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            sys.exit(f"a = {age} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        run_id = next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RUN_ID "))
        results[age] = _measure(MlflowClient(uri), run_id)

    base = results[args.ages[0]]["interval"]
    val_steps = [s for s, _, _ in results[args.ages[0]]["accuracy"]]
    lines = [
        f"Command: `python -m bench.async_grpo --cfg {args.cfg} --steps {args.steps} --val-period {args.val_period}"
        f" --ages {' '.join(map(str, args.ages))}`; one process per age, one after the other, on this machine.",
        "",
        "| a | median step interval (s) | speed-up vs a = 0 | median generation wait (s) | mean trajectory "
        "age | total (min) | " + " | ".join(f"accuracy @ step {s} (min)" for s in val_steps) + " |",
        "|---:|---:|---:|---:|---:|---:|" + "---:|" * len(val_steps),
    ]
    for age, r in results.items():
        acc = " | ".join(f"{v:.3f} ({m:.1f})" for _, m, v in r["accuracy"])
        lines.append(
            f"| {age} | {r['interval']:.2f} | {base / r['interval']:.2f}x | {r['wait']:.2f} | {r['age']:.2f} | "
            f"{r['minutes']:.1f} | {acc} |"
        )
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
