"""The settings the vLLM back-end gives vLLM on each device (`rl.backends.vllm.settings`), pure: no vLLM, no engine.
The CUDA build cannot run in CI; these pin what a GPU gets, and tests/integration/test_vllm.py checks the CPU build's
behaviour."""

from __future__ import annotations

import pytest
import torch

from rl.backends.vllm.settings import engine_plan, logprobs_mode, seeds_requests
from rl.config import config_from_dict


def _cfg(precision="float32", **sections):
    sections.setdefault("generation", {})
    sections["generation"] = {"backend": "vllm", **sections["generation"]}
    return config_from_dict({"model": {"precision": precision}, **sections})


def test_the_cpu_keeps_the_settings_seeded_requests_need_there():
    plan = engine_plan(_cfg(), "cpu", model_max_len=8192)
    assert plan.engine == {
        "dtype": "float32",
        "seed": 42,
        "max_model_len": 2048,
        "enable_prefix_caching": True,
        "logprobs_mode": "raw_logprobs",
        "max_num_seqs": 64,
        "enforce_eager": True,
        "enable_chunked_prefill": False,  # a seeded prefill split across steps kills the CPU engine
        "max_num_batched_tokens": 4096,
    }
    assert (plan.seeded, plan.waves, plan.sleeps) == (True, True, False)
    assert plan.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert plan.env_defaults == {"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "2"}


def test_a_gpu_gets_chunked_prefill_no_waves_cuda_graphs_bf16_and_its_memory_share():
    plan = engine_plan(_cfg("bfloat16"), "cuda", model_max_len=8192)
    assert plan.engine == {
        "dtype": "bfloat16",
        "seed": 42,
        "max_model_len": 2048,
        "enable_prefix_caching": True,
        "logprobs_mode": "raw_logprobs",
        "enforce_eager": False,  # CUDA graphs on
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": 0.9,  # null: the GPU is the engine's alone (vLLM's default)
        "enable_sleep_mode": False,
    }  # no max_num_seqs and no max_num_batched_tokens: vLLM's own defaults for the GPU
    assert plan.dtype == "bfloat16"
    # optim.deterministic null resolves to false on CUDA: no seed per request, no waves (CUDA resumes preempted
    # requests)
    assert (plan.seeded, plan.waves, plan.sleeps) == (False, False, False)
    assert plan.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} and "VLLM_CPU_KVCACHE_SPACE" not in plan.env_defaults


def test_a_gpu_shared_with_a_trainer_leaves_it_memory_unless_told_otherwise():
    cfg = _cfg("bfloat16")
    assert engine_plan(cfg, "cuda", model_max_len=8192, shares_gpu=True).engine["gpu_memory_utilization"] == 0.6
    assert engine_plan(cfg, "cuda", model_max_len=8192, shares_gpu=False).engine["gpu_memory_utilization"] == 0.9
    told = _cfg("bfloat16", generation={"vllm_cfg": {"gpu_memory_utilization": 0.75}})
    assert {
        engine_plan(told, "cuda", model_max_len=8192, shares_gpu=s).engine["gpu_memory_utilization"]
        for s in (True, False)
    } == {0.75}


def test_a_gpu_takes_its_engine_sizes_from_vllm_cfg_and_sleeps_beside_a_trainer():
    cfg = _cfg(
        "bfloat16", generation={"vllm_cfg": {"max_num_seqs": 256, "gpu_memory_utilization": 0.4, "enforce_eager": True}}
    )
    plan = engine_plan(cfg, "cuda", model_max_len=8192, shares_gpu=True)
    assert plan.engine["max_num_seqs"] == 256 and plan.engine["gpu_memory_utilization"] == 0.4
    assert plan.engine["enforce_eager"] is True
    assert plan.engine["enable_sleep_mode"] is True and plan.sleeps
    # the CPU build has no sleep mode: a trainer beside it changes nothing
    cpu = engine_plan(cfg, "cpu", model_max_len=8192, shares_gpu=True)
    assert not cpu.sleeps and "enable_sleep_mode" not in cpu.engine and "gpu_memory_utilization" not in cpu.engine


def test_auto_precision_resolves_per_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert engine_plan(_cfg("auto"), "cuda", model_max_len=4096).dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert engine_plan(_cfg("auto"), "cuda", model_max_len=4096).dtype == "float32"
    assert engine_plan(_cfg("float32"), "cuda", model_max_len=4096).dtype == "float32"


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        ({}, (64, None)),
        ({"batch_size": 128}, (128, 128)),
        ({"batch_size": 128, "vllm_cfg": {"max_num_seqs": 32}}, (32, 32)),
    ],
)
def test_max_num_seqs_is_vllm_cfg_then_batch_size_then_the_device_default(generation, expected):
    cfg = _cfg(generation=generation)
    got = tuple(engine_plan(cfg, device, model_max_len=4096).engine.get("max_num_seqs") for device in ("cpu", "cuda"))
    assert got == expected


def test_lengths_are_capped_by_the_model():
    cfg = _cfg(generation={"vllm_cfg": {"max_model_len": 8192}})
    cpu = engine_plan(cfg, "cpu", model_max_len=6000)
    assert (
        cpu.engine["max_model_len"] == 6000 and cpu.engine["max_num_batched_tokens"] == 6000
    )  # a whole prefill fits a step
    assert engine_plan(cfg, "cuda", model_max_len=512).engine["max_model_len"] == 512


@pytest.mark.parametrize(
    ("vllm_cfg", "optim", "cpu", "cuda"),
    [
        ({}, {}, True, False),  # optim.deterministic null: true on the CPU, false on CUDA
        ({}, {"deterministic": True}, True, True),  # reproducibility asked for: seeds on CUDA too
        ({}, {"deterministic": False}, False, False),
        ({"seed_per_request": True}, {"deterministic": False}, True, True),  # the explicit setting wins
        ({"seed_per_request": False}, {}, False, False),
    ],
)
def test_seeds_per_request_only_where_reproducibility_is_asked_for(vllm_cfg, optim, cpu, cuda):
    cfg = _cfg(generation={"vllm_cfg": vllm_cfg}, optim=optim)
    assert (seeds_requests(cfg, "cpu"), seeds_requests(cfg, "cuda")) == (cpu, cuda)
    plan = engine_plan(cfg, "cpu", model_max_len=4096)
    # the CPU's waves and whole prefills exist for seeded requests only
    assert (plan.seeded, plan.waves, plan.engine["enable_chunked_prefill"]) == (cpu, cpu, not cpu)
    gpu = engine_plan(cfg, "cuda", model_max_len=4096)
    assert (gpu.seeded, gpu.waves, gpu.engine["enable_chunked_prefill"]) == (cuda, False, True)


@pytest.mark.parametrize(
    ("temperature", "top_p", "mode"),
    [(1.0, 1.0, "raw_logprobs"), (1.0, 0.9, "raw_logprobs"), (0.7, 1.0, "processed_logprobs")],
)
def test_logprobs_mode_gives_the_untruncated_temperature_scaled_logprob(temperature, top_p, mode):
    cfg = _cfg(generation={"temperature": temperature, "top_p": top_p})
    assert logprobs_mode(cfg) == mode
    assert engine_plan(cfg, "cuda", model_max_len=4096).engine["logprobs_mode"] == mode


def test_top_p_below_1_at_another_temperature_is_refused_for_vllm_only():
    with pytest.raises(
        ValueError,
        match=r"config generation.top_p: is 0.9 with temperature 0.7 on the vllm back-end.*set temperature 1",
    ):
        _cfg(generation={"temperature": 0.7, "top_p": 0.9})
    hf = config_from_dict(
        {"generation": {"backend": "transformers", "temperature": 0.7, "top_p": 0.9}}
    )  # it reports them
    with pytest.raises(ValueError, match="never the untruncated temperature-scaled ones"):
        logprobs_mode(hf)


def test_new_vllm_cfg_values_are_checked():
    with pytest.raises(ValueError, match=r"config generation.vllm_cfg.max_num_seqs: is 0; use at least 1"):
        _cfg(generation={"vllm_cfg": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match=r"generation.vllm_cfg.seed_per_request"):
        _cfg(generation={"vllm_cfg": {"seed_per_request": "yes"}})


def test_an_unknown_device_is_refused():
    with pytest.raises(ValueError, match=r"vLLM runs on \['cpu', 'cuda'\], not 'mps'"):
        engine_plan(_cfg(), "mps", model_max_len=4096)
