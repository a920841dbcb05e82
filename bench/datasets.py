"""User-dataset benchmark: how long a run's first step waits for `prepare_split`, and what one step's pod pays for
its prompts (`PromptStream.problems` from a fresh stream).

    python bench/datasets.py [--rows 1000000] [--out bench/results/datasets.md]

Writes a Parquet file of ``--rows`` rows (``prompt``: ~60 characters, ``answer``: an int) to a temporary folder,
then times ``prepare_split(keep="train", val_fraction=0.2, fits=None)`` into a local copy; what ``start_run`` runs
before the first step, ``rl.prompts.prepare_prompts`` (the train and the held-out validation copies, every prompt's
length checked against SmolLM2-135M-Instruct's tokenizer and chat template); and one
``PromptStream(...).problems(start, 64)`` on a fresh stream (empty row-group cache: it reads the index and the row
groups holding its 64 rows). Prints a markdown table and writes it to ``--out`` with the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rl.datasets.stream as stream_module  # noqa: E402
from rl.datasets import ColumnKeys, PromptStream, prepare_split  # noqa: E402

KEYS = ColumnKeys(prompt_key="prompt", answer_key="answer")


def write_source(path: Path, rows: int) -> None:
    """``rows`` rows of a ~60-character ``prompt`` (``"Question 0000123: what is 123 times 7, ..."``) and ``answer``."""
    chunk = 100_000
    with pq.ParquetWriter(path, pa.schema([("prompt", pa.string()), ("answer", pa.int64())])) as writer:
        for start in range(0, rows, chunk):
            ids = range(start, min(rows, start + chunk))
            prompts = [f"Question {i:07d}: what is {i % 997} times 7, plus the digits of {i % 541}?" for i in ids]
            writer.write_table(pa.table({"prompt": prompts, "answer": [(i % 997) * 7 for i in ids]}))


def _start_run_wait(source: Path, root: Path) -> float:
    """Seconds of :func:`rl.prompts.prepare_prompts` on ``source`` as ``start_run`` calls it for the default model."""
    from rl.config import config_from_dict
    from rl.lengths import model_max_len
    from rl.model import load_tokenizer, resolve_model
    from rl.prompts import prepare_prompts

    cfg = config_from_dict(
        {
            "data": {"train": str(source), "answer_key": "answer"},
            "env": {"reward_functions": [{"function": "rl.environments.rewards:exact_match"}]},
        }
    )
    folder = resolve_model("SmolLM2-135M-Instruct")
    tokenizer = load_tokenizer(folder)
    limit = model_max_len(folder) - cfg.generation.max_new_tokens
    t0 = time.perf_counter()
    prepare_prompts(cfg, root=str(root), run_id="bench", tokenizer=tokenizer, max_prompt_tokens=limit)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "datasets.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.parquet"
        write_source(source, args.rows)
        t0 = time.perf_counter()
        split = prepare_split(
            str(source),
            out_url=f"{tmp}/prepared",
            split="train",
            keys=KEYS,
            storage_options={},
            keep="train",
            val_fraction=0.2,
        )
        prepare_s = time.perf_counter() - t0
        start_run_s = _start_run_wait(source, Path(tmp) / "run")
        stream_module._GROUPS.clear()  # a fresh pod: nothing cached
        stream_module._METADATA.clear()
        start = 3 * split.num_rows // 2  # in the second epoch
        reads: list[int] = []
        read_row_group = pq.ParquetFile.read_row_group
        pq.ParquetFile.read_row_group = lambda self, i, *a, **k: reads.append(i) or read_row_group(self, i, *a, **k)
        t0 = time.perf_counter()
        problems = PromptStream(split, seed=0, keys=KEYS, storage_options={}).problems(start, 64)
        stream_s = time.perf_counter() - t0
        pq.ParquetFile.read_row_group = read_row_group
        assert len(problems) == 64
        groups = len(reads)
    rows = [
        ("prepare_split (keep=train, val_fraction=0.2)", args.rows, prepare_s),
        (
            "start_run's wait: prepare_prompts (train + validation, lengths checked with the tokenizer)",
            args.rows,
            start_run_s,
        ),
        (f"PromptStream.problems(start, 64), fresh stream ({groups} row groups read)", 64, stream_s),
    ]
    lines = [
        "# User-dataset benchmark",
        "",
        f"Command: `python bench/datasets.py --rows {args.rows}` (from the repository root)  ",
        f"Machine: nproc {os.cpu_count()}, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, pyarrow {pa.__version__}, arrow threads {pa.cpu_count()}  ",
        f"Source: one Parquet file of {args.rows:,} rows (prompt ~60 characters, int answer), local disk; copy "
        f"kept: {split.num_rows:,} train rows ({split.counts['held_out']:,} held out) in 1024-row groups.",
        "",
        "| operation | rows | seconds | rows/s |",
        "|---|---|---|---|",
        *[f"| {name} | {n:,} | {s:.3f} | {n / s:,.0f} |" for name, n, s in rows],
        "",
    ]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
