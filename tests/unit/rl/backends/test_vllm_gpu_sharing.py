"""vLLM beside a trainer in one process on one GPU: the engine's share fitted to the memory free at its start, its start
before the trainer loads, its level-2 sleep before the trainer computes (no weight copy to the host) and the guard
that no generate samples discarded weights, the trainer's cached memory handed back before a wake, the trainer's
micro-batch budget without the bytes a sleeping engine takes back, ``max_num_seqs`` that holds a rollout, and the
process-wide settings put back after the engine runs.

vLLM's sleep mode is CUDA-only (the CPU build ignores ``sleep``/``wake_up``): the CUDA branches run here against
monkeypatched ``torch.cuda`` functions and a recording engine; the settings test starts the real CPU build. What only
a GPU shows: the memory figures themselves, and that a level-2 wake followed by a full reload samples the trainer's
weights.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rl.backends import micro_batch as mb
from rl.backends.interfaces import PolicyVersion
from rl.backends.vllm import generation as vg
from rl.backends.vllm.process_state import ProcessSettings, settings_kept
from rl.backends.vllm.settings import engine_plan, max_num_seqs, memory_share
from rl.config import config_from_dict
from tests.unit.rl.backends.test_vllm_backend import EOS, PROMPTS, WEIGHTS, FakeLLM

GIB = 1 << 30


def _cfg(**generation):
    return config_from_dict(
        {"model": {"precision": "bfloat16"}, "generation": {"backend": "vllm", "max_new_tokens": 4, **generation}}
    )


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda``'s memory calls on a CPU build: 40 of 80 GiB free, nothing cached; calls recorded in order."""
    state = SimpleNamespace(free=40 * GIB, total=80 * GIB, calls=[])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: state.calls.append(("empty_cache",)))

    def mem_get_info(*_):
        state.calls.append(("mem_get_info",))
        return state.free, state.total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *_: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *_: 0)
    monkeypatch.setattr(mb, "_BUDGETS", {})
    monkeypatch.setattr(mb, "_ENGINE_RESERVES", {})
    return state


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.LLM`` (a :class:`FakeLLM` that keeps its keyword arguments), ``SamplingParams`` and ``TokensPrompt``."""
    made: list[FakeLLM] = []

    def llm(model, **kwargs):
        engine = FakeLLM()
        engine.kwargs = {"model": model, **kwargs}
        made.append(engine)
        return engine

    params = type("SamplingParams", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)})
    mod, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    mod.LLM, mod.SamplingParams, inputs.TokensPrompt = llm, params, dict
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(vg, "_destroy_parallel_state", lambda: None)
    return made


def _shared_backend(cfg=None, shares_gpu=True):
    """A backend whose engine runs (recording) with the CUDA plan of an engine beside a trainer."""
    cfg = cfg or _cfg()
    gen = vg.VLLMGeneration(cfg, tokenizer=SimpleNamespace(eos_token_id=EOS), model_path="unused", shares_gpu=True)
    gen._llm, gen._plan = FakeLLM(), engine_plan(cfg, "cuda", model_max_len=4096, shares_gpu=shares_gpu)
    gen._reserve_bytes = math.ceil(0.6 * 80 * GIB)
    return gen


def _model_folder(tmp_path) -> str:
    """A folder with a Llama ``config.json`` of 210,240 parameters (hidden 64, 2 layers, vocabulary 1,000, untied)."""
    config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


# ------------------------------------------------------------------------------------- the engine's share at start
def test_the_share_beside_a_trainer_is_what_is_free_at_the_start():
    cfg = _cfg()
    share = lambda free, **kw: memory_share(cfg, free_bytes=free, total_bytes=80 * GIB, **kw)  # noqa: E731
    assert share(79 * GIB, shares_gpu=True) == 0.6  # nothing loaded yet: the default share
    # a trainer loaded first holds 40 GiB: 0.6 (48 GiB) is not free; (40 - 1 margin) / 80 = 0.4875 -> 0.48
    assert share(40 * GIB, shares_gpu=True) == 0.48
    assert share(40 * GIB, shares_gpu=False) == 0.9  # a rollout pod: as asked, vLLM checks its own GPU
    assert share(40 * GIB, shares_gpu=True, min_bytes=38 * GIB) == 0.48  # 38.4 GiB still hold the engine


def test_a_share_that_cannot_fit_is_an_error_naming_the_numbers_and_the_fixes():
    with pytest.raises(
        ValueError,
        match=(
            r"^config generation.vllm_cfg.gpu_memory_utilization: is 0.7, 56.0 GiB, but only 40.0 GiB of the GPU's "
            r"80.0 GiB are free when the vLLM engine starts beside the trainer in this process; set it to at most "
            r"0.48 or to null .*resources.steps_per_task 1"
        ),
    ):
        memory_share(_cfg(vllm_cfg={"gpu_memory_utilization": 0.7}), shares_gpu=True, free_bytes=40 * GIB,
                     total_bytes=80 * GIB)  # fmt: skip
    assert (
        memory_share(
            _cfg(vllm_cfg={"gpu_memory_utilization": 0.4}), shares_gpu=True, free_bytes=40 * GIB, total_bytes=80 * GIB
        )
        == 0.4
    )  # an explicit share that is free is kept
    with pytest.raises(ValueError, match=r"^the vLLM engine needs at least 10.0 GiB .* but only 8.0 GiB of the GPU"):
        memory_share(_cfg(), shares_gpu=True, free_bytes=8 * GIB, total_bytes=80 * GIB, min_bytes=10 * GIB)


def test_the_engine_starts_with_the_fitted_share_after_the_trainers_cache_is_released(
    fake_cuda, fake_vllm, monkeypatch, tmp_path
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    folder = _model_folder(tmp_path)
    assert vg.engine_min_bytes(folder, "bfloat16") == 2 * 210_240 + GIB  # bf16 weights + 1 GiB of KV cache
    gen = vg.VLLMGeneration(_cfg(), tokenizer=None, model_path=folder, shares_gpu=True)
    assert gen.start()  # before the trainer loads: started, then asleep with its weights discarded
    (engine,) = fake_vllm
    assert fake_cuda.calls[:2] == [("empty_cache",), ("mem_get_info",)]  # cached blocks count as free for vLLM
    assert engine.kwargs["gpu_memory_utilization"] == 0.48 and engine.kwargs["enable_sleep_mode"] is True
    assert engine.calls == [("sleep", 2)] and gen.asleep and gen.discarded and gen.weight_version is None
    assert mb.engine_reserve("cuda") == math.ceil(0.48 * 80 * GIB)  # vLLM's own request: ceil(total x share)
    assert not gen.start()  # started already
    gen.shutdown()
    assert mb.engine_reserve("cuda") == 0


def test_start_is_a_no_op_on_the_cpu_and_on_a_gpu_of_its_own(fake_vllm, monkeypatch):
    assert not vg.VLLMGeneration(_cfg(), tokenizer=None, model_path="unused", shares_gpu=True).start()  # the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not vg.VLLMGeneration(_cfg(), tokenizer=None, model_path="unused", shares_gpu=False).start()
    assert fake_vllm == []


# ------------------------------------------------------------------------------- level-2 sleep and its guard
def test_a_level_2_sleep_discards_the_weights_and_only_a_whole_refit_brings_them_back(fake_cuda, fake_vllm):
    gen = _shared_backend()
    gen.refit(PolicyVersion(step=3, path="in-process"), weights=WEIGHTS)
    assert gen.weight_version == 3 and not gen.discarded
    assert gen.release_memory() and gen._llm.calls[-1] == ("sleep", 2)
    assert gen.weight_version is None  # callers refit, even to step 3 again (runtime.generation, the collector)
    with pytest.raises(RuntimeError, match=r"discarded its weights \(weight version 3\) when it slept at level 2"):
        gen.generate(PROMPTS, group_size=1, seed=0)
    assert [c[0] for c in gen._llm.calls].count("generate") == 0  # nothing sampled from garbage
    # a refit that leaves a layer out cannot make the discarded weights whole: still refused
    with pytest.raises(RuntimeError, match=r"no weights were given for the LayerNorm layer"):
        gen.refit(PolicyVersion(step=4, path="in-process"), weights=WEIGHTS[1:])
    assert gen.discarded and gen.weight_version is None
    with pytest.raises(RuntimeError, match="discarded its weights"):
        gen.generate(PROMPTS, group_size=1, seed=0)
    gen.refit(PolicyVersion(step=4, path="in-process"), weights=WEIGHTS)
    assert gen.weight_version == 4 and not gen.discarded and not gen.asleep
    assert len(gen.generate(PROMPTS, group_size=1, seed=0).input_ids) == 2


def test_a_wake_hands_the_trainers_cached_memory_back_first(fake_cuda, fake_vllm, monkeypatch):
    gen = _shared_backend()
    gen.refit(PolicyVersion(step=0, path="in-process"), weights=WEIGHTS)
    gen.release_memory()
    assert mb.engine_reserve("cuda") == math.ceil(0.6 * 80 * GIB)  # while it sleeps: left out of the trainer's budget
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: gen._llm.calls.append(("empty_cache",)))
    gen._llm.calls.clear()
    gen.refit(PolicyVersion(step=1, path="in-process"), weights=WEIGHTS)
    assert gen._llm.calls == [
        ("empty_cache",),
        ("wake_up", ("weights",)),
        ("rpc", "reload_weights"),
        ("empty_cache",),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]
    assert mb.engine_reserve("cuda") == 0  # awake: what it holds is no longer free memory


def test_a_wake_that_finds_no_memory_says_what_to_change(fake_cuda, fake_vllm):
    gen = _shared_backend()
    gen.refit(PolicyVersion(step=2, path="in-process"), weights=WEIGHTS)
    gen.release_memory()

    def out_of_memory(tags=None):
        raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp")

    gen._llm.wake_up = out_of_memory
    with pytest.raises(
        RuntimeError,
        match=(
            r"^the sleeping vLLM engine \(last at weight version 2\) could not take back its 48.0 GiB "
            r"\(gpu_memory_utilization 0.6\) with 40.0 GiB free beside the trainer"
        ),
    ) as err:
        gen.refit(PolicyVersion(step=3, path="in-process"), weights=WEIGHTS)
    assert "out of memory" in str(err.value.__cause__)


def test_release_cached_memory_touches_cuda_only(fake_cuda):
    vg.release_cached_memory("cpu")
    assert fake_cuda.calls == []
    vg.release_cached_memory("cuda")
    assert fake_cuda.calls == [("empty_cache",)]


def test_an_engine_alone_on_its_gpu_never_sleeps(fake_cuda, fake_vllm):
    gen = _shared_backend(shares_gpu=False)
    gen.refit(PolicyVersion(step=0, path="in-process"), weights=WEIGHTS)
    assert not gen.release_memory() and gen.weight_version == 0 and mb.engine_reserve("cuda") == 0


# ------------------------------------------------------------------------------------ the trainer's budget
def test_the_trainers_token_budget_leaves_out_what_a_sleeping_engine_takes_back(fake_cuda):
    from transformers import LlamaConfig

    shape = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    # 18,144 bytes per trained token (2 x 2 x (16 x 64 + 4 x 128) + 12 x 1,000); 12 x 210,240 bytes of AdamW state
    assert mb.activation_bytes_per_token(shape, train=True) == 18_144
    fake_cuda.free = GIB
    assert mb.default_max_tokens(shape, "cuda", train=True, reserved_bytes=0) == 28_672  # 0.5 x (1 GiB - 2.52 MB)
    mb._BUDGETS.clear()
    mb.set_engine_reserve("cuda", "engine", GIB // 2)  # a sleeping engine takes 0.5 GiB back at its wake
    assert mb.engine_reserve("cuda:0") == GIB // 2
    assert mb.default_max_tokens(shape, "cuda", train=True) == 14_336  # 0.5 x (0.5 GiB - 2.52 MB) / 18,144
    mb.set_engine_reserve("cuda:0", "engine", 0)
    assert mb.engine_reserve("cuda") == 0 and mb.default_max_tokens(shape, "cpu", train=True) is None


# ------------------------------------------------------------------------------------------- max_num_seqs
def test_max_num_seqs_holds_the_whole_rollout():
    rollout = {"grpo": {"num_prompts_per_step": 32, "num_generations_per_prompt": 16}}  # 512 sequences
    for generation, expected in (
        ({"batch_size": 256}, (512, 512)),  # configs/cluster.yaml used to cap vLLM at 256 this way
        ({"batch_size": 1024}, (1024, 1024)),
        ({"vllm_cfg": {"max_num_seqs": 128}}, (128, 128)),  # set: as told
        ({}, (512, 512)),  # above vLLM's smallest GPU default (256)
    ):
        cfg = config_from_dict({**rollout, "generation": {"backend": "vllm", **generation}})
        assert (max_num_seqs(cfg, "cpu"), max_num_seqs(cfg, "cuda")) == expected, generation
        assert engine_plan(cfg, "cuda", model_max_len=4096).engine["max_num_seqs"] == expected[1]


def test_the_cluster_config_schedules_its_rollout_at_once():
    from tasks.config_file import load_run_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    cfg = load_run_config(os.path.join(root, "configs", "cluster.yaml"))
    assert cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt == 512
    assert engine_plan(cfg, "cuda", model_max_len=8192, shares_gpu=False).engine["max_num_seqs"] == 512


# -------------------------------------------------------------------------------------- runtime start order
class _Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> bool:
        self.calls.append("start")
        return True

    def release_memory(self) -> bool:
        self.calls.append("release_memory")
        return True


def _run(cold: bool = False):
    from tasks.types import RunInfo

    return RunInfo(
        run_id="sharing", mlflow_run_id="0" * 32, model_path="/m", start_step=0, start_policy_path="/m", cold_tasks=cold
    )


@pytest.mark.parametrize(
    ("backend", "cold", "collector", "expected"),
    [
        ("vllm", False, False, ["start", "release_memory"]),  # a local run: the engine first, asleep for the trainer
        ("vllm", False, True, ["start"]),  # the collector's thread puts it to sleep when it waits
        ("vllm", True, False, []),  # a cluster's pods: the rollout pod's engine has its GPU alone
        ("transformers", False, False, []),
    ],
)
def test_the_trainer_gets_the_gpu_after_the_engine_started_and_slept(monkeypatch, backend, cold, collector, expected):
    from tasks import runtime
    from tasks.run_config import RunConfig

    cfg = config_from_dict({"generation": {"backend": backend}}, RunConfig)
    run, engine = _run(cold), _Engine()
    monkeypatch.setitem(runtime._BACKENDS, (run.run_id, "generation"), engine)
    if collector:
        monkeypatch.setitem(runtime._COLLECTORS, run.run_id, object())
    runtime.make_room_for_trainer(cfg, run)
    assert engine.calls == expected


# ------------------------------------------------------------------------------------- process-wide settings
def test_settings_kept_puts_back_what_a_block_changes(monkeypatch):
    monkeypatch.delenv("GRPOFLOW_PROBE", raising=False)
    monkeypatch.setenv("GRPOFLOW_GONE", "1")
    monkeypatch.delenv("GRPOFLOW_KEEP", raising=False)
    before = ProcessSettings.take()
    threads = torch.get_num_threads()
    with settings_kept(keep_env=("GRPOFLOW_KEEP",)):
        torch.set_float32_matmul_precision("medium")
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cudnn.conv.fp32_precision = "ieee"  # torch's newer API: later allow_tf32 reads would raise
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.set_default_dtype(torch.float64)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cudnn.benchmark = not before.flags["cudnn.benchmark"]
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.set_num_threads(threads + 1)
        torch.set_num_threads = lambda n: None  # as vLLM's CPU worker does
        os.environ.update(GRPOFLOW_PROBE="1", GRPOFLOW_KEEP="1")
        del os.environ["GRPOFLOW_GONE"]
    assert torch.set_num_threads(threads) is None and torch.get_num_threads() == threads  # the real function again
    after = ProcessSettings.take()  # the legacy TF32 reads work again
    assert before.differences(after) == {"env:GRPOFLOW_KEEP": (None, "1")}
    assert torch.get_default_dtype() == torch.float32 and torch.backends.cuda.flash_sdp_enabled()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_real_cpu_engine_leaves_the_trainers_settings_as_they_were(tiny_model_dir):
    """vLLM's CPU build, started and sampled in this process: every setting of ``process_state.FLAGS`` and every
    environment variable is as before, except the engine variables the plan sets on purpose. (Its start sets, e.g.,
    ``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, which this process's thread split reads, and OpenMP variables.)"""
    import flask  # noqa: F401  (the engine must start beside Flask, as in the integration tests)

    from rl.model import load_tokenizer

    cfg = config_from_dict(
        {
            "model": {"precision": "float32"},
            "generation": {"backend": "vllm", "max_new_tokens": 4, "vllm_cfg": {"max_model_len": 256}},
        }
    )
    gen = vg.VLLMGeneration(cfg, tokenizer=load_tokenizer(tiny_model_dir), model_path=tiny_model_dir)
    plan = engine_plan(cfg, "cpu", model_max_len=256)
    on_purpose = {f"env:{k}" for k in {**plan.env, **plan.env_defaults}}
    before = ProcessSettings.take()
    try:
        gen.refit(PolicyVersion(step=0, path=tiny_model_dir))
        started = ProcessSettings.take()
        out = gen.generate([[1, 2, 3]], group_size=2, seed=0)
        assert len(out.response_token_ids) == 2
        sampled = ProcessSettings.take()
        gen.refit(PolicyVersion(step=1, path="in-process"), weights=list(vg._checkpoint_weights(tiny_model_dir)))
        refitted = ProcessSettings.take()
        assert not gen.release_memory()  # the CPU build never sleeps (vLLM's sleep mode is CUDA-only)
    finally:
        gen.shutdown()
    changed = before.differences(started)
    assert set(changed) <= on_purpose, set(changed) - on_purpose  # no flag, no other variable
    assert all(os.environ[k[4:]] == v for k, (_, v) in changed.items())
    assert started.differences(sampled) == {} and sampled.differences(refitted) == {}


def test_the_guard_is_held_for_the_snapshot_and_the_restore_only():
    """With ``rl.model.model_construction`` as the guard, a model load in another thread (which switches the default
    dtype while it builds) is neither snapshotted half-way nor undone: settings as in the snapshot are not touched."""
    import contextlib

    events: list[str] = []

    @contextlib.contextmanager
    def guard():
        events.append("held")
        yield
        events.append("released")

    with settings_kept(guard=guard):
        events.append("block")
        torch.set_default_dtype(torch.float64)  # another thread's load, switched ...
        torch.set_default_dtype(torch.float32)  # ... and back before the block ends
    assert events == ["held", "released", "block", "held", "released"]
    assert torch.get_default_dtype() == torch.float32
