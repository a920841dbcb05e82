"""What the node model cache's content check costs: the first check of a cached copy in a process hashes every file
(SHA-256, :func:`rl.manifest.file_digest`); later checks in that process only ``stat`` them.

    python -m bench.model_cache [--size-mb 200 --size-mb 2500] [--smollm] [--dir /path/on/the/node/cache/disk]

For each ``--size-mb`` a temporary node-cache copy holding one ``model.safetensors`` of that many MB (1e6 bytes)
and a ``config.json`` is written under ``--dir``; for ``--smollm``, one of the converted SmolLM2-135M-Instruct folder
(:func:`rl.model.resolve_model`; hard links where the filesystem allows, else copies). Each is checked as
:func:`rl.model_store.materialize` checks a cached copy: first as a fresh process does (every file hashed), then
again (nothing hashed). 2500 MB is a 1B-parameter model in bfloat16 (~2.5 GB), 540 MB SmolLM2-135M in float32.

The files were just written or read, so they are in the page cache: the figures are the hash's rate, not the disk's
(a cold copy adds its read at the disk's rate). Prints a Markdown table; writes nothing else.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

_BLOCK = 1 << 26  # 64 MiB of random bytes, repeated: the hash's rate does not depend on the content


def synthetic_model(folder: Path, size_mb: float) -> Path:
    """Write a model-like folder ``folder``: ``model.safetensors`` of ``size_mb`` * 1e6 bytes and a ``config.json``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama", "rms_norm_eps": 1e-05}')
    block = os.urandom(_BLOCK)
    left = int(size_mb * 1e6)
    with open(folder / "model.safetensors", "wb") as f:
        while left > 0:
            f.write(block[: min(left, _BLOCK)])
            left -= _BLOCK
    return folder


def linked_copy(src: Path, folder: Path) -> Path:
    """``src``'s published files in ``folder``: hard links where possible (nothing copied), else copies."""
    from rl.model_store import _published_files

    for rel, p in _published_files(src).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, folder / rel)
        except OSError:
            shutil.copyfile(p, folder / rel)
    return folder


def check_cost(folder: Path, cache: Path) -> dict[str, float]:
    """Time the node-cache check of the model folder ``folder`` turned into a cached copy under ``cache``.

    Returns:
        ``{"mb": size in MB, "first_s": the first check in a process (every file hashed), "again_s": a later check
        (stat only), "mb_per_s": mb / first_s}``.
    """
    from rl import manifest as manifest_module
    from rl import model_store

    raw = model_store.manifest(folder)
    key = model_store.digest(raw)
    target = cache / key
    folder.rename(target)
    (target / model_store.CACHE_MANIFEST).write_bytes(raw)
    mb = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) / 1e6
    manifest_module._VERIFIED.clear()  # as a fresh process: nothing hashed yet
    model_store._TRUSTED.clear()
    t0 = time.perf_counter()
    assert model_store._cached(target, key)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert model_store._cached(target, key)
    again = time.perf_counter() - t0
    return {"mb": mb, "first_s": first, "again_s": again, "mb_per_s": mb / first}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, action="append", help="a synthetic model of this size (repeatable)")
    parser.add_argument("--smollm", action="store_true", help="also the converted SmolLM2-135M-Instruct folder")
    parser.add_argument("--dir", default=None, help="where to write the temporary copies (default: the temp dir)")
    args = parser.parse_args(argv)
    sizes = args.size_mb or ([] if args.smollm else [200.0])
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        for size in sizes:
            rows.append((f"synthetic {size:g} MB", check_cost(synthetic_model(Path(tmp) / f"s{size:g}", size), cache)))
        if args.smollm:
            from rl.model import resolve_model

            src = Path(resolve_model("SmolLM2-135M-Instruct"))
            rows.append(("SmolLM2-135M-Instruct", check_cost(linked_copy(src, Path(tmp) / "smollm"), cache)))
    print("| model | MB | first check in a process (s) | SHA-256 MB/s | later check (ms) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['mb']:.0f} | {r['first_s']:.2f} | {r['mb_per_s']:.0f} | {r['again_s'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
