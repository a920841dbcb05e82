"""Write the tool-arithmetic dataset: multiplications of 5- and 6-digit numbers, which a 135M model cannot do unaided
but can with the ``python`` tool of ``rl.environments.tools:ToolEnvironment``; JSON Lines with the columns
``prompt`` (the question, or with ``--messages`` the chat messages: the tool instruction as system message, two worked
examples, then the question), ``answer`` (the exact product, as a string) and ``task`` (``"arith"``).

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

QUESTION = "What is {expr}? Use the python tool to compute it, then give the result in <answer></answer>."

DEMOS = ((4821, 397), (91234, 5678))
"""The worked examples ``--messages`` puts before each question: a call, the tool's reply, the answer. Without them the
untrained 135M model almost never writes a tool call (0 of 32 sampled episodes, 2026-11-28), so GRPO would get no
signal; with them, 83% of its episodes call the tool and 34% are correct (64 sampled episodes)."""


def demonstration(a: int, b: int) -> list[dict[str, str]]:
    """One worked episode in chat messages: the question, the tool call, the tool's reply, the final answer."""
    call = {"name": "python", "arguments": {"code": f"{a} * {b}"}}
    return [
        {"role": "user", "content": QUESTION.format(expr=f"{a} * {b}")},
        {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"<answer>{a * b}</answer>"},
    ]


FORMS = (
    ("{a} times {b}", lambda a, b, c: a * b),
    ("{a} times {b} minus {c}", lambda a, b, c: a * b - c),
    ("{a} plus {b}, all times {c}", lambda a, b, c: (a + b) * c),
    ("{a} times {b} times {c}", lambda a, b, c: a * b * c),
)
"""The questions' expressions in words (one per row, uniformly), with their values: the worked examples show the call
for ``a * b``; the model has to write each of these into the tool call as Python."""


def rows(
    n: int, seed: int, *, min_digits: int = 5, max_digits: int = 6, messages: bool = False
) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "answer", "task"}``: an expression of :data:`FORMS` whose operands have
    ``min_digits`` to ``max_digits`` digits (uniform digit count, then uniform value); ``messages`` makes ``prompt``
    the chat messages ``[system TOOLS_INSTRUCTION, *worked examples (DEMOS), user question]``.

    Raises:
        ValueError: ``min_digits`` is not in ``1..max_digits``.
    """
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"digits {min_digits}..{max_digits}: give 1 <= --min-digits <= --max-digits (e.g. 5 and 6).")
    rng = random.Random(seed)

    def operand() -> int:
        d = rng.randint(min_digits, max_digits)
        return rng.randint(10 ** (d - 1), 10**d - 1)

    demos = [m for x, y in DEMOS for m in demonstration(x, y)]
    out = []
    for _ in range(n):
        words, value = rng.choice(FORMS)
        a, b, c = operand(), operand(), operand()
        question = QUESTION.format(expr=words.format(a=a, b=b, c=c))
        prompt: Any = question
        if messages:
            prompt = [{"role": "system", "content": TOOLS_INSTRUCTION}, *demos, {"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": str(value(a, b, c)), "task": "arith"})
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
