"""``python -m tasks.export_merged``: a LoRA checkpoint's adapter merged into its base model, written as a plain
Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files) that ``from_pretrained``, vLLM or any
other tool loads without peft.

A LoRA run's checkpoints (and the model it logs to MLflow) hold the adapter only; this is the command for users who
want the whole model. The merge is :func:`rl.lora.merged_model`'s (peft's ``merge_and_unload``:
``W + (alpha / r) B A`` in float32, then cast).

Usage::

    python -m tasks.export_merged --checkpoint <checkpoint folder or URL> --out <new folder> \\
        [--base <base model folder, published model URL or hub id>] [--dtype bfloat16] \\
        [--storage-options '{"endpoint_url": "http://..."}']
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from dataplane.errors import IntegrityError
from dataplane.urls import redact
from rl.lora import ADAPTER_CONFIG, is_adapter_folder

DTYPES = ("float32", "bfloat16", "float16")
"""What ``--dtype`` takes: the merged weights' dtype (default: the base model's own, from its ``config.json``)."""


def command(checkpoint: str, base: str, out: str = "<new folder>") -> str:
    """The shell command that exports ``checkpoint``'s adapter merged into ``base`` (URLs' credentials redacted;
    storage options left out: they may hold secrets)."""
    args = ["python", "-m", "tasks.export_merged", "--checkpoint", redact(checkpoint), "--base", redact(base)]
    return f"{shlex.join(args)} --out {out}"


def saved_base(adapter_folder: str | Path) -> str:
    """The base model the adapter in ``adapter_folder`` was trained on, as peft recorded it (``adapter_config.json``'s
    ``base_model_name_or_path``: the folder the training process loaded it from, or a hub id); ``""`` if none."""
    return json.loads((Path(adapter_folder) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path") or ""


def _base_folder(base: str | None, adapter_folder: str, checkpoint: str, storage_options: dict[str, Any]) -> str:
    """A local folder (or hub id) of the base model: ``base`` (a published model URL is downloaded into the node
    cache, :func:`rl.model_store.materialize`), else the one the adapter names when it is a folder on this machine."""
    from rl.model_store import materialize

    if base is None:
        base = saved_base(adapter_folder)
        if not Path(base).is_dir():
            msg = (
                f"the adapter at {redact(checkpoint)} was trained on the base model {base!r}, which is not a folder on "
                "this machine: pass --base with the run's base model (the MLflow run's parameter model.resolved_path: "
                "a model folder, a published model URL <root>/models/<digest>, or a hub id)"
            )
            raise FileNotFoundError(msg)
    return materialize(base, storage_options)


def _base_dtype(base_folder: str) -> str:
    """The dtype named in ``base_folder``'s ``config.json`` (``dtype``, or the older ``torch_dtype``); float32 if it
    names none or the base is a hub id."""
    config = Path(base_folder) / "config.json"
    found = json.loads(config.read_text()) if config.is_file() else {}
    return found.get("dtype") or found.get("torch_dtype") or "float32"


def export_merged(
    checkpoint: str,
    out: str | Path,
    *,
    base: str | None = None,
    storage_options: dict[str, Any] | None = None,
    dtype: str | None = None,
) -> Path:
    """Write the model of the LoRA checkpoint ``checkpoint`` (its base with the adapter merged) to the new folder
    ``out`` as a plain Hugging Face folder: the merged model's ``save_pretrained`` (config and safetensors, the base
    model's names and shapes) and the checkpoint's tokenizer. The folder is written beside ``out`` and renamed into
    place, so ``out`` never holds a partial export.

    Args:
        checkpoint: a complete LoRA checkpoint (folder or fsspec URL; :func:`rl.checkpoint.local_folder`).
        out: the folder to create (it may exist if empty).
        base: the base model the adapter was trained on: a folder, a published model URL, or a hub id. None: the
            folder recorded in the adapter's ``adapter_config.json`` (a local run's base).
        storage_options: fsspec options of ``checkpoint``'s and ``base``'s filesystems.
        dtype: one of :data:`DTYPES`; None: the base model's dtype.

    Returns:
        ``out``.

    Raises:
        FileExistsError: ``out`` exists and is not an empty folder.
        ValueError: ``checkpoint`` holds no adapter (a full fine-tuning checkpoint is a plain HF folder already), or
            ``dtype`` is not one of :data:`DTYPES`.
        FileNotFoundError: ``base`` is None and the recorded base is not a folder here.
        dataplane.errors.IntegrityError: ``checkpoint`` is not complete, or its files fail their manifest.
        storage errors; peft's and transformers' errors for a base the adapter does not fit.
    """
    import torch
    from transformers import AutoTokenizer

    from rl import checkpoint as ckpt
    from rl.lora import merged_model

    out = Path(out)
    if dtype is not None and dtype not in DTYPES:
        msg = f"dtype {dtype!r}: the merged weights can be written in {', '.join(DTYPES)} (None: the base model's)"
        raise ValueError(msg)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        msg = f"{out} exists and is not an empty folder: name a new folder for the merged model, or remove it first"
        raise FileExistsError(msg)
    options = storage_options or {}
    with ckpt.local_folder(checkpoint, options, require_complete=True, weights_only=True) as folder:
        if not is_adapter_folder(folder):
            msg = (
                f"{redact(checkpoint)} holds no LoRA adapter (no {ADAPTER_CONFIG}): a checkpoint of full fine-tuning "
                "is a plain Hugging Face folder already; load it as it is"
            )
            raise ValueError(msg)
        base_folder = _base_folder(base, folder, checkpoint, options)
        model = merged_model(base_folder, folder, dtype=getattr(torch, dtype or _base_dtype(base_folder)))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex}")
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            if out.exists():
                out.rmdir()  # empty (checked above)
            staging.rename(out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring); 0 on success, 1 with the error on stderr otherwise."""
    parser = argparse.ArgumentParser(prog="python -m tasks.export_merged", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="the LoRA checkpoint: a folder or fsspec URL")
    parser.add_argument("--out", required=True, help="the new folder to write the merged model to")
    parser.add_argument(
        "--base",
        help="the run's base model: a folder, published model URL or hub id (the MLflow run's parameter "
        "model.resolved_path); default: the folder the adapter records, where it exists on this machine",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="the merged weights' dtype (default: the base model's)")
    parser.add_argument(
        "--storage-options", default="{}", help="fsspec options of the checkpoint's storage as JSON ('{}': none)"
    )
    args = parser.parse_args(argv)
    try:
        options = json.loads(args.storage_options)
    except json.JSONDecodeError as err:
        parser.error(f'--storage-options is not JSON ({err}): write an object such as \'{{"endpoint_url": "..."}}\'')
    if not isinstance(options, dict):
        parser.error(f'--storage-options is {options!r}: write a JSON object such as \'{{"endpoint_url": "..."}}\'')
    try:
        out = export_merged(args.checkpoint, args.out, base=args.base, storage_options=options, dtype=args.dtype)
    except (OSError, ValueError, IntegrityError) as err:
        print(f"export_merged: {err}", file=sys.stderr)
        return 1
    print(f"[grpoflow] merged model written to {out} (transformers: AutoModelForCausalLM.from_pretrained)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
