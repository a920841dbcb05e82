"""The async collector's weight hand-over, old against new: the trainer's weights copied to the host (float32) and the
generation copy refitted from there, against a copy on the device in the generation engine's dtype and a refit from it.

    python -m bench.refit --model DIR [--device cuda|cpu] [--precision bfloat16] [--repeats 3]
                          [--json PATH] [--out PATH.md]

The path is the real one of an async local run: the trainer is the transformers policy back-end's model (float32
master weights on the device, ``PolicyBackend.named_weights``), the copy is what
``TrajectoryCollector.set_weight_version`` makes (``tasks.trajectories.copy_weights``; the old way:
``tensor.to("cpu", copy=True)``), and the refit is the transformers generation back-end's (``HFGeneration.refit``:
an in-place copy into its own model, bfloat16 on a GPU). Each way is timed ``--repeats`` times after one warm-up
(median, with the device synchronized), as the copy (what the trainer waits for), the refit (what the collector's
thread does) and their sum, with the bytes each moves. One JSON object per way, ``{"bench": "refit", ...}``, is
appended to ``--json``; ``--out`` gets a markdown table. Both ways must leave the generation copy with the same
weights (checked). Sized to run in under 40 s on one H100 for a 1B Llama (``bench/megatron.py``'s ``random_llama``;
an estimate: two model loads and 2 x 4 hand-overs, the host ones ~5 GB each way); on the CPU the two ways are the
same copy (there is no device), so there it only checks that the bench runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

WAYS = ("host copy + refit", "device copy + refit")
"""The two hand-overs, old then new."""


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(model_dir: str, *, device: str, precision: str, repeats: int) -> list[dict[str, Any]]:
    """Time both hand-overs of the model in ``model_dir`` on ``device``; one row per way (:data:`WAYS`).

    Returns:
        per way: ``way``, ``copy_s``, ``refit_s``, ``total_s`` (medians, seconds), ``copy_gb`` (bytes the copy
        writes, 1e9), ``moved_gb`` (bytes copied in all: the copy, and the refit's copy into the generation model),
        ``params``.

    Raises:
        RuntimeError: the two ways leave the generation copy with different weights.
    """
    import torch

    from rl.backends.hf.generation import HFGeneration
    from rl.backends.hf.model import load_model
    from rl.backends.interfaces import PolicyVersion
    from rl.config import config_from_dict
    from tasks.trajectories import copy_weights

    cfg = config_from_dict({"model": {"precision": precision}})
    trainer = load_model(model_dir, dtype=torch.float32, device=device)  # the float32 master, as the trainer holds it
    weights = lambda: trainer.state_dict().items()  # noqa: E731  (what HFPolicy.named_weights gives)
    gen = HFGeneration(cfg, tokenizer=None, model_path=model_dir)
    gen.refit(PolicyVersion(step=0, path=model_dir), weights=weights())  # loads its own copy, in its dtype
    serving = next(gen._model.parameters()).dtype  # noqa: SLF001  (bf16 on a GPU at bfloat16, else float32)
    cuda_dtype = serving if serving != torch.float32 else None

    copies: dict[str, Callable[[], dict]] = {
        WAYS[0]: lambda: {k: v.detach().to("cpu", copy=True) for k, v in weights()},
        WAYS[1]: lambda: copy_weights(weights(), cuda_dtype=cuda_dtype),
    }
    embedding = trainer.get_input_embeddings().weight
    start = embedding.detach().clone()
    rows, finals = [], {}
    for way, copy in copies.items():
        with torch.no_grad():
            embedding.copy_(start)  # both ways hand over the same versions
        times: list[tuple[float, float]] = []
        for i in range(repeats + 1):  # the first is a warm-up
            with torch.no_grad():
                embedding.add_(1e-3)  # a new version each time
            _sync(device)
            t0 = time.perf_counter()
            held = copy()
            _sync(device)
            t1 = time.perf_counter()
            gen.refit(PolicyVersion(step=i + 1, path="in-process"), weights=held.items())
            _sync(device)
            t2 = time.perf_counter()
            if i:
                times.append((t1 - t0, t2 - t1))
        finals[way] = {k: v.detach().clone() for k, v in gen._model.state_dict().items()}  # noqa: SLF001
        copy_bytes = _bytes(held)
        refit_bytes = sum(t.numel() * t.element_size() for t in gen._model.state_dict().values())  # noqa: SLF001
        copy_s = statistics.median(c for c, _ in times)
        refit_s = statistics.median(r for _, r in times)
        rows.append(
            {
                "way": way,
                "copy_s": copy_s,
                "refit_s": refit_s,
                "total_s": statistics.median(c + r for c, r in times),
                "copy_gb": copy_bytes / 1e9,
                "moved_gb": (copy_bytes + refit_bytes) / 1e9,
                "copy_dtype": str(next(iter(held.values())).dtype).removeprefix("torch."),
                "params": sum(p.numel() for p in trainer.parameters()),
            }
        )
    a, b = finals.values()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    if different:
        msg = f"the two hand-overs left different generation weights, e.g. {different[:3]}"
        raise RuntimeError(msg)
    return rows


def table(rows: list[dict[str, Any]], *, title: str, command: str) -> str:
    """The markdown table of :func:`measure`'s rows (times vs the first row's)."""
    base = rows[0]["total_s"]
    lines = [
        f"# {title}",
        "",
        f"`{command}`",
        "",
        "| hand-over | copy dtype | copy (s) | refit (s) | total (s) | GB copied | GB moved | total vs host copy |",
        "|---|---|---|---|---|---|---|---|",
        *[
            f"| {r['way']} | {r['copy_dtype']} | {r['copy_s']:.4f} | {r['refit_s']:.4f} | {r['total_s']:.4f} | "
            f"{r['copy_gb']:.2f} | {r['moved_gb']:.2f} | {r['total_s'] / base:.2f} |"
            for r in rows
        ],
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face model folder (e.g. bench.megatron's random 1B)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--precision", default="bfloat16", help="model.precision: the generation copy's dtype")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="append one JSON object per hand-over to this file")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device: use --device cpu")
    rows = measure(args.model, device=args.device, precision=args.precision, repeats=args.repeats)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    command = (
        f"python -m bench.refit --model {args.model} --device {args.device} --precision {args.precision} "
        f"--repeats {args.repeats}"
    )
    text = table(rows, title=f"Collector weight hand-over: host copy vs device copy ({name})", command=command)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                common = {"bench": "refit", "device_name": name, "model": args.model, "precision": args.precision}
                f.write(json.dumps({**common, "repeats": args.repeats, **r}) + "\n")
    return rows


if __name__ == "__main__":
    main()
