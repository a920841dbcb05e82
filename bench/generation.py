"""Generation back-ends side by side: our transformers decode loop against vLLM, on the real model and problems.

    python bench/generation.py                     # both back-ends, both shapes, then a default step with each
    python bench/generation.py --repeats 1 --shapes 8x8x32 --no-step   # quick look

For each back-end, in a fresh subprocess of this script (one after the other, never concurrently):

1. the engine: construct and load SmolLM2-135M-Instruct at ``model.precision: auto`` (timed: ``load_s``);
2. one untimed warm-up call, then for each shape ``B x G x T`` (B chain_sum prompts, G completions each, at most T
   new tokens, temperature 1) ``--repeats`` calls with different seeds through
   ``GenerationBackend.generate``, exactly as the rollout task calls it: rollout time and generated tokens/s
   (generated tokens = response tokens, eos included), median over repeats;
3. with ``--step`` (default), the default workflow (``pyflyte run workflows/grpo.py grpo``'s config, 2 steps, no
   validation) with ``generation.backend`` set, each in its own subprocess: ``timing/train/total_step_time`` and
   ``timing/train/generation`` of step 1 (cold: it loads the engine) and step 2 (warm), read back from MLflow.

Prints a markdown table (also written to ``--out``) with vLLM / transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO / "bench"]  # bench/dataplane.py
sys.path.insert(0, str(REPO))

from rl.backends import registry  # noqa: E402
from rl.backends.interfaces import PolicyVersion  # noqa: E402
from rl.data import prompt_token_ids, train_problems  # noqa: E402
from rl.model import load_tokenizer, resolve_model  # noqa: E402
from tasks.run_config import run_config_from_dict  # noqa: E402

BACKENDS = ("transformers", "vllm")


def _config(backend: str, workdir: Path, *, max_new_tokens: int = 32, steps: int | None = None):
    data = {
        "generation": {"backend": backend, "max_new_tokens": max_new_tokens, "vllm_cfg": {"cpu_kv_cache_gib": 4.0}},
        "dataplane": {"root": str(workdir / "dp")},
        "tracking": {"uri": f"sqlite:///{workdir}/mlflow.db", "experiment_name": "bench-generation"},
    }
    if steps is not None:
        data["grpo"] = {"max_num_steps": steps, "val_period": 0}
    return run_config_from_dict(data)


def child_generate(spec: dict) -> dict:
    """Time one back-end on every shape (runs in its own process)."""
    import torch

    torch.set_num_threads(spec["threads"])
    model = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(model)
    out: dict = {"shapes": {}}
    longest = max(t for _, _, t in spec["shapes"])
    cfg = _config(spec["backend"], Path(spec["workdir"]), max_new_tokens=longest)
    t0 = time.perf_counter()
    gen = registry.load("generation", spec["backend"])(cfg, tokenizer=tok, model_path=model)
    gen.refit(PolicyVersion(step=0, path=model))
    out["load_s"] = time.perf_counter() - t0
    d = cfg.data
    for b, g, t in spec["shapes"]:
        cfg.generation.max_new_tokens = t  # the back-ends read it per call
        problems = train_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.seed,
            val_fraction=d.val_fraction,
            start=0,
            count=b,
        )
        prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]
        gen.generate(prompts[:2], group_size=2, seed=999)  # warm-up
        times, tokens = [], []
        for r in range(spec["repeats"]):
            t0 = time.perf_counter()
            res = gen.generate(prompts, group_size=g, seed=r)
            times.append(time.perf_counter() - t0)
            tokens.append(int(res.response_lengths.sum()))
        out["shapes"][f"{b}x{g}x{t}"] = {"times_s": times, "tokens": tokens}
    gen.shutdown()
    return out


def child_step(spec: dict) -> dict:
    """Two steps of the default workflow with ``generation.backend`` set (runs in its own process)."""
    from mlflow.tracking import MlflowClient

    from workflows.grpo import grpo

    cfg = _config(spec["backend"], Path(spec["workdir"]), steps=2)
    t0 = time.perf_counter()
    summary = grpo(cfg=cfg)
    wall = time.perf_counter() - t0
    c = MlflowClient(cfg.tracking.uri)

    def per_step(key: str) -> list[float]:
        return [m.value for m in sorted(c.get_metric_history(summary.mlflow_run_id, key), key=lambda m: m.step)]

    return {
        "wall_s": wall,
        "total_step_time": per_step("timing/train/total_step_time"),
        "generation": per_step("timing/train/generation"),
        "reward": per_step("train/reward"),
        "token_mult_prob_error": per_step("train/token_mult_prob_error"),
    }


def run_child(kind: str, spec: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-gen-") as tmp:
        spec = {**spec, "workdir": tmp}
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "GRPOFLOW_NUM_THREADS": str(spec["threads"])}
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--child",
            kind,
            "--spec",
            str(spec_path),
            "--result",
            str(result_path),
        ]
        print(f"[bench] {kind} {spec['backend']} ...", flush=True)
        subprocess.run(cmd, check=True, cwd=tmp, env=env)
        return json.loads(result_path.read_text())


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def report(gen: dict[str, dict], steps: dict[str, dict], args: argparse.Namespace) -> str:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b else "n/a"

    lines = [
        "# Generation back-ends: transformers decode loop vs vLLM",
        "",
        f"`python bench/generation.py --repeats {args.repeats} --shapes "
        f"{','.join(args.shapes)}{'' if args.step else ' --no-step'}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
        f"threads; {time.strftime('%Y-%m-%d')}. Real SmolLM2-135M-Instruct, chain_sum prompts, temperature 1, "
        "`model.precision: auto`.",
        "",
        "| | transformers | vLLM | vLLM / transformers |",
        "|---|---:|---:|---:|",
        f"| engine load (s) | {gen['transformers']['load_s']:.1f} | {gen['vllm']['load_s']:.1f} | "
        f"{ratio(gen['vllm']['load_s'], gen['transformers']['load_s'])} |",
    ]
    for shape in gen["transformers"]["shapes"]:
        h, v = gen["transformers"]["shapes"][shape], gen["vllm"]["shapes"][shape]
        th, tv = _med(h["times_s"]), _med(v["times_s"])
        rh = _med([n / t for n, t in zip(h["tokens"], h["times_s"])])
        rv = _med([n / t for n, t in zip(v["tokens"], v["times_s"])])
        lines.append(
            f"| {shape}: rollout time (s), median of {len(h['times_s'])} | {th:.2f} | {tv:.2f} | {ratio(tv, th)} |"
        )
        lines.append(f"| {shape}: generated tokens/s | {rh:.1f} | {rv:.1f} | {ratio(rv, rh)} |")
        lines.append(f"| {shape}: generated tokens per call | {_med(h['tokens']):.0f} | {_med(v['tokens']):.0f} | |")
    if steps:
        h, v = steps["transformers"], steps["vllm"]
        for i, name in enumerate(("step 1 (cold: loads the engine)", "step 2 (warm)")):
            lines.append(
                f"| default run, {name}: total step time (s) | {h['total_step_time'][i]:.1f} | "
                f"{v['total_step_time'][i]:.1f} | {ratio(v['total_step_time'][i], h['total_step_time'][i])} |"
            )
            lines.append(
                f"| default run, {name}: generation (s) | {h['generation'][i]:.1f} | "
                f"{v['generation'][i]:.1f} | {ratio(v['generation'][i], h['generation'][i])} |"
            )
        lines.append(
            "| default run: token_mult_prob_error per step | "
            f"{', '.join(f'{x:.4f}' for x in h['token_mult_prob_error'])} | "
            f"{', '.join(f'{x:.4f}' for x in v['token_mult_prob_error'])} | |"
        )
        lines.append(
            f"| default run: wall time of 2 steps (s) | {h['wall_s']:.0f} | {v['wall_s']:.0f} | "
            f"{ratio(v['wall_s'], h['wall_s'])} |"
        )
    lines += ["", "Raw: " + json.dumps({"generate": gen, "steps": steps})]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per shape and back-end")
    parser.add_argument("--shapes", type=lambda v: v.split(","), default=["8x8x32", "32x8x128"], help="BxGxT list")
    parser.add_argument("--step", action=argparse.BooleanOptionalAction, default=True, help="also time a default step")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="bench/results/generation.md")
    parser.add_argument("--child", choices=["generate", "step"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        fn = child_generate if args.child == "generate" else child_step
        Path(args.result).write_text(json.dumps(fn(spec)))
        return
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    if any(len(s) != 3 for s in shapes):
        parser.error("--shapes takes BxGxT entries, e.g. 8x8x32,32x8x128")
    base = {"repeats": args.repeats, "shapes": shapes, "threads": args.threads}
    gen = {b: run_child("generate", {**base, "backend": b}) for b in BACKENDS}
    steps = {b: run_child("step", {**base, "backend": b}) for b in BACKENDS} if args.step else {}
    text = report(gen, steps, args)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
