"""Two parts of ``scripts/gpu_check.sh`` that need Python (each appends one JSON object to ``--results``):

python scripts/gpu_check.py env --results OUT/results.jsonl
    the imports the GPU-side code needs (rl, dataplane, tensordict, megatron.core, reasoning_gym, mashumaro), their
    versions, torch/CUDA/transformers versions and the device (name, memory, driver); exit 1 if an import fails.
python scripts/gpu_check.py models --results OUT/results.jsonl --dir CACHE/models --tokenizer DIR SIZE ...
    random-weight Llamas: ``135M``/``1B``/... of ``bench.megatron.SIZES`` (``random_llama``), ``tiny`` the 2-layer
    test model (``rl.model.build_tiny_model``), each into ``DIR/<size>`` unless already there (written under a
    temporary name and renamed, so a folder there is complete; ``bench.step --workdir`` finds them the same way).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

IMPORTS = ("rl", "dataplane", "tensordict", "megatron.core", "reasoning_gym", "mashumaro")
"""What the GPU-side code imports beyond the target's own packages."""

DEEP_IMPORTS = ("rl.config", "rl.data", "rl.backends.hf.policy", "rl.backends.megatron.policy", "dataplane.client")
"""Modules of ours whose imports reach those packages (a missing dependency of theirs shows here)."""

DISTRIBUTIONS = {"megatron.core": "megatron-core", "reasoning_gym": "reasoning-gym"}


def append(results: str, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(results, "a") as f:
        f.write(json.dumps(record) + "\n")


def _version(module: str) -> str | None:
    try:
        return metadata.version(DISTRIBUTIONS.get(module, module))
    except metadata.PackageNotFoundError:
        mod = sys.modules.get(module)
        return getattr(mod, "__version__", None)


def _nvidia_smi() -> dict:
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            .stdout.strip()
            .splitlines()
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if not out:
        return {}
    name, memory, driver = (x.strip() for x in out[0].split(","))
    return {"smi_name": name, "smi_memory": memory, "driver": driver}


def env(results: str) -> int:
    t0 = time.perf_counter()
    record: dict = {"part": "env", "python": sys.version.split()[0]}
    errors = {}
    for module in ("torch", "transformers", *IMPORTS, *DEEP_IMPORTS):
        try:
            importlib.import_module(module)
            if module not in DEEP_IMPORTS:
                record[module] = _version(module) if module not in ("rl", "dataplane") else "ok"
        except Exception as err:  # any failure to import is what this part reports
            errors[module] = f"{type(err).__name__}: {str(err)[:300]}"
    torch = sys.modules.get("torch")
    if torch is not None:
        record["torch_cuda"] = torch.version.cuda
        record["cuda_available"] = torch.cuda.is_available()
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record |= {
            "device_name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "devices": torch.cuda.device_count(),
        }
    record |= _nvidia_smi()
    if errors:
        record["import_errors"] = errors
    record["s"] = round(time.perf_counter() - t0, 1)
    append(results, record)
    return 1 if errors else 0


def models(results: str, root: Path, tokenizer: str, sizes: list[str]) -> int:
    from bench.megatron import random_llama
    from rl.model import build_tiny_model

    root.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        t0 = time.perf_counter()
        target = root / size
        reused = target.exists()
        if not reused:
            tmp = target.with_name(f".{size}.tmp-{os.getpid()}")
            if size == "tiny":
                build_tiny_model(tmp, tokenizer_source=tokenizer)
            else:
                random_llama(tmp, size, tokenizer)
            tmp.rename(target)
        size_mb = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) / 1e6
        append(
            results,
            {
                "part": "models",
                "size": size,
                "path": str(target),
                "reused": reused,
                "mb": round(size_mb),
                "s": round(time.perf_counter() - t0, 1),
            },
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("env")
    e.add_argument("--results", required=True)
    m = sub.add_parser("models")
    m.add_argument("--results", required=True)
    m.add_argument("--dir", required=True)
    m.add_argument("--tokenizer", required=True)
    m.add_argument("sizes", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "env":
        return env(args.results)
    return models(args.results, Path(args.dir), args.tokenizer, args.sizes)


if __name__ == "__main__":
    sys.exit(main())
