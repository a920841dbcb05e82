"""What each GRPO variant does on one task: held-out greedy accuracy after the same number of steps, several seeds each.

    python -m bench.variants [--steps 10] [--seeds 1 2 3] [--variants default grpo dr_grpo dapo gspo cispo]

Each run is `configs/learning.yaml` (SmolLM2-135M-Instruct on reasoning-gym chain_sum, 200 questions held out by
content) with a variant's keys on top (`configs/variants/<name>.yaml`; ``default`` adds none), ``--steps`` steps,
validation at the start and at the end, ``grpo.seed`` and ``data.seed`` set to the seed, and
``optim.train_global_batch_size: 16``: four optimizer updates per step (GSPO's paper splits each step into four
mini-batches). With one update per step every ratio pi / pi_old is 1, where GSPO trains exactly as sequence-mean GRPO
and CISPO as the token-level loss (`tests/unit/rl/test_loss_variants.py`), so the variants would differ only in their
advantages and KL settings.

Every run is a fresh process (``--run``) whose result goes to ``--raw-dir``; a run whose result is there is not run
again, so an interrupted benchmark resumes. The table (mean and spread over the seeds, each seed's value) goes to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rl.config import config_from_dict
from rl.config.loading import read_config_source
from tasks.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("default", "grpo", "dr_grpo", "dapo", "gspo", "cispo")


def run_config(variant: str, seed: int, steps: int) -> dict:
    """The nested config of one run: the learning config, the variant's keys, the seed and the step count."""
    cfg = read_config_source(str(REPO / "configs" / "learning.yaml"))
    extra = {} if variant == "default" else read_config_source(str(REPO / "configs" / "variants" / f"{variant}.yaml"))
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    cfg["grpo"].update(max_num_steps=steps, val_period=steps, val_at_start=True, seed=seed)
    cfg["data"]["seed"] = seed
    cfg.setdefault("optim", {})["train_global_batch_size"] = 16
    cfg["checkpointing"] = {"checkpoint_period": steps, "keep_last_k": 1}
    cfg["tracking"] = {
        **cfg.get("tracking", {}),
        "experiment_name": "grpoflow-variants",
        "run_name": f"{variant}-seed{seed}",
    }
    return cfg


def one_run(variant: str, seed: int, steps: int, out: Path) -> None:
    """Train one variant at one seed in this process and write its validation curve and timings to ``out``."""
    from mlflow.tracking import MlflowClient

    from workflows.grpo import grpo

    cfg = config_from_dict(run_config(variant, seed, steps), root=RunConfig)
    t0 = time.time()
    summary = grpo(cfg=cfg)
    wall = time.time() - t0
    client = MlflowClient(cfg.tracking.uri)

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(summary.mlflow_run_id, key)}

    result = {
        "variant": variant,
        "seed": seed,
        "steps": steps,
        "mlflow_run_id": summary.mlflow_run_id,
        "accuracy": history("validation/accuracy"),
        "reward": history("train/reward"),
        "kl_penalty": history("train/kl_penalty"),
        "step_time_s": history("timing/train/total_step_time"),
        "wall_s": wall,
    }
    out.write_text(json.dumps(result, indent=1))


def summarize(results: list[dict], steps: int, seeds: list[int], variants: list[str], command: str) -> str:
    """The markdown table: per variant, the held-out accuracy at step 0 and at ``steps`` over the seeds."""
    lines = [
        f"# GRPO variants on the learning config, {steps} steps, seeds {', '.join(map(str, seeds))}",
        "",
        f"Command: `{command}`; {platform.machine()}, {time.strftime('%Y-%m-%d')}. `configs/learning.yaml` plus each "
        "variant's `configs/variants/<name>.yaml`, 4 optimizer updates per step (`optim.train_global_batch_size: "
        "16`), greedy accuracy on the 200 held-out chain_sum questions. Mean and sample std over the seeds; each "
        "seed's value in brackets.",
        "",
        f"| variant | step 0 | step {steps}, mean ± std | step {steps}, per seed | mean train reward, last 5 "
        f"steps | KL to the reference at step {steps} | median step (s) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for v in variants:
        runs = sorted((r for r in results if r["variant"] == v), key=lambda r: r["seed"])
        if not runs:
            continue
        start = [r["accuracy"].get("0", r["accuracy"].get(0)) for r in runs]
        end = [r["accuracy"].get(str(steps), r["accuracy"].get(steps)) for r in runs]
        late = [statistics.mean(val for k, val in r["reward"].items() if int(k) > steps - 5) for r in runs]
        kl = [r["kl_penalty"].get(str(steps), r["kl_penalty"].get(steps)) for r in runs]
        times = [t for r in runs for t in r["step_time_s"].values()]
        spread = statistics.stdev(end) if len(end) > 1 else 0.0
        lines.append(
            f"| {v} | {statistics.mean(start):.3f} | {statistics.mean(end):.3f} ± {spread:.3f} | "
            f"[{', '.join(f'{x:.3f}' for x in end)}] | {statistics.mean(late):.3f} | "
            f"{statistics.mean(kl):.3f} | {statistics.median(times):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps per run (4 optimizer updates each)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument(
        "--raw-dir", default="runs/bench_variants", help="one JSON result per run (an existing one is not run again)"
    )
    parser.add_argument("--out", default="bench/results/variants.md")
    parser.add_argument(
        "--run", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS
    )  # one run, in this process
    args = parser.parse_args()
    raw = Path(args.raw_dir)
    raw.mkdir(parents=True, exist_ok=True)
    if args.run:
        variant, seed = args.run[0], int(args.run[1])
        one_run(variant, seed, args.steps, raw / f"{variant}_seed{seed}_{args.steps}steps.json")
        return
    results = []
    for seed in args.seeds:  # seeds outermost: a partial benchmark already compares every variant
        for variant in args.variants:
            path = raw / f"{variant}_seed{seed}_{args.steps}steps.json"
            if not path.exists():
                print(f"[variants] {variant} seed {seed}: {args.steps} steps ...", flush=True)
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.variants",
                    "--steps",
                    str(args.steps),
                    "--raw-dir",
                    str(raw),
                    "--run",
                    variant,
                    str(seed),
                ]
                subprocess.run(cmd, cwd=REPO, check=True)
            result = json.loads(path.read_text())
            print(f"[variants] {variant} seed {seed}: accuracy {result['accuracy']}", flush=True)
            results.append(result)
    command = f"python -m bench.variants --steps {args.steps} --seeds {' '.join(map(str, args.seeds))}"
    text = summarize(results, args.steps, args.seeds, args.variants, command)
    print(text)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
