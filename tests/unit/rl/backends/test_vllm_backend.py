"""What the vLLM back-end asks of its engine, against a recording stand-in for ``vllm.LLM`` (no vLLM needed): seeds
and waves as the plan says, sleep and wake around calls when the engine shares a GPU with a trainer, refits in the
engine's dtype, and the reload's "Failed to load weights" report: silent for layers no checkpoint holds, an error for
any other. tests/integration/test_vllm.py runs the same paths on vLLM's CPU build."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rl.backends.interfaces import PolicyVersion
from rl.backends.vllm import generation as vg
from rl.backends.vllm.settings import engine_plan
from rl.config import config_from_dict

EOS = 2


class _Rotary(torch.nn.Module):
    """Like vLLM's RotaryEmbedding: only a non-persistent buffer computed at construction."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4, 2), persistent=False)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(2)
        self.rotary = _Rotary()


class FakeLLM:
    """Records the calls the back-end makes; generates ``[7, EOS]`` for every completion; its reload logs vLLM's
    "Failed to load weights" for the rotary layer and for every layer whose weights were left out."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.loaded: dict[str, torch.dtype] = {}
        self.cache_tokens = 10_000
        self.llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(num_gpu_blocks=self.cache_tokens // 16, block_size=16)
            )
        )

    def apply_model(self, fn):
        return [fn(_Model())]

    def collective_rpc(self, method, kwargs):
        self.calls.append(("rpc", method))
        self.loaded = {name: t.dtype for name, t in kwargs["weights_iterator"]}
        log = logging.getLogger(vg._LAYERWISE_LOGGER)
        log.warning("%s: Failed to load weights", "_Rotary")  # vLLM says so of every rotary embedding, every reload
        if "norm.weight" not in self.loaded:
            log.warning("%s: Failed to load weights", "LayerNorm")

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def generate(self, prompts, params, use_tqdm):
        self.calls.append(("generate", len(prompts), tuple(p.kwargs["seed"] for p in params)))
        completion = SimpleNamespace(
            token_ids=[7, EOS], logprobs=[{7: SimpleNamespace(logprob=-0.5)}, {EOS: SimpleNamespace(logprob=-0.25)}]
        )
        return [SimpleNamespace(outputs=[replace_index(completion, i) for i in range(p.kwargs["n"])]) for p in params]


def replace_index(completion, i):
    return SimpleNamespace(index=i, token_ids=completion.token_ids, logprobs=completion.logprobs)


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.SamplingParams`` and ``vllm.inputs.TokensPrompt`` stand-ins: what ``generate`` imports."""
    params = type("SamplingParams", (), {"__init__": lambda self, **kw: setattr(self, "kwargs", kw)})
    mod, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    mod.SamplingParams, inputs.TokensPrompt = params, dict
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)


def _backend(device="cpu", *, shares_gpu=False, precision="float32", **vllm_cfg):
    cfg = config_from_dict(
        {
            "model": {"precision": precision},
            "generation": {"backend": "vllm", "max_new_tokens": 4, "vllm_cfg": vllm_cfg},
        }
    )
    gen = vg.VLLMGeneration(
        cfg, tokenizer=SimpleNamespace(eos_token_id=EOS), model_path="unused", shares_gpu=shares_gpu
    )
    gen._llm, gen._plan = FakeLLM(), engine_plan(cfg, device, model_max_len=4096, shares_gpu=shares_gpu)
    return gen


PROMPTS = [[1, 5, 6], [1, 8]]
WEIGHTS = [("norm.weight", torch.ones(2)), ("norm.bias", torch.zeros(2)), ("step", torch.tensor([3]))]


def test_seeded_requests_on_the_cpu_go_in_waves_that_fit_the_cache(fake_vllm):
    gen = _backend()
    gen._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks = (
        3  # 48 tokens: a group needs 2 x one 16-token block = 32
    )
    out = gen.generate(PROMPTS, group_size=2, seed=5)
    seeds = [vg.request_seed(5, 0), vg.request_seed(5, 1)]
    assert gen._llm.calls == [("generate", 1, (seeds[0],)), ("generate", 1, (seeds[1],))]
    assert out.response_token_ids == [[7, EOS]] * 4 and not bool(out.truncated.any())
    assert torch.equal(out.generation_logprobs[0], torch.tensor([0.0, 0.0, 0.0, -0.5, -0.25]))


def test_unseeded_requests_go_in_one_call(fake_vllm):
    gen = _backend("cuda", precision="bfloat16")  # optim.deterministic null: no seeds on CUDA
    gen._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks = 1  # would need waves, were they seeded on a CPU
    gen.generate(PROMPTS, group_size=2, seed=5)
    assert gen._llm.calls == [("generate", 2, (None, None))]


def test_beside_a_trainer_the_engine_sleeps_when_released_and_wakes_weights_before_a_refit(fake_vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the CUDA branch's reserve bookkeeping, on a CPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    gen = _backend("cuda", shares_gpu=True, precision="bfloat16")
    gen.refit(PolicyVersion(step=0, path="in-process"), weights=WEIGHTS)
    gen.generate(PROMPTS, group_size=2, seed=1)
    gen.generate(PROMPTS, group_size=2, seed=2)  # dynamic sampling's next batch: no sleep or wake in between
    assert not gen.asleep and [c[0] for c in gen._llm.calls].count("sleep") == 0
    assert gen.release_memory() and gen.asleep and gen._llm.calls[-1] == ("sleep", 2)
    assert not gen.release_memory()  # asleep already
    gen._llm.calls.clear()
    gen.refit(PolicyVersion(step=1, path="in-process"), weights=WEIGHTS)
    # weights back first, the KV cache only once the refit's buffers are gone, then the stale prefix cache dropped
    assert gen._llm.calls == [
        ("wake_up", ("weights",)),
        ("rpc", "reload_weights"),
        ("wake_up", ("kv_cache",)),
        ("reset_prefix_cache",),
    ]
    assert not gen.asleep and gen.weight_version == 1
    gen._llm.calls.clear()
    gen.generate(PROMPTS, group_size=1, seed=2, greedy=True)
    assert [c[0] for c in gen._llm.calls] == ["generate"]  # awake already: no wake before it, no sleep after


def test_alone_on_its_gpu_the_engine_never_sleeps(fake_vllm):
    gen = _backend("cuda", precision="bfloat16")
    gen.generate(PROMPTS, group_size=2, seed=1)
    gen.refit(PolicyVersion(step=1, path="in-process"), weights=WEIGHTS)
    assert not [c for c in gen._llm.calls if c[0] in ("sleep", "wake_up")]


@pytest.mark.parametrize(("precision", "expected"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_refits_hand_vllm_weights_in_the_engine_dtype(fake_vllm, precision, expected):
    gen = _backend("cuda", precision=precision)
    gen.refit(PolicyVersion(step=1, path="in-process"), weights=WEIGHTS)
    assert gen._llm.loaded == {
        "norm.weight": expected,
        "norm.bias": expected,
        "step": torch.int64,
    }  # integers as they are


def test_casting_first_gives_vllm_the_values_its_own_cast_would():
    master = torch.randn(1000) * 3  # float32, many values between bf16 neighbours
    ((_, cast),) = vg._in_dtype([("w", master)], "bfloat16")
    into = torch.empty(1000, dtype=torch.bfloat16).copy_(master)  # what vLLM's loader does with a float32 tensor
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, into)


def test_the_rotary_report_is_silent_and_a_left_out_layer_is_an_error(fake_vllm):
    gen = _backend()
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = seen.append
    log = logging.getLogger(vg._LAYERWISE_LOGGER)
    log.addHandler(handler)
    try:
        gen.refit(PolicyVersion(step=1, path="in-process"), weights=WEIGHTS)
        assert gen.weight_version == 1 and not seen  # the rotary layer's cache is computed, not loaded: no warning
        assert gen._derived_layers == {"_Rotary"}
        with pytest.raises(
            RuntimeError, match=r"vLLM refit to step 2: no weights were given for the LayerNorm layer\(s\)"
        ):
            gen.refit(PolicyVersion(step=2, path="in-process"), weights=WEIGHTS[1:])
        assert gen.weight_version == 1 and not seen
        log.warning("unrelated")  # the filter is gone after the reload
        assert [r.getMessage() for r in seen] == ["unrelated"]
    finally:
        log.removeHandler(handler)


def test_the_derived_layers_are_those_with_only_non_persistent_buffers():
    class WithParam(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.coef = torch.nn.Parameter(torch.ones(2))  # learned, as a Fourier RoPE's coefficients
            self.register_buffer("cache", torch.ones(2), persistent=False)

    class Persistent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.ones(2))  # in the state dict: a checkpoint can hold it

    model = torch.nn.ModuleList([_Rotary(), WithParam(), Persistent(), torch.nn.Identity()])
    assert vg._derived_only_layers(model) == ["_Rotary"]


def test_generate_before_any_refit_says_so():
    cfg = config_from_dict({"generation": {"backend": "vllm"}})
    with pytest.raises(RuntimeError, match="holds no weights yet"):
        vg.VLLMGeneration(cfg, tokenizer=None, model_path="unused").generate(PROMPTS, group_size=2, seed=0)


def test_without_seeds_the_cpu_needs_no_waves_either(fake_vllm):
    gen = _backend(seed_per_request=False)
    gen._llm.llm_engine.vllm_config.cache_config.num_gpu_blocks = 1  # unseeded requests may be preempted: one call
    gen.generate(PROMPTS, group_size=2, seed=1)
    assert gen._llm.calls == [("generate", 2, (None, None))]


def test_a_prompt_that_does_not_fit_max_model_len_is_refused_before_the_engine_runs(fake_vllm):
    gen = _backend()
    gen._context = (8, "generation.vllm_cfg.max_model_len")  # as `_start` sets it from the config and the model
    gen.generate([[1, 2, 3, 4]], group_size=2, seed=0)  # 4 + max_new_tokens 4 = 8: fits
    calls = len(gen._llm.calls)
    with pytest.raises(
        ValueError,
        match=(
            r"^config generation.max_new_tokens: 4 plus the longest prompt's 5 tokens is more than the 8 tokens of "
            r"generation.vllm_cfg.max_model_len"
        ),
    ):
        gen.generate([[1, 2], [1, 2, 3, 4, 5]], group_size=2, seed=0)
    assert len(gen._llm.calls) == calls  # nothing was submitted
