"""Where a decode call's time goes: our loops and transformers ``generate`` on one model, each profiled with
``torch.profiler`` (CPU and CUDA) after a warm-up call, in a process holding only that model.

    python -m bench.profile_decode (--model DIR | --random-shape {135M,1B} --tokenizer DIR) [--prompts 64] [--group 8]
        [--max-new-tokens 64] [--rows 12] [--variants generate,dynamic,...] [--device cuda] [--out PATH]

Per variant: the wall seconds of one call and its tok/s, the sum of CUDA kernel time (what the GPU was busy with;
wall minus that is the GPU waiting for the host), and the ``--rows`` most expensive operators by CUDA time.
Variants: ``generate`` (transformers, sampling as ``bench/step.py``'s baseline), ``dynamic`` / ``static`` /
``graphs`` (``rl.backends.hf.decode.generate``'s loops under the decode pin), ``dynamic_torch`` (the dynamic loop
under torch's own SDPA choice) and ``dynamic_nosync`` (the dynamic loop reading the open rows only at the end).
The model is loaded (``--random-shape``: built in memory from ``bench.megatron.SIZES``, random weights) in bf16 with
SDPA attention, as the generation back-end holds it on a GPU; the prompts are random token ids of 90 to 130 tokens
(seeded), each repeated ``--group`` times. ``--device cpu`` only checks the script runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

VARIANTS = ("generate", "dynamic", "dynamic_torch", "dynamic_nosync", "static", "graphs")


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model")
    which.add_argument("--random-shape", choices=["135M", "1B"])
    p.add_argument("--tokenizer", help="tokenizer folder of --random-shape")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--variants", default="generate,dynamic,dynamic_torch,dynamic_nosync,graphs")
    p.add_argument("--out")
    args = p.parse_args(argv)
    bad = [v for v in args.variants.split(",") if v not in VARIANTS]
    if bad:
        p.error(f"unknown --variants {bad}: use names of {list(VARIANTS)}")
    import torch
    from torch.profiler import ProfilerActivity, profile

    import rl.backends.hf.decode as decode
    from rl.model import load_tokenizer
    from rl.precision import device_generator

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    dev = torch.device(args.device)
    tok = load_tokenizer(args.model or args.tokenizer)
    if args.model:
        from rl.backends.hf.model import load_model

        model = load_model(args.model, "sdpa", dtype=torch.bfloat16, device=dev)
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from bench.megatron import SIZES

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tok), max_position_embeddings=8192, tie_word_embeddings=True, **SIZES[args.random_shape]
        )
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(90, 131, (args.prompts,), generator=gen).tolist()
    prompts = [torch.randint(100, len(tok) - 1, (n,), generator=gen).tolist() for n in lengths]
    rows = [q for q in prompts for _ in range(args.group)]
    batch = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt").to(dev)
    t_max = args.max_new_tokens

    def sync_device() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def ours(loop: str, pin: str | None = None):  # noqa: ANN202
        def call(seed: int) -> int:
            out = decode.generate(
                model,
                tok,
                rows,
                max_new_tokens=t_max,
                precision="bfloat16",
                generator=device_generator(dev, seed),
                loop=loop,
                **({} if pin is None else {"sdpa_pin": pin}),
            )
            return int(out.response_lengths.sum())

        return call

    def base(seed: int) -> int:
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model.generate(
                **batch,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                max_new_tokens=t_max,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        return int((out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0])

    calls = {
        "generate": base,
        "dynamic": ours("dynamic"),
        "dynamic_torch": ours("dynamic", "torch"),
        "dynamic_nosync": ours("dynamic"),
        "static": ours("static"),
        "graphs": ours("graphs"),
    }
    report = [
        f"# decode profile: {args.random_shape or Path(args.model).name}, {len(rows)} rows ({args.prompts} x "
        f"{args.group}), T = {t_max}, prompt width {batch['input_ids'].shape[1]}, "
        f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}",
        "",
    ]
    for name in args.variants.split(","):
        sync = decode.SYNC_EVERY
        if name == "dynamic_nosync":
            decode.SYNC_EVERY = 1 << 30
        try:
            calls[name](1)
            sync_device()
            t0 = time.perf_counter()
            n = calls[name](2)
            sync_device()
            wall = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                calls[name](3)
                sync_device()
        finally:
            decode.SYNC_EVERY = sync
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e6  # kernels' own time, s
        report += [
            f"## {name}: {wall:.3f} s wall, {n / wall:,.0f} tok/s; CUDA kernels {busy:.3f} s (profiled call)",
            "",
            "```",
            events.table(
                sort_by="self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total",
                row_limit=args.rows,
                max_name_column_width=60,
            ),
            "```",
            "",
        ]
        print("\n".join(report[-6:]), flush=True)
        if args.out:  # after every variant: a run stopped by a time limit keeps what it measured
            Path(args.out).write_text("\n".join(report))
    return "\n".join(report)


if __name__ == "__main__":
    main()
