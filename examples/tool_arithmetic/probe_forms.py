"""How often the untrained model writes the right tool call, per question form, greedy and sampled: which forms GRPO
can sharpen (sometimes right when sampled) and which it cannot reach (never right, so never rewarded).

    python examples/tool_arithmetic/probe_forms.py [--rows 64] [--samples 8] [--temperature 0.7 1.0]

Runs the first turn only, on vLLM's engine (its CPU build on a CPU machine), with the dataset's prompts (the tool
instruction and the worked examples of ``make_dataset.py``): a call is right when its ``code``, evaluated, is the
question's answer. Prints a markdown table, a row per form.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_dataset  # noqa: E402 (this folder's script, not a package)

CODE = re.compile(r"<tool_call>\s*(\{.*\})", re.DOTALL)


def form_of(question: str) -> str:
    """The :data:`make_dataset.FORMS` wording a question was written in."""
    for words, _ in make_dataset.FORMS:
        pattern = re.escape(words).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+").replace(r"\{c\}", r"\d+")
        if re.search(f"What is {pattern}\\?", question):
            return words.format(a="a", b="b", c="c")
    raise ValueError(f"no form of make_dataset.FORMS matches {question!r}")


def right_call(completion: str, answer: str) -> bool:
    """Whether the completion's first tool call is ``python`` with code that evaluates to ``answer`` (code of digits and
    ``+ - *`` and brackets only, no power: anything else is wrong, never run)."""
    m = CODE.search(completion)
    if not m:
        return False
    try:
        call = json.loads(m.group(1).split("</tool_call>")[0])
        code = call["arguments"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    if not isinstance(code, str) or not re.fullmatch(r"[\d\s+\-*()]+", code) or "**" in code:
        return False
    try:
        return str(eval(code, {"__builtins__": {}})) == answer  # noqa: S307 (digits, + - * and brackets only)
    except (SyntaxError, ValueError):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=5, help="the questions' seed (the training file uses 0, validation 1)")
    p.add_argument("--samples", type=int, default=8, help="sampled completions per question and temperature")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams

    from rl.config import DEFAULT_MODEL
    from rl.model import load_tokenizer, resolve_model

    path = resolve_model(DEFAULT_MODEL)
    tok = load_tokenizer(path)
    rows = make_dataset.rows(args.rows, args.seed, messages=True)
    forms = [form_of(r["prompt"][-1]["content"]) for r in rows]
    prompts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
    llm = LLM(model=path, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0)
    sides = [("greedy", SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, stop=["</tool_call>"]))]
    sides += [
        (f"T={t} x{args.samples}", SamplingParams(temperature=t, n=args.samples, max_tokens=args.max_new_tokens,
                                                   stop=["</tool_call>"], include_stop_str_in_output=True, seed=1))
        for t in args.temperature
    ]  # fmt: skip
    counts: dict[str, dict[str, list[int]]] = {f: {} for f in dict.fromkeys(forms)}
    for name, params in sides:
        for r, f, out in zip(rows, forms, llm.generate(prompts, params, use_tqdm=False), strict=True):
            got = counts[f].setdefault(name, [0, 0])
            got[0] += sum(right_call(c.text, r["answer"]) for c in out.outputs)
            got[1] += len(out.outputs)
    names = [n for n, _ in sides]
    print(f"Right first calls per form (SmolLM2-135M-Instruct, untrained; {args.rows} questions, seed {args.seed})\n")
    print("| form | questions | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for f, by in counts.items():
        print(f"| {f} | {forms.count(f)} | " + " | ".join(f"{by[n][0]}/{by[n][1]}" for n in names) + " |")


if __name__ == "__main__":
    main()
