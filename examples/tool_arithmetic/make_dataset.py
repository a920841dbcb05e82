"""Write the tool-arithmetic dataset: multiplications of 5- and 6-digit numbers, which a 135M model cannot do unaided
but can with the ``python`` tool of ``rl.environments.tools:ToolEnvironment``; JSON Lines with the columns
``prompt`` (the question, or with ``--messages`` the chat messages: the tool instruction as system message, then the
question), ``answer`` (the exact product, as a string) and ``task`` (``"arith"``).

    python examples/tool_arithmetic/make_dataset.py      # -> runs/examples/tool_arithmetic.jsonl, 512 rows
    python examples/tool_arithmetic/make_dataset.py --rows 64 --messages --out /tmp/t.jsonl

Deterministic: the same rows for the same ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from rl.environments.tools.parsing import TOOLS_INSTRUCTION

QUESTION = "What is {a} * {b}? Use the python tool to compute it, then give the result in <answer></answer>."


def rows(
    n: int, seed: int, *, min_digits: int = 5, max_digits: int = 6, messages: bool = False
) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "answer", "task"}``; each operand has ``min_digits`` to ``max_digits`` digits (uniform
    digit count, then uniform value); ``messages`` makes ``prompt`` ``[system TOOLS_INSTRUCTION, user question]``.

    Raises:
        ValueError: ``min_digits`` is not in ``1..max_digits``.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits {min_digits}..{max_digits}: give 1 <= --min-digits <= --max-digits (e.g. 5 and 6).")
    rng = random.Random(seed)

    def operand() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    out = []
    for _ in range(n):
        a, b = operand(), operand()
        question = QUESTION.format(a=a, b=b)
        prompt: Any = question
        if messages:
            prompt = [{"role": "system", "content": TOOLS_INSTRUCTION}, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": str(a * b), "task": "arith"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-digits", type=int, default=5)
    parser.add_argument("--max-digits", type=int, default=6)
    parser.add_argument(
        "--messages", action="store_true", help="write the prompt as messages with the tool instruction"
    )
    parser.add_argument("--out", default="runs/examples/tool_arithmetic.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = rows(args.rows, args.seed, min_digits=args.min_digits, max_digits=args.max_digits, messages=args.messages)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in data))
    tmp.replace(out)  # never a torn file
    print(f"wrote {len(data)} rows to {out}; first: {data[0]}")


if __name__ == "__main__":
    main()
