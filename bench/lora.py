"""Full fine-tuning against a LoRA adapter, side by side: one GRPO step's seconds per phase, the peak memory of the
steps, the trainable parameters, and a checkpoint's size and save time.

    python -m bench.lora [--model DIR | --random-shape {135M,1B}] [--tokenizer DIR] [--device {cpu,cuda}]
        [--prompts 8] [--group 8] [--max-new-tokens 64] [--repeats 3] [--saves 3]
        [--rank 16] [--alpha 2R] [--targets all-linear] [--precision auto] [--workdir DIR] [--json PATH]
        [--out bench/results/lora.md]

Each side is ``python -m bench.step`` (see its docstring for what a step runs and how each phase is timed) in its own
fresh process, full fine-tuning first, then LoRA, with the same arguments and ``--no-decode --saves N``; the LoRA side
adds ``--lora-rank R --lora-alpha A --lora-targets T`` (``policy.lora``, `rl.lora`). A process's peak memory is its
own: on CPU the peak resident set (``VmHWM``), on CUDA ``torch.cuda.max_memory_allocated``, over the steps. Under LoRA
the reference policy is the policy's own base with the adapter disabled (no second model) and AdamW holds state only
for the adapter, so the difference is the reference model, the gradients and the optimizer state of the frozen
weights. The checkpoint is ``policy.save_checkpoint(url, trainer_state=...)``, what a run saves: the weights, or
the adapter only, plus the tokenizer, the optimizer and RNG state; its bytes, and the median seconds of ``--saves``
saves, each into a fresh folder. A ``--random-shape`` model is built once, before either side starts, and shared.
``GRPOFLOW_NUM_THREADS`` / ``OMP_NUM_THREADS`` pass through to both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.step import PHASES, add_step_args, lora_label, model_path
from rl.config.sections import LORA_ALL_LINEAR

REPO = Path(__file__).resolve().parents[1]

SIDES = ("full", "lora")
"""The two runs, in the order they run: full fine-tuning, then the LoRA adapter."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.lora", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_step_args(p, prompts=8, group=8, max_new_tokens=64, repeats=3, steps_of=" per side")
    p.add_argument("--saves", type=int, default=3, help="timed checkpoint saves per side (the median is reported)")
    p.add_argument("--rank", type=int, default=16, help="policy.lora.rank of the LoRA side")
    p.add_argument("--alpha", type=float, help="policy.lora.alpha of the LoRA side (default: twice --rank)")
    p.add_argument(
        "--targets", default=LORA_ALL_LINEAR, help="policy.lora.target_modules of the LoRA side, comma-separated"
    )
    p.add_argument("--precision", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--workdir", help="data plane, checkpoints and random models (default: a temporary folder)")
    p.add_argument("--json", help="append one JSON object (both sides' records) to this file")
    p.add_argument("--out", default="bench/results/lora.md", help="the markdown table (relative to the repository)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.prompts < 1 or args.group < 2 or args.max_new_tokens < 1 or args.saves < 1:
        p.error("use --repeats >= 1, --saves >= 1, --prompts >= 1, --group >= 2 and --max-new-tokens >= 1")
    if args.rank < 1:
        p.error(f"--rank is {args.rank}: use a LoRA rank of 1 or more, e.g. 16")
    if args.alpha is None:
        args.alpha = 2.0 * args.rank
    return args


def side_command(args: argparse.Namespace, side: str, *, workdir: str, json_path: str) -> list[str]:
    """The ``python -m bench.step`` command line of ``side`` (one of :data:`SIDES`): the shared arguments, no decode
    comparison, ``--saves``, and for ``lora`` the adapter's settings."""
    cmd = [sys.executable, "-m", "bench.step"]
    if args.model:
        cmd += ["--model", args.model]
    if args.random_shape:
        cmd += ["--random-shape", args.random_shape]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if args.device:
        cmd += ["--device", args.device]
    cmd += [
        *("--prompts", str(args.prompts), "--group", str(args.group)),
        *("--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)),
        *("--precision", args.precision, "--saves", str(args.saves), "--no-decode"),
        *("--workdir", workdir, "--json", json_path),
    ]
    if side == "lora":
        cmd += ["--lora-rank", str(args.rank), "--lora-alpha", f"{args.alpha:g}", "--lora-targets", args.targets]
    return cmd


def run_side(side: str, cmd: list[str], json_path: Path) -> dict[str, Any]:
    """Run ``cmd`` (its table and progress go to stderr) and return the last record it appended to ``json_path``.

    Raises:
        SystemExit: the process failed, or wrote no whole record.
    """
    print(f"[bench.lora] {side}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=sys.__stderr__, check=False)
    lines = json_path.read_text().splitlines() if json_path.exists() else []
    record = json.loads(lines[-1]) if lines else {}
    if proc.returncode or not record or record.get("partial"):
        raise SystemExit(
            f"bench.lora: the {side} side failed (exit {proc.returncode}, "
            f"{'a partial record' if record else 'no record'} in {json_path}); its output is above. "
            f"Rerun it alone to debug: {shlex.join(cmd)}"
        )
    return record


def ratio(full: float | None, lora: float | None) -> float | None:
    """``lora / full``; None where either is missing or ``full`` is 0."""
    return None if full is None or lora is None or full == 0 else lora / full


def figures(r: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """``(label, value, format)`` of one side's :mod:`bench.step` record, in table order."""
    ckpt = r.get("checkpoint") or {}
    saves = len(ckpt.get("save_s_all", []))

    def mib(key: str) -> float | None:
        return ckpt[key] / 2**20 if key in ckpt else None

    return [
        ("step (s, median)", r["step_s"], ".3f"),
        *((f"{p} (s)", r["phases"][p], ".3f") for p in PHASES),
        ("clear the partition (s)", r["dataplane"]["clear"], ".3f"),
        ("warm-up step (s)", r["warmup_step_s"], ".3f"),
        (f"peak memory of the steps (GiB, {r['peak_memory_source']})", r["peak_memory_gib"], ".2f"),
        ("trainable parameters", r["trainable_params"], ",.0f"),
        ("checkpoint with trainer state (MiB)", mib("bytes"), ",.1f"),
        ("of which trainer state (MiB)", mib("trainer_state_bytes"), ",.1f"),
        (f"checkpoint save (s, median of {saves})", ckpt.get("save_s"), ".3f"),
    ]


def compare(full: dict[str, Any], lora: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure: ``{"figure", "full", "lora", "ratio", "format"}`` (ratio: LoRA / full)."""
    return [
        {"figure": label, "full": a, "lora": b, "ratio": ratio(a, b), "format": fmt}
        for (label, a, fmt), (_, b, _) in zip(figures(full), figures(lora), strict=True)
    ]


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _ratio_cell(value: float | None) -> str:
    """Three decimals, or three significant digits below 0.1 (a trainable-parameter ratio is often 0.00x)."""
    return _cell(value, ".3f" if value is None or value >= 0.1 else ".3g")


def machine() -> str:
    """This machine in a line: OS, CPU count and the thread settings the sides inherit."""
    threads = ", ".join(f"{k}={os.environ[k]}" for k in ("GRPOFLOW_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ)
    return f"{platform.platform()}, {os.cpu_count()} CPUs" + (f", {threads}" if threads else "")


def table(full: dict[str, Any], lora: dict[str, Any], *, command: str, machine_line: str) -> str:
    """The markdown comparison of the two sides' :mod:`bench.step` records."""
    timed = full["timed_steps"]
    lines = [
        f"# Full fine-tuning against LoRA ({lora_label(lora['lora'])}): one GRPO step "
        f"({full['device']}: {full['device_name']}, torch {full['torch']}, transformers {full['transformers']})",
        "",
        f"`{command}`",
        "",
        f"Model {full['shape']} ({full['params'] / 1e6:.1f}M parameters), B x G x T = {full['prompts']} x "
        f"{full['group']} x {full['max_new_tokens']}, precision {full['precision_requested']} -> "
        f"{full['precision']}, {full['policy_backend']} policy, {full['generation_backend']} generation; each side "
        f"`python -m bench.step` in its own process (full first), median of {timed} step(s) after a warm-up step. "
        f"Machine: {machine_line}.",
        "",
        "| figure | full fine-tuning | LoRA | LoRA / full |",
        "|---|---:|---:|---:|",
        *(
            f"| {row['figure']} | {_cell(row['full'], row['format'])} | {_cell(row['lora'], row['format'])} | "
            f"{_ratio_cell(row['ratio'])} |"
            for row in compare(full, lora)
        ),
        "",
        "Sides:",
        "",
        *(f"- {side}: `{r['command']}`" for side, r in zip(SIDES, (full, lora), strict=True)),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench.lora", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        workdir = Path(args.workdir or tmp).resolve()
        if args.random_shape:  # built here once: neither side's time or memory includes it
            model_path(args, workdir)
        records = {}
        for side in SIDES:
            json_path = Path(tmp) / f"{side}.jsonl"
            cmd = side_command(args, side, workdir=str(workdir), json_path=str(json_path))
            records[side] = run_side(side, cmd, json_path)
    text = table(records["full"], records["lora"], command=command, machine_line=machine())
    print(text, end="")
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    result = {"command": command, "machine": machine(), **records}
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
