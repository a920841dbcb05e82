"""scripts/gpu_check.sh on a CPU: its summary table (scripts/gpu_check_table.py) on hand-written inputs, the JSON that
bench/megatron.py adds for it, and the whole script end to end at tiny sizes (--cpu-smoke)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bench.megatron as bm

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_check_table", REPO / "scripts" / "gpu_check_table.py")
table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table)

STEP = {
    "device": "cuda",
    "device_name": "NVIDIA H100 80GB HBM3",
    "shape": "135M",
    "params": 134_515_008,
    "prompts": 64,
    "group": 8,
    "max_new_tokens": 128,
    "precision": "bfloat16",
    "phases": {
        "rollout": 3.2104,
        "reference_logprobs": 0.4123,
        "advantages": 0.0311,
        "update": 1.9876,
        "refit": 0.1502,
    },
    "generated_tokens": 65536,
    "gen_tok_per_s": 15408.4,
    "baseline_tok_per_s": 19009.2,
    "gen_vs_baseline": 0.8106,
    "update_tokens": 98304,
    "update_tok_per_s": 49458.1,
    "update_mfu": 0.0541,
    "step_s": 5.9012,
}
GRAPHS = STEP | {"cuda_graphs": True, "gen_tok_per_s": 40123.0, "gen_vs_baseline": 2.1107}
MEGATRON = [
    {
        "bench": "megatron",
        "size": "1B",
        "backend": "transformers",
        "rows": 64,
        "length": 512,
        "step_s": 0.8012,
        "tokens_per_s": 40898.6,
        "mfu": 0.2751,
        "vs_transformers": 1.0,
    },
    {
        "bench": "megatron",
        "size": "1B",
        "backend": "megatron",
        "rows": 64,
        "length": 512,
        "step_s": 1.1734,
        "tokens_per_s": 27925.7,
        "mfu": 0.1878,
        "vs_transformers": 1.4646,
        "variant": "rows32",
        "peak_gib": 41.25,
    },
    {
        "bench": "megatron",
        "size": "1B",
        "backend": "megatron",
        "rows": 64,
        "length": 512,
        "variant": "tokens64k",
        "error": "out of memory: CUDA",
    },
]
ENV = {
    "part": "env",
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "transformers": "5.17.0",
    "torch_cuda": "13.0",
    "cuda_available": True,
    "device_name": "NVIDIA H100 80GB HBM3",
    "memory_gib": 79.2,
    "driver": "580.65.06",
    "megatron.core": "0.17.0",
    "tensordict": "0.15.3",
    "reasoning_gym": "0.1.25",
    "mashumaro": "3.23",
}


@pytest.fixture
def out(tmp_path):
    (tmp_path / "parts.txt").write_text(
        "part env rc=0 14s\npart models rc=0 31s\npart pytest rc=1 118s\npart step135M rc=0 84s\npart "
        "step135Mgraphs rc=0 61s\npart step1B rc=124 180s\n"
        "part megatron135M rc=1 12s\npart megatron1B rc=0 70s\npart later rc=skip 0s\n"
    )
    records = [
        ENV,
        {"part": "models", "size": "135M", "reused": False, "s": 9.8},
        {"part": "models", "size": "1B", "reused": True, "s": 0.1},
        STEP,
        GRAPHS,
        *MEGATRON,
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut off mid-wr\n')
    (tmp_path / "pytest.log").write_text(
        "....F..s.ss\nFAILED tests/gpu/test_megatron.py::test_x - AssertionError\n"
        "=========== 1 failed, 7 passed, 3 skipped, 140 deselected, 2 warnings in 95.12s (0:01:35) ===========\n"
    )
    (tmp_path / "megatron135M.log").write_text(
        "Traceback (most recent call last):\n  ...\nRuntimeError: CUDA error: out of memory | really\n\n"
    )
    return tmp_path


def test_each_part_is_a_row_with_its_status_and_measurements(out):
    rows = table.rows(out)
    assert [(r["part"], r["rc"], r["wall s"]) for r in rows] == [
        ("env", "0", "14"),
        ("models", "0", "31"),
        ("pytest", "1", "118"),
        ("step135M", "0", "84"),
        ("step135Mgraphs", "0", "61"),
        ("step1B", "124", "180"),
        ("megatron135M", "1", "12"),
        ("megatron1B", "0", "70"),
        ("megatron1B", "", ""),
        ("megatron1B", "", ""),
        ("later", "skip", "0"),
    ]
    env, models, pytest_row, s135, s135g, s1b, m135, m1b_hf, m1b_meg, m1b_oom, later = rows
    assert env["result"] == (
        "NVIDIA H100 80GB HBM3, 79.2 GiB, driver 580.65.06; Python 3.12.3, torch 2.11.0+cu130 (CUDA 13.0), "
        "transformers 5.17.0; megatron.core 0.17.0, tensordict 0.15.3, reasoning_gym 0.1.25, mashumaro 3.23"
    )
    assert models["result"] == "135M built (9.8 s), 1B reused (0.1 s)"
    assert pytest_row["result"].endswith("7 passed, 1 failed, 3 skipped, 0 errors")
    assert pytest_row["result"].startswith("FAILED (rc=1)")
    cells = {
        k: s135[k]
        for k in (
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
        )
    }
    assert cells == {
        "model": "135M (135M)",
        "rollout s": "3.210",
        "ref logprobs s": "0.412",
        "advantages s": "0.031",
        "update s": "1.988",
        "refit s": "0.150",
        "step s": "5.901",
        "gen tok/s": "15,408",
        "baseline tok/s": "19,009",
        "gen / baseline": "0.81",
        "update MFU": "5.4%",
    }
    assert s135["result"] == (
        "NVIDIA H100 80GB HBM3: 64 x 8 x 128 tokens, bfloat16, dynamic loop; 65,536 generated, 98,304 trained"
    )
    assert (s135g["gen tok/s"], s135g["gen / baseline"]) == (
        "40,123",
        "2.11",
    )  # the --cuda-graphs record, not the plain one
    assert (
        s135g["result"]
        == "NVIDIA H100 80GB HBM3: 64 x 8 x 128 tokens, bfloat16, graphs loop; 65,536 generated, 98,304 trained"
    )
    assert s1b["result"] == "TIMED OUT after 180 s" and s1b["rollout s"] == "" and s1b["gen tok/s"] == ""
    assert (
        m135["result"] == "FAILED (rc=1): RuntimeError: CUDA error: out of memory \\| really"
    )  # a | would break the table
    assert (m1b_hf["model"], m1b_hf["update s"], m1b_hf["update MFU"]) == ("1B", "0.801", "27.5%")
    assert (m1b_meg["model"], m1b_meg["update s"], m1b_meg["update MFU"]) == ("1B", "1.173", "18.8%")
    assert m1b_meg["result"] == (
        "bench.megatron megatron back-end, rows32: 64 x 512 tokens, 27,926 tok/s, peak 41.2 GiB, step time 1.46x the "
        "first row's"
    )
    assert (
        m1b_oom["result"] == "bench.megatron megatron back-end, tokens64k: out of memory: CUDA"
        and m1b_oom["update s"] == ""
    )
    assert later["result"] == "not run: the time budget was spent"


def test_the_table_is_one_markdown_table_printed_and_written(out, capsys):
    table.main([str(out), "--write", str(out / "summary.md")])
    text = (out / "summary.md").read_text()
    assert capsys.readouterr().out == text
    lines = text.splitlines()
    assert (
        lines[0].startswith("| part | rc | wall s | model | rollout s | ref logprobs s |")
        and lines[1] == "|" + "---|" * 15
    )
    assert len(lines) == 2 + 11 and all(len(re.split(r"(?<!\\)\|", line)) == 2 + 15 for line in lines)  # 15 cells a row


def _calls(median: float) -> dict:
    return {"tok_per_s": median, "min": median - 1, "max": median + 1, "calls": [median - 1, median, median + 1]}


def test_a_step_part_shows_its_decode_comparison_and_a_refit_part_its_summary(tmp_path):
    """The whole record that follows a partial one wins; the gen tok/s columns are the warm medians, the result adds
    every side's warm and cold ratio to generate and the SDPA kernels; a refit record shows its summary."""
    (tmp_path / "parts.txt").write_text("part step1Bgraphs rc=0 90s\npart step1B rc=124 170s\npart refit rc=0 20s\n")
    decode = {
        "generate": {"warm": _calls(50000.0), "cold": _calls(40000.0)},
        "ours": {"warm": _calls(100000.0), "cold": _calls(100000.0)},
        "ours[cudnn]": {"warm": _calls(75000.0), "cold": _calls(20000.0)},
    }
    whole = STEP | {
        "shape": "1B",
        "loop": "graphs",
        "cuda_graphs": True,
        "calls": 3,
        "decode": decode,
        "gen_tok_per_s": 100000.0,
        "baseline_tok_per_s": 50000.0,
        "gen_vs_baseline": 2.0,
        "sdpa": {
            "cudnn_version": 91002,
            "decode_pin": "no_cudnn",
            "choice": {"torch": "CUDNN_ATTENTION", "no_cudnn": "EFFICIENT_ATTENTION"},
        },
    }
    records = [
        whole | {"partial": True, "decode": None, "gen_tok_per_s": None},
        whole,
        STEP | {"shape": "1B", "partial": True},  # step1B: killed during its comparison
        {
            "bench": "refit",
            "model": "/c/models/1B",
            "way": "host copy + refit",
            "total_s": 0.8,
            "copy_gb": 4.3,
            "copy_dtype": "float32",
        },
        {
            "bench": "refit",
            "model": "/c/models/1B",
            "way": "device copy + refit",
            "total_s": 0.1,
            "copy_gb": 2.15,
            "copy_dtype": "bfloat16",
        },
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    graphs, plain, refit = table.rows(tmp_path)
    assert (graphs["gen tok/s"], graphs["baseline tok/s"], graphs["gen / baseline"]) == ("100,000", "50,000", "2.00")
    assert graphs["result"].endswith(
        "graphs loop; 65,536 generated, 98,304 trained; vs generate (median of 3): ours 2.00x warm, 2.50x cold; "
        "ours[cudnn] 1.50x warm, 0.50x cold; cuDNN 91002, pin no_cudnn (kernels torch: CUDNN_ATTENTION, no_cudnn: "
        "EFFICIENT_ATTENTION)"
    )
    assert plain["result"].startswith("TIMED OUT after 170 s; ")
    assert plain["result"].endswith("no decode comparison (stopped after the steps)") and plain["rollout s"] == "3.210"
    assert (refit["model"], refit["result"]) == (
        "1B",
        "host copy + refit: 0.800 s (4.30 GB float32 copied); device copy + refit: 0.100 s (2.15 GB bfloat16 copied, "
        "0.12x)",
    )


def test_pytest_counts_read_the_closing_line_or_none():
    assert table.pytest_counts("x\n= 10 passed, 3 skipped, 2 deselected in 95.1s =\n") == {
        "passed": 10,
        "failed": 0,
        "skipped": 3,
        "errors": 0,
        "deselected": 2,
    }
    assert table.pytest_counts("1 failed, 1 error in 3.0s") == {"passed": 0, "failed": 1, "skipped": 0, "errors": 1}
    assert table.pytest_counts("collected 12 items\n....") is None  # killed before its summary
    assert table.pytest_counts("no tests ran in 0.51s")["passed"] == 0


def test_a_failed_env_part_names_the_imports_that_failed(tmp_path):
    (tmp_path / "parts.txt").write_text("part env rc=1 9s\n")
    (tmp_path / "results.jsonl").write_text(
        json.dumps(
            {
                "part": "env",
                "python": "3.12.3",
                "torch": "2.11.0",
                "cuda_available": False,
                "import_errors": {"megatron.core": "ModuleNotFoundError: No module named 'megatron'"},
            }
        )
        + "\n"
    )
    (row,) = table.rows(tmp_path)
    assert row["result"] == (
        "FAILED (rc=1); no CUDA device; Python 3.12.3, torch 2.11.0 (CUDA none), transformers ?; "
        "import megatron.core failed: ModuleNotFoundError: No module named 'megatron'"
    )


def test_bench_megatron_takes_a_model_and_appends_one_json_row_per_backend(tmp_path, monkeypatch, capsys):
    import torch

    seen = {}

    def measure(path, **kw):
        seen.update(kw, path=path)
        return [
            {
                "backend": "transformers",
                "variant": "default",
                "step_s": 2.0,
                "tokens_per_s": 100.0,
                "mfu": 0.1,
                "peak_gib": 3.0,
            },
            {
                "backend": "megatron",
                "variant": "default",
                "step_s": 1.0,
                "tokens_per_s": 200.0,
                "mfu": 0.2,
                "peak_gib": 2.5,
            },
        ]

    monkeypatch.setattr(bm, "measure", measure)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(bm, "random_llama", lambda *a: pytest.fail("--model given: no random model"))
    results = tmp_path / "results.jsonl"
    results.write_text('{"part": "env"}\n')
    argv = [
        "--size",
        "1B",
        "--model",
        str(tmp_path / "m"),
        "--steps",
        "3",
        "--json",
        str(results),
        "--out",
        str(tmp_path / "m.md"),
    ]
    bm.main(argv)
    assert seen == {
        "path": str(tmp_path / "m"),
        "batch_rows": 64,
        "length": 512,
        "steps": 3,
        "precision": "bfloat16",
        "variants": ("default",),
        "backends": ("transformers", "megatron"),
        "shared_prompts": False,
    }
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert lines[0] == {"part": "env"}
    assert [
        (r["bench"], r["size"], r["backend"], r["step_s"], r["vs_transformers"], r["device_name"]) for r in lines[1:]
    ] == [
        ("megatron", "1B", "transformers", 2.0, 1.0, "Fake GPU"),
        ("megatron", "1B", "megatron", 1.0, 0.5, "Fake GPU"),
    ]
    assert "| megatron | default | 1.000 | 200 | 20.0% | 2.5 | 0.50 |" in (tmp_path / "m.md").read_text()
    with pytest.raises(SystemExit):  # an unknown variant is refused before anything loads
        bm.main([*argv, "--variants", "default,fast"])
    # the random model gets the tokenizer it is given
    monkeypatch.setattr(bm, "random_llama", lambda target, size, tok: seen.update(tok=tok, size=size) or str(target))
    bm.main(["--size", "135M", "--tokenizer", "/tok", "--out", str(tmp_path / "m2.md")])
    assert (seen["tok"], seen["size"]) == ("/tok", "135M")


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "bench" / "step.py").exists(), reason="bench/step.py is not there yet")
def test_the_cpu_smoke_runs_every_part_end_to_end(tmp_path, real_model_dir):
    """~40-50 s on 2 cores: imports (~10 s), the tiny model, pytest -m gpu collecting (all skipped on a CPU), and
    bench.step at 2 x 2 x 4 tokens."""
    env = {**os.environ, "GPU_CHECK_SITE": str(tmp_path / "site")}
    res = subprocess.run(
        [
            "bash",
            "scripts/gpu_check.sh",
            "--cpu-smoke",
            "--out",
            str(tmp_path / "out"),
            "--cache",
            str(tmp_path / "cache"),
            "--tokenizer",
            real_model_dir,
            "--python",
            sys.executable,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = tmp_path / "out"
    parts = table.read_parts((out / "parts.txt").read_text())
    assert [(name, rc) for name, rc, _ in parts] == [
        ("env", "0"),
        ("models", "0"),
        ("pytest", "0"),
        ("steptiny", "0"),
    ], res.stdout
    summary = (out / "summary.md").read_text()
    assert summary in res.stdout
    rows = {r["part"]: r for r in table.rows(out)}
    assert "no CUDA device" in rows["env"]["result"]
    assert rows["models"]["result"].startswith("tiny built")
    assert rows["pytest"]["result"].startswith("0 passed, 0 failed, ") and "0 errors" in rows["pytest"]["result"]
    step = rows["steptiny"]
    assert step["model"].startswith("tiny") and float(step["rollout s"]) > 0 and float(step["update s"]) > 0
    assert float(step["gen tok/s"].replace(",", "")) > 0 and step["update MFU"] == "n/a"
