"""``python -m bench.step`` on CPU with the tiny model: one whole GRPO step per repeat, every phase timed, token counts
and the MFU consistent with the rows the step wrote, and neither flytekit nor MLflow imported by the process."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import json, sys
from bench.step import main
main(sys.argv[1:])
print("IMPORTED " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {"flytekit", "mlflow"})))
"""
"""Runs ``bench.step.main`` with the command-line arguments, then prints which flytekit / mlflow modules it loaded."""

B, G, T = 2, 2, 4


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory):
    """``(JSON record, stdout)`` of a 2-step run (one warm-up, one timed) with a CPU peak of 1 TFLOP/s set."""
    tmp = tmp_path_factory.mktemp("bench_step")
    args = [
        "--model",
        tiny_model_dir,
        "--device",
        "cpu",
        "--prompts",
        str(B),
        "--group",
        str(G),
        "--max-new-tokens",
        str(T),
        "--repeats",
        "2",
        "--json",
        str(tmp / "out.jsonl"),
        "--workdir",
        str(tmp / "work"),
        "--out",
        str(tmp / "out.md"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GRPOFLOW_PEAK_TFLOPS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp / "out.jsonl").read_text().splitlines()
    assert len(lines) == 2  # after the steps (partial), then the whole record
    partial, record = map(json.loads, lines)
    assert partial["partial"] is True and "decode" not in partial and partial["phases"] == record["phases"]
    assert (tmp / "out.md").read_text() in proc.stdout
    return record, proc.stdout


def test_every_phase_is_timed(bench_run):
    record, _ = bench_run
    assert list(record["phases"]) == ["rollout", "reference_logprobs", "advantages", "update", "refit"]
    assert all(s > 0 for s in record["phases"].values()), record["phases"]
    assert set(record["dataplane"]) == {*record["phases"], "clear"}
    assert record["dataplane"]["refit"] == 0.0  # the refit reads nothing from the data plane
    for name in ("rollout", "reference_logprobs", "advantages", "update"):  # each of these reads or writes it
        assert 0 < record["dataplane"][name] < record["phases"][name]
    assert [s["step"] for s in record["steps"]] == [1, 2]
    assert record["timed_steps"] == 1 and record["warmup_step_s"] == record["steps"][0]["step_s"]
    timed = record["steps"][1]
    assert record["phases"] == timed["phases"]  # the median of one step is that step
    assert record["step_s"] == timed["step_s"] >= sum(timed["phases"].values()) + timed["dataplane"]["clear"]


def test_token_counts_match_the_rows_the_step_wrote(bench_run, tiny_model_dir):
    from rl.config import config_from_dict
    from rl.data import prompt_token_ids, train_problems
    from rl.model import load_tokenizer

    record, _ = bench_run
    generated = record["generated_tokens"]
    assert 0 < generated <= B * G * T
    assert generated / record["generation_s"] == pytest.approx(record["step_gen_tok_per_s"])
    assert record["gen_vs_baseline"] == pytest.approx(record["gen_tok_per_s"] / record["baseline_tok_per_s"])

    # the timed step is step 2: training problems B .. 2B-1, each prompt G times; update tokens = prompts + responses
    d = config_from_dict({}).data
    problems = train_problems(
        dataset=d.dataset, dataset_kwargs=d.dataset_kwargs, seed=d.seed, val_fraction=d.val_fraction, start=B, count=B
    )
    tok = load_tokenizer(tiny_model_dir)
    prompt_lengths = [len(prompt_token_ids(tok, p.question, d.system_prompt)) for p in problems]  # [B]
    assert record["update_tokens"] == G * sum(prompt_lengths) + generated
    assert record["update_tok_per_s"] == pytest.approx(record["update_tokens"] / record["phases"]["update"])

    # MFU with GRPOFLOW_PEAK_TFLOPS=1: sum_i (6N + 12 L H S_i) S_i / s / 1e12; the tiny model has L=2, H=64
    if generated == B * G * T:  # every response ran to T (random weights: eos is rare), so S_i = P_b + T
        lengths = [p + T for p in prompt_lengths for _ in range(G)]  # [N]
        flops = sum((6 * record["params"] + 12 * 2 * 64 * s) * s for s in lengths)
        assert record["steps"][1]["update_flops"] == flops
    assert record["update_mfu"] == pytest.approx(record["steps"][1]["update_flops"] / record["phases"]["update"] / 1e12)


def test_the_decoders_are_compared_warm_and_cold_with_three_calls_each(bench_run):
    """``generate`` and ours, each warmed once, then 3 timed calls warm and 3 cold (the CPU runs no other pin); the
    headline figures are the medians of those calls, and every call decodes B x G rows of at most T tokens."""
    record, stdout = bench_run
    decode = record["decode"]
    assert list(decode) == ["generate", "ours"] and record["calls"] == 3
    for side in decode.values():
        for phase in ("warm", "cold"):
            x = side[phase]
            assert len(x["calls"]) == len(x["tokens"]) == 3
            assert x["min"] <= x["tok_per_s"] <= x["max"] and x["tok_per_s"] == sorted(x["calls"])[1]
            assert all(0 < n <= B * G * T for n in x["tokens"])
    assert record["gen_tok_per_s"] == decode["ours"]["warm"]["tok_per_s"]
    assert record["cold_gen_vs_baseline"] == pytest.approx(
        decode["ours"]["cold"]["tok_per_s"] / decode["generate"]["cold"]["tok_per_s"]
    )
    assert record["loop"] == "dynamic" and record["sdpa"]["choice"] == {}  # the CPU: no pins, no cuDNN choice
    assert "| ours | n/a |" in stdout and "| generate | n/a |" in stdout


def test_neither_flyte_nor_mlflow_is_imported(bench_run):
    record, stdout = bench_run
    assert "IMPORTED []" in stdout.splitlines()
    assert record["device"] == "cpu" and record["params"] > 0
    assert "| update MFU |" in stdout and record["command"] in stdout


def test_full_fine_tuning_records_every_parameter_and_the_peak_rss(bench_run):
    record, stdout = bench_run
    assert record["lora"] is None and record["trainable_params"] == record["params"]
    assert record["peak_memory_source"] == "VmHWM" and 0 < record["peak_memory_gib"] < 64
    assert f"| trainable parameters | {record['params']:,} (100.00%) |" in stdout
    assert "full fine-tuning (cpu:" in stdout and "checkpoint" not in record  # no --saves: no checkpoint timed


def test_lora_flags_make_the_policy_lora_section():
    from bench.step import lora_settings, parse_args
    from rl.config import config_from_dict

    assert lora_settings(parse_args([])) is None
    settings = lora_settings(parse_args(["--lora-rank", "8"]))
    assert settings == {"rank": 8, "alpha": 16.0, "target_modules": ["all-linear"]}
    args = parse_args(["--lora-rank", "4", "--lora-alpha", "2", "--lora-targets", "q_proj, v_proj", "--no-decode"])
    assert lora_settings(args) == {"rank": 4, "alpha": 2.0, "target_modules": ["q_proj", "v_proj"]}
    assert args.no_decode is True and args.saves == 0
    lora = config_from_dict({"policy": {"lora": lora_settings(args)}}).policy.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (4, 2.0, ["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--lora-alpha", "8"], "--lora-alpha needs --lora-rank"),
        (["--lora-rank", "8", "--lora-targets", " , "], "--lora-targets is empty"),
        (["--saves", "-1"], "--saves is -1"),
    ],
)
def test_bad_lora_and_save_flags_are_refused(argv, fragment, capsys):
    from bench.step import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_peak_memory_is_vmhwm_in_gib():
    from bench.step import peak_memory_gib, reset_peak_memory

    assert peak_memory_gib(False, "VmPeak:\t 9 kB\nVmHWM:\t  1572864 kB\nVmRSS:\t 7 kB\n") == 1.5
    assert peak_memory_gib(False, "VmRSS:\t 7 kB\n") is None
    if not torch.cuda.is_available():
        reset_peak_memory(False)
        assert 0 < peak_memory_gib(False) < 64


def _policy(model_dir: str, tmp: Path, lora: dict | None):
    """The transformers policy at version 0 with AdamW's state filled (one zero-gradient step), as after an update."""
    from rl.backends import registry
    from rl.backends.interfaces import PolicyVersion
    from rl.config import config_from_dict
    from rl.model import load_tokenizer

    cfg = config_from_dict(
        {"policy": {"lora": lora}, "model": {"precision": "float32"}, "dataplane": {"root": str(tmp / "dp")}}
    )
    policy = registry.load("policy", "transformers")(cfg, tokenizer=load_tokenizer(model_dir), reference_path=model_dir)
    policy.load_checkpoint(PolicyVersion(step=0, path=model_dir), with_optimizer=True)
    for p in policy.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    policy._optimizer.step()
    return policy


def test_lora_trains_and_saves_the_adapter_only(tiny_model_dir, tmp_path):
    """Trainable parameters: all of them, or rank * (in + out) per linear layer but the LM head (LoRA, Hu et al.
    2021); a checkpoint with trainer state holds fp32 weights (4 bytes each) and AdamW's two moments (8 bytes per
    trainable parameter)."""
    from bench.step import time_saves, trainable_params

    sides = {}
    for name, lora in (("full", None), ("lora", {"rank": 2, "alpha": 4.0})):
        policy = _policy(tiny_model_dir, tmp_path / name, lora)
        try:
            linear = [
                m for n, m in policy.model.named_modules() if type(m) is torch.nn.Linear and not n.endswith("lm_head")
            ]
            params = sum(p.numel() for p in {id(p): p for p in policy.model.parameters()}.values())
            saved = time_saves(policy, tmp_path / name / "ckpt", count=2, step=3, now=time.perf_counter)
            sides[name] = (trainable_params(policy), params, linear, saved)
        finally:
            policy.shutdown()
        assert list((tmp_path / name / "ckpt").iterdir()) == []  # every save removed once measured
        assert len(saved["save_s_all"]) == 2 and saved["save_s"] == statistics.median(saved["save_s_all"])
    full_trainable, params, linear, full = sides["full"]  # the plain model's linear layers
    lora_trainable, _, _, lora = sides["lora"]
    assert full_trainable == params
    assert lora_trainable == sum(2 * (m.in_features + m.out_features) for m in linear) > 0
    assert full["trainer_state_bytes"] > 8 * full_trainable
    assert 8 * lora_trainable < lora["trainer_state_bytes"] < 8 * full_trainable
    assert full["bytes"] - full["trainer_state_bytes"] > 4 * params  # the whole model's weights
    assert lora["bytes"] - lora["trainer_state_bytes"] < 4 * params  # the adapter (and tokenizer) only


def test_table_names_the_adapter_and_the_checkpoint(bench_run):
    from bench.step import table

    record, _ = bench_run
    lora = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    checkpoint = {"bytes": 2 * 2**20, "trainer_state_bytes": 2**19, "save_s": 0.5, "save_s_all": [0.4, 0.5, 0.9]}
    text = table({**record, "lora": lora, "trainable_params": record["params"] // 4, "checkpoint": checkpoint})
    assert ", LoRA r=8 alpha=16 q_proj,v_proj (cpu:" in text
    assert (
        f"| trainable parameters | {record['params'] // 4:,} ({record['params'] // 4 / record['params']:.2%}) |" in text
    )
    assert "| checkpoint with trainer state | 2.0 MiB (trainer state 0.5 MiB), saved in 0.500 s (median of 3) |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where there is no CUDA device")
def test_device_cuda_fails_early_without_cuda(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.step", "--device", "cuda", "--model", str(tmp_path / "never-read")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--device cuda, but torch" in proc.stderr and "sees no CUDA device" in proc.stderr
