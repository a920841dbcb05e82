"""Time and memory of one optimizer update against `optim.train_micro_batch_size`.

    python -m bench.micro_batch [--sizes 8,16,32] [--repeats 3] [--out bench/results/micro_batch.md]

One step's batch (8 prompts x 8 completions of the real model, sampled by ours, as in `bench.agreement`), then
`rl.backends.hf.train.train_on_batch` in bf16 at each micro-batch size, each in a fresh subprocess (peak RSS is per
process; the sizes take turns, `--repeats` rounds, medians reported): wall time of the update and how far it raises the
process's peak RSS above the model, its AdamW state and the rollout that made the batch. Same batch and same gradient at
every size (micro-batches only split the sum); larger micro-batches run fewer, larger matmuls and hold more activations.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rl.backends.hf.model import load_model
from rl.config import config_from_dict
from rl.data import train_problems
from rl.model import load_tokenizer, resolve_model
from tasks.runtime import set_threads

REPO = Path(__file__).resolve().parents[1]


def measure(size: int) -> dict:
    import torch

    from bench.agreement import _rollout_batch
    from rl.backends.hf.train import make_optimizer, train_on_batch

    set_threads()
    path = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(path)
    cfg = config_from_dict(
        {
            "model": {"name": path, "precision": "bfloat16"},
            "optim": {"train_micro_batch_size": size, "logprob_batch_size": size},
        }
    )
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=8
    )
    torch.manual_seed(0)
    model = load_model(path)
    batch, _ = _rollout_batch(model, tok, cfg, problems)
    opt, sched = make_optimizer(model, cfg)
    for p in model.parameters():  # allocate AdamW's state first: it is not what the micro-batch changes
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    train_on_batch(model, opt, sched, batch, cfg)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"size": size, "seconds": seconds, "peak_before": before, "peak_after": after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8,16,32", help="comma-separated micro-batch sizes (each divides 64)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the sizes (medians are reported)")
    parser.add_argument("--out", default="bench/results/micro_batch.md")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure(args.one)), flush=True)
        return
    sizes = [int(x) for x in args.sizes.split(",")]
    if any(s < 1 or 64 % s for s in sizes):
        parser.error(f"--sizes {args.sizes}: each size must divide the 64 samples of the step")
    runs: dict[int, list[dict]] = {size: [] for size in sizes}
    for round_ in range(args.repeats):  # sizes take turns, so a drift in machine speed hits them alike
        for size in sizes:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.micro_batch", "--one", str(size)],
                cwd=REPO,
                capture_output=True,
                text=True,
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"micro-batch {size} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs[size].append(json.loads(lines[-1].removeprefix("RESULT ")))
            print(
                f"[micro_batch] round {round_ + 1}/{args.repeats}, size {size}: {runs[size][-1]['seconds']:.1f} s",
                flush=True,
            )
    rows = [
        {
            "size": size,
            "seconds": statistics.median(r["seconds"] for r in rs),
            "all_seconds": [r["seconds"] for r in rs],
            "peak_before": statistics.median(r["peak_before"] for r in rs),
            "added": statistics.median(r["peak_after"] - r["peak_before"] for r in rs),
        }
        for size, rs in runs.items()
    ]
    gib = 2**30
    text = "\n".join(
        [
            "# One optimizer update (64 samples, bf16) against the micro-batch size",
            "",
            f"Command: `python -m bench.micro_batch --sizes {args.sizes} --repeats {args.repeats}`; each run in its "
            "own process, medians.",
            "",
            "| train_micro_batch_size | update wall time (s) | every run (s) | peak RSS before (GiB) | peak RSS "
            "added by the update (GiB) |",
            "|---:|---:|---|---:|---:|",
            *(
                f"| {r['size']} | {r['seconds']:.1f} | {', '.join(f'{x:.1f}' for x in r['all_seconds'])} | "
                f"{r['peak_before'] / gib:.2f} | {r['added'] / gib:.2f} |"
                for r in rows
            ),
        ]
    )
    print(text)
    (REPO / args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
