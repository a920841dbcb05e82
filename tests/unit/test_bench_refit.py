"""``python -m bench.refit`` on CPU with a tiny random Llama: both hand-overs run, leave the generation copy with the
trainer's weights, and are reported with the bytes they move (hand-computed for the tiny shape). The timings
themselves mean something only on a GPU."""

from __future__ import annotations

import json

import pytest

from bench.refit import WAYS, main

PARAMS = 2 * 128 * 32 + (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32
"""The tiny Llama's parameters: untied embedding and LM head (128 x 32 each), one layer (q and o 32 x 32, k and v
32 x 16, the MLP's three 32 x 64, two norms), the final norm: 17,504."""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    folder = tmp_path_factory.mktemp("refit") / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def test_the_bench_times_both_hand_overs_and_reports_what_they_move(tiny_llama, tmp_path):
    out, log = tmp_path / "refit.md", tmp_path / "refit.jsonl"
    rows = main(["--model", tiny_llama, "--device", "cpu", "--repeats", "2", "--json", str(log), "--out", str(out)])
    assert PARAMS == 17_504 and [r["way"] for r in rows] == list(WAYS)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["bench"] for r in records] == ["refit", "refit"] and records[0]["device_name"] == "cpu"
    for r in records:
        # on the CPU the generation copy is float32 and both copies are float32 host tensors: 4 bytes a parameter,
        # copied once by the hand-over and once more by the refit into the generation model
        assert r["params"] == PARAMS and r["copy_dtype"] == "float32" and r["repeats"] == 2
        assert r["copy_gb"] == pytest.approx(4 * PARAMS / 1e9) and r["moved_gb"] == pytest.approx(8 * PARAMS / 1e9)
        assert r["copy_s"] >= 0 and r["refit_s"] >= 0 and r["total_s"] >= 0
    table = out.read_text()
    assert "| host copy + refit | float32 |" in table and "| device copy + refit | float32 |" in table
    assert "`python -m bench.refit --model " in table and "--device cpu" in table


def test_the_bench_refuses_a_missing_gpu_and_zero_repeats(tiny_llama, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["--model", tiny_llama, "--device", "cuda"])
    with pytest.raises(SystemExit):
        main(["--model", tiny_llama, "--device", "cpu", "--repeats", "0"])
