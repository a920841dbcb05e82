"""``bench/lora.py``'s pure parts: its arguments, the two ``bench.step`` command lines it runs, and the comparison
table (figures and LoRA / full ratios) from hand-made records; and how it reads a side's record or fails."""

from __future__ import annotations

import json
import sys

import pytest

from bench.lora import compare, parse_args, ratio, run_side, side_command, table
from bench.step import PHASES, lora_settings
from bench.step import parse_args as step_args

LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["all-linear"]}


def _record(scale: float, *, trainable: int, ckpt_mib: float | None, lora: dict | None) -> dict:
    """A ``bench.step`` record whose times are ``scale`` x (1, 2, 3, 4, 5) s for the phases."""
    record = {
        "device": "cpu",
        "device_name": "Test CPU",
        "torch": "2.0",
        "transformers": "4.0",
        "shape": "135M",
        "params": 134_515_008,
        "prompts": 8,
        "group": 8,
        "max_new_tokens": 64,
        "precision_requested": "auto",
        "precision": "float32",
        "policy_backend": "transformers",
        "generation_backend": "transformers",
        "timed_steps": 2,
        "step_s": 16.0 * scale,
        "phases": {p: (i + 1) * scale for i, p in enumerate(PHASES)},
        "dataplane": {"clear": 0.25 * scale},
        "warmup_step_s": 20.0 * scale,
        "peak_memory_gib": 4.0 * scale,
        "peak_memory_source": "VmHWM",
        "trainable_params": trainable,
        "lora": lora,
        "command": "python -m bench.step --lora-rank 16" if lora else "python -m bench.step",
    }
    if ckpt_mib is not None:
        record["checkpoint"] = {
            "bytes": int(ckpt_mib * 2**20),
            "trainer_state_bytes": int(ckpt_mib * 2**19),
            "save_s": 2.0 * scale,
            "save_s_all": [2.0 * scale] * 3,
        }
    return record


FULL = _record(1.0, trainable=134_515_008, ckpt_mib=1536.0, lora=None)
ADAPTER = _record(0.5, trainable=4_884_480, ckpt_mib=48.0, lora=LORA)


def test_defaults_fit_a_small_cpu_and_alpha_is_twice_the_rank():
    args = parse_args([])
    assert (args.prompts, args.group, args.max_new_tokens, args.repeats, args.saves) == (8, 8, 64, 3, 3)
    assert (args.rank, args.alpha, args.targets, args.out) == (16, 32.0, "all-linear", "bench/results/lora.md")
    assert parse_args(["--rank", "4"]).alpha == 8.0
    assert parse_args(["--rank", "4", "--alpha", "5"]).alpha == 5.0


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["--rank", "0"], "--rank is 0"), (["--saves", "0"], "--saves >= 1"), (["--group", "1"], "--group >= 2")],
)
def test_bad_arguments_are_refused(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_the_sides_differ_only_in_the_adapter_and_bench_step_parses_them():
    args = parse_args(["--random-shape", "1B", "--device", "cuda", "--prompts", "4", "--rank", "8", "--saves", "2"])
    full = side_command(args, "full", workdir="/w", json_path="/w/full.jsonl")
    lora = side_command(args, "lora", workdir="/w", json_path="/w/full.jsonl")
    assert full[:3] == [sys.executable, "-m", "bench.step"]
    assert lora == [*full, "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "all-linear"]
    parsed = step_args(full[3:])
    assert (parsed.random_shape, parsed.device, parsed.prompts, parsed.group) == ("1B", "cuda", 4, 8)
    assert (parsed.max_new_tokens, parsed.repeats, parsed.saves, parsed.no_decode) == (64, 3, 2, True)
    assert (parsed.workdir, parsed.json) == ("/w", "/w/full.jsonl") and lora_settings(parsed) is None
    assert lora_settings(step_args(lora[3:])) == {"rank": 8, "alpha": 16.0, "target_modules": ["all-linear"]}


def test_ratio_is_lora_over_full_where_both_exist():
    assert ratio(4.0, 1.0) == 0.25
    assert ratio(0.0, 1.0) is None and ratio(None, 1.0) is None and ratio(1.0, None) is None


def test_rows_hold_each_figure_and_its_ratio():
    rows = {r["figure"]: r for r in compare(FULL, ADAPTER)}
    assert list(rows)[:7] == ["step (s, median)", *(f"{p} (s)" for p in PHASES), "clear the partition (s)"]
    assert rows["step (s, median)"]["full"] == 16.0 and rows["step (s, median)"]["ratio"] == 0.5
    assert rows["trainable parameters"]["ratio"] == 4_884_480 / 134_515_008
    assert rows["checkpoint with trainer state (MiB)"]["full"] == 1536.0
    assert rows["checkpoint with trainer state (MiB)"]["ratio"] == 48.0 / 1536.0
    assert rows["of which trainer state (MiB)"]["lora"] == 24.0


def test_table_shows_both_sides_and_the_ratios():
    text = table(FULL, ADAPTER, command="python -m bench.lora", machine_line="Linux, 2 CPUs")
    assert text.startswith("# Full fine-tuning against LoRA (r=16 alpha=32 all-linear): one GRPO step (cpu: Test CPU")
    assert "`python -m bench.lora`" in text and "Machine: Linux, 2 CPUs." in text
    assert "median of 2 step(s) after a warm-up step" in text
    assert "| step (s, median) | 16.000 | 8.000 | 0.500 |" in text
    assert "| update (s) | 4.000 | 2.000 | 0.500 |" in text
    assert "| peak memory of the steps (GiB, VmHWM) | 4.00 | 2.00 | 0.500 |" in text
    assert "| trainable parameters | 134,515,008 | 4,884,480 | 0.0363 |" in text
    assert "| checkpoint with trainer state (MiB) | 1,536.0 | 48.0 | 0.0312 |" in text
    assert "| checkpoint save (s, median of 3) | 2.000 | 1.000 | 0.500 |" in text
    assert "- full: `python -m bench.step`" in text and "- lora: `python -m bench.step --lora-rank 16`" in text


def test_a_side_without_checkpoints_shows_n_a():
    text = table(
        _record(1.0, trainable=10, ckpt_mib=None, lora=None),
        ADAPTER,
        command="python -m bench.lora",
        machine_line="m",
    )
    assert "| checkpoint with trainer state (MiB) | n/a | 48.0 | n/a |" in text


def test_run_side_returns_the_last_whole_record(tmp_path):
    out = tmp_path / "side.jsonl"
    write = "import json, sys; open(sys.argv[1], 'a').write(json.dumps({'step_s': float(sys.argv[2])}) + '\\n')"
    out.write_text(json.dumps({"step_s": 9.0, "partial": True}) + "\n")
    assert run_side("full", [sys.executable, "-c", write, str(out), "3"], out) == {"step_s": 3.0}


@pytest.mark.parametrize(
    ("code", "partial", "fragment"),
    [(1, None, "the lora side failed (exit 1, no record in"), (0, True, "the lora side failed (exit 0, a partial")],
)
def test_run_side_fails_with_the_command_to_rerun(tmp_path, code, partial, fragment):
    out = tmp_path / "side.jsonl"
    if partial:
        out.write_text(json.dumps({"step_s": 1.0, "partial": True}) + "\n")
    cmd = [sys.executable, "-c", f"raise SystemExit({code})"]
    with pytest.raises(SystemExit) as err:
        run_side("lora", cmd, out)
    assert fragment in str(err.value) and "Rerun it alone to debug:" in str(err.value)
