"""The one markdown table of ``scripts/gpu_check.sh``: every part, in the order it ran, with its exit status and wall
time, and what it measured.

    python scripts/gpu_check_table.py OUT [--write OUT/summary.md]

Reads from the folder ``OUT``:
  parts.txt      ``part <name> rc=<rc> <seconds>s`` lines (rc ``skip``: not run, the time budget was spent);
  results.jsonl  one JSON object a line: ``{"part": "env", ...}`` and ``{"part": "models", ...}``
                 (scripts/gpu_check.py), ``bench.step`` records (they have ``phases``; matched to part ``step<shape>``,
                 the last of a part wins: a whole record follows its ``partial`` one), ``bench.megatron`` records
                 (``"bench": "megatron"``; matched to part ``megatron<size>``) and ``bench.refit`` records
                 (``"bench": "refit"``, one per hand-over ``way``);
  pytest.log     pytest's output (its closing ``N passed, N skipped ...`` line);
  <part>.log     a failed part's last line is shown.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

COLUMNS = (
    "part",
    "rc",
    "wall s",
    "model",
    "rollout s",
    "ref logprobs s",
    "advantages s",
    "update s",
    "refit s",
    "step s",
    "gen tok/s",
    "baseline tok/s",
    "gen / baseline",
    "update MFU",
    "result",
)
PHASE_COLUMNS = {
    "rollout s": "rollout",
    "ref logprobs s": "reference_logprobs",
    "advantages s": "advantages",
    "update s": "update",
    "refit s": "refit",
}
PART_LINE = re.compile(r"^part (\S+) rc=(\S+) (\d+(?:\.\d+)?)s\s*$")
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")


def read_parts(text: str) -> list[tuple[str, str, float]]:
    """parts.txt -> [(name, rc, seconds)]; other lines are ignored."""
    out = []
    for line in text.splitlines():
        m = PART_LINE.match(line.strip())
        if m:
            out.append((m.group(1), m.group(2), float(m.group(3))))
    return out


def read_results(text: str) -> list[dict]:
    """results.jsonl -> records (a line that is not a JSON object is skipped: a part killed mid-write)."""
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def pytest_counts(log: str) -> dict[str, int] | None:
    """The counts of pytest's closing line (``10 passed, 3 skipped, 140 deselected in 95.1s``), None if it has none
    (pytest was killed)."""
    for line in reversed(log.splitlines()):
        if re.search(r"\b(passed|failed|skipped|errors?|deselected|no tests ran)\b.* in \d", line):
            counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
            for n, word in PYTEST_COUNT.findall(line):
                word = {"error": "errors", "warning": "warnings"}.get(word, word)
                counts[word] = counts.get(word, 0) + int(n)
            return counts
    return None


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _last_line(path: Path) -> str:
    try:
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:160].replace("|", "\\|") if lines else ""


def _status(rc: str, seconds: float, log: Path | None) -> str:
    """A failed part's status; ``log``: where its last line tells why (None: its result says it)."""
    if rc == "0":
        return ""
    if rc == "skip":
        return "not run: the time budget was spent"
    if rc in ("124", "137"):
        return f"TIMED OUT after {seconds:.0f} s"
    tail = _last_line(log) if log else ""
    return f"FAILED (rc={rc})" + (f": {tail}" if tail else "")


def _env_result(rec: dict) -> str:
    bits = []
    if rec.get("device_name"):
        bits.append(
            f"{rec['device_name']}, {rec.get('memory_gib', '?')} GiB"
            + (f", driver {rec['driver']}" if rec.get("driver") else "")
        )
    elif "cuda_available" in rec:
        bits.append("no CUDA device")
    bits.append(
        f"Python {rec.get('python', '?')}, torch {rec.get('torch', '?')} (CUDA "
        f"{rec.get('torch_cuda') or 'none'}), transformers {rec.get('transformers', '?')}"
    )
    versions = [f"{k} {rec[k]}" for k in ("megatron.core", "tensordict", "reasoning_gym", "mashumaro") if rec.get(k)]
    if versions:
        bits.append(", ".join(versions))
    for module, err in (rec.get("import_errors") or {}).items():
        bits.append(f"import {module} failed: {err}")
    return "; ".join(bits).replace("|", "\\|")


def _step_cells(row: dict[str, str], r: dict) -> str:
    """Fill ``row`` from a ``bench.step`` record; returns its result text."""
    row["model"] = f"{r['shape']} ({r['params'] / 1e6:.0f}M)" if r.get("params") else str(r.get("shape", ""))
    for col, phase in PHASE_COLUMNS.items():
        row[col] = _f(r.get("phases", {}).get(phase), ".3f")
    row["step s"] = _f(r.get("step_s"), ".3f")
    row["gen tok/s"] = _f(r.get("gen_tok_per_s"), ",.0f")
    row["baseline tok/s"] = _f(r.get("baseline_tok_per_s"), ",.0f")
    row["gen / baseline"] = _f(r.get("gen_vs_baseline"), ".2f")
    row["update MFU"] = "n/a" if r.get("update_mfu") is None else f"{r['update_mfu']:.1%}"
    text = (
        f"{r.get('device_name', '?')}: {r.get('prompts')} x {r.get('group')} x {r.get('max_new_tokens')} tokens, "
        f"{r.get('precision')}, {r.get('loop', 'graphs' if r.get('cuda_graphs') else 'dynamic')} loop; "
        f"{r.get('generated_tokens', 0):,} generated, "
        f"{r.get('update_tokens', 0):,} trained"
    )
    if r.get("partial"):
        return text + "; no decode comparison (stopped after the steps)"
    decode, sdpa = r.get("decode") or {}, r.get("sdpa") or {}
    if decode:  # gen tok/s columns: warm medians; here the cold ones and the other pins
        base = decode["generate"]
        ratios = [
            f"{name} failed"
            if "error" in d
            else f"{name} {d['warm']['tok_per_s'] / base['warm']['tok_per_s']:.2f}x "
            f"warm, {d['cold']['tok_per_s'] / base['cold']['tok_per_s']:.2f}x cold"
            for name, d in decode.items()
            if name != "generate"
        ]
        choice = sdpa.get("choice") or {}
        kernels = ", ".join(f"{pin}: {k}" for pin, k in choice.items())
        text += (
            f"; vs generate (median of {r.get('calls')}): " + "; ".join(ratios) + f"; cuDNN {sdpa.get('cudnn_version')}"
            f", pin {sdpa.get('decode_pin')}" + (f" (kernels {kernels})" if kernels else "")
        )
    return text


def _megatron_cells(row: dict[str, str], r: dict) -> str:
    """Fill ``row`` from a ``bench.megatron`` record (one back-end); returns its result text."""
    row["model"] = str(r.get("size", ""))
    row["update s"] = _f(r.get("step_s"), ".3f")
    row["update MFU"] = "n/a" if r.get("mfu") is None else f"{r['mfu']:.1%}"
    if r.get("error"):
        return f"bench.megatron {r.get('backend')} back-end, {r.get('variant', 'default')}: {r['error']}"
    shared = ", groups share a prompt" if r.get("shared_prompts") else ""
    return (
        f"bench.megatron {r.get('backend')} back-end, {r.get('variant', 'default')}: {r.get('rows')} x "
        f"{r.get('length')} tokens{shared}, {r.get('tokens_per_s', 0):,.0f} tok/s, peak {r.get('peak_gib', 0):.1f} "
        f"GiB, step time {r.get('vs_transformers') or 1:.2f}x the first row's"
    )


def _refit_result(records: list[dict]) -> str:
    """``bench.refit``'s hand-overs (the last record of each way), each with its total seconds and GB copied, and the
    ratio of the last to the first."""
    ways = {r.get("way"): r for r in records}
    first = next(iter(ways.values()))
    return "; ".join(
        f"{way}: {r.get('total_s', 0):.3f} s ({r.get('copy_gb', 0):.2f} GB {r.get('copy_dtype', '')} copied"
        + (f", {r['total_s'] / first['total_s']:.2f}x)" if r is not first and first.get("total_s") else ")")
        for way, r in ways.items()
    )


def rows(out: Path) -> list[dict[str, str]]:
    """The table's rows as {column: cell}: one per part, one per back-end for a megatron part."""
    parts = read_parts((out / "parts.txt").read_text()) if (out / "parts.txt").exists() else []
    results = read_results((out / "results.jsonl").read_text()) if (out / "results.jsonl").exists() else []
    # the last record of a shape (and CUDA-graph setting: part step<shape>graphs) wins
    steps = {str(r.get("shape")) + ("graphs" if r.get("cuda_graphs") else ""): r for r in results if "phases" in r}
    megatron: dict[str, list[dict]] = {}
    for r in results:
        if r.get("bench") == "megatron":
            megatron.setdefault(str(r.get("size")) + ("shared" if r.get("shared_prompts") else ""), []).append(r)
    refits = [r for r in results if r.get("bench") == "refit"]
    env = [r for r in results if r.get("part") == "env"]
    models = [r for r in results if r.get("part") == "models"]
    table = []
    for name, rc, seconds in parts:
        row = dict.fromkeys(COLUMNS, "") | {"part": name, "rc": rc, "wall s": f"{seconds:.0f}"}
        more: list[dict[str, str]] = []  # further rows of this part
        result = ""
        if name == "env" and env:
            result = _env_result(env[-1])
        elif name == "models" and models:
            result = ", ".join(
                f"{m['size']} {'reused' if m.get('reused') else 'built'} ({m.get('s', '?')} s)" for m in models
            )
        elif name == "pytest":
            plog = out / "pytest.log"
            counts = pytest_counts(plog.read_text(errors="replace")) if plog.exists() else None
            result = (
                "no pytest summary line"
                if counts is None
                else ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped", "errors"))
            )
        elif name.startswith("step") and name[4:] in steps:
            result = _step_cells(row, steps[name[4:]])
        elif name == "refit" and refits:
            row["model"] = Path(str(refits[-1].get("model", ""))).name
            result = _refit_result(refits)
        elif name.startswith("megatron") and name[8:] in megatron:
            first, *rest = megatron[name[8:]]
            result = _megatron_cells(row, first)
            for r in rest:
                more.append(dict.fromkeys(COLUMNS, "") | {"part": name})
                more[-1]["result"] = _megatron_cells(more[-1], r)
        log = None if name == "env" and env else out / f"{name}.log"  # the env record names the failed imports
        row["result"] = "; ".join(x for x in (_status(rc, seconds, log), result) if x)
        table += [row, *more]
    return table


def render(out: Path) -> str:
    body = rows(out)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in body]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the folder scripts/gpu_check.sh wrote")
    parser.add_argument("--write", help="also write the table to this file")
    args = parser.parse_args(argv)
    text = render(Path(args.out))
    print(text, end="")
    if args.write:
        Path(args.write).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
