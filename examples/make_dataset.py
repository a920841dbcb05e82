"""Write the example prompt dataset of the README's "Train on your own data": arithmetic questions of two tasks,
``sum`` and ``product``, as JSON Lines with the columns ``question``, ``answer`` and ``task``.

    python examples/make_dataset.py                      # -> runs/examples/arithmetic.jsonl, 512 rows
    python examples/make_dataset.py --rows 64 --out /tmp/a.jsonl

Deterministic: the same rows for the same ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` rows, alternating ``sum`` (a + b) and ``product`` (a * b) over one-digit operands."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if i % 2 == 0:
            out.append({"question": f"What is {a} + {b}?", "answer": str(a + b), "task": "sum"})
        else:
            out.append({"question": f"What is {a} times {b}?", "answer": str(a * b), "task": "product"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/examples/arithmetic.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = rows(args.rows, args.seed)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in data))
    tmp.replace(out)  # never a torn file
    print(f"wrote {len(data)} rows to {out}; first: {data[0]}")


if __name__ == "__main__":
    main()
