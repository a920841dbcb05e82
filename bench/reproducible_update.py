"""Cost and effect of running the GRPO update with torch's deterministic algorithms (``optim.deterministic``,
`rl/backends/engine.py` ``update_settings``), side by side in one process.

    python -m bench.reproducible_update [--repeats 3] [--precision float32] [--out bench/results/reproducible_update.md]

One step's batch (8 prompts x 8 completions of the real SmolLM2-135M-Instruct, sampled by ours, as in
`bench.agreement`), then `train_on_batch` from the same weights and optimizer state, alternating the two modes each
round: "deterministic" (what the trainer runs) and "default" (the same update with the setting left off). Reported:
the median wall time of an update per mode, their ratio, and how many distinct updated weights each mode gave over
its repeats (1 = bit for bit reproducible). Threads: torch's default here, or GRPOFLOW_NUM_THREADS.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import platform
import statistics
import time
from pathlib import Path

from rl.backends.hf.model import load_model
from rl.config import config_from_dict
from rl.data import train_problems
from rl.model import load_tokenizer, resolve_model
from tasks.runtime import set_threads

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="updates per mode (the modes alternate)")
    parser.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", default="bench/results/reproducible_update.md")
    args = parser.parse_args()

    import torch

    import rl.backends.hf.train as train
    from bench.agreement import _rollout_batch

    set_threads()
    path = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(path)
    cfg = config_from_dict({"model": {"name": path, "precision": args.precision}})
    d = cfg.data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=0, count=8
    )
    torch.manual_seed(0)
    base = load_model(path)
    batch, _ = _rollout_batch(base, tok, cfg, problems)
    modes = {"deterministic": True, "default": False}  # optim.deterministic
    times: dict[str, list[float]] = {m: [] for m in modes}
    digests: dict[str, set[str]] = {m: set() for m in modes}
    for round_ in range(args.repeats):
        for mode, ctx in modes.items():
            model = copy.deepcopy(base)
            run = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, deterministic=ctx))
            opt, sched = train.make_optimizer(model, run)
            t0 = time.perf_counter()
            train.train_on_batch(model, opt, sched, batch, run)
            times[mode].append(time.perf_counter() - t0)
            h = hashlib.sha256()
            for p in model.parameters():
                h.update(p.detach().contiguous().numpy().tobytes())
            digests[mode].add(h.hexdigest()[:12])
            print(
                f"[reproducible_update] round {round_ + 1}/{args.repeats} {mode}: {times[mode][-1]:.2f} s, weights "
                f"{h.hexdigest()[:12]}",
                flush=True,
            )
    med = {m: statistics.median(t) for m, t in times.items()}
    text = "\n".join(
        [
            "# The GRPO update with and without torch's deterministic algorithms",
            "",
            f"Command: `python -m bench.reproducible_update --repeats {args.repeats} --precision {args.precision}`; "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads, torch "
            f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}. One step's batch (8 x 8 rollouts of "
            "SmolLM2-135M-Instruct), the same starting weights each time, the modes alternating.",
            "",
            "| mode | update wall time, median (s) | every run (s) | distinct updated weights over the runs |",
            "|---|---:|---|---:|",
            *(
                f"| {m} | {med[m]:.2f} | {', '.join(f'{x:.2f}' for x in times[m])} | {len(digests[m])} of "
                f"{len(times[m])} |"
                for m in modes
            ),
            "",
            f"Time ratio deterministic / default: **{med['deterministic'] / med['default']:.3f}**.",
        ]
    )
    print(text)
    (REPO / args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
