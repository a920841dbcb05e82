"""The vLLM generation back-end: vLLM's offline engine in this process, ``n = G`` per prompt (the G completions
share their prompt's KV cache), the sampled tokens' logprobs in float32, and weights refitted in place (no engine
restart, no disk round trip when a trainer in this process holds them), handed to vLLM in the engine's dtype.

What the engine gets on each device (chunked prefill, KV-cache waves, ``max_num_seqs``, ``gpu_memory_utilization``,
dtype, CUDA graphs, sleep mode, seeds per request, logprobs mode) is decided in :mod:`rl.backends.vllm.settings`.

``generation_logprobs`` mean what the transformers back-end's and the training forward's do: log softmax(logits /
temperature) of the sampled token over the whole vocabulary, before top-p truncation
(:func:`rl.backends.vllm.settings.logprobs_mode`); the config refuses ``top_p < 1`` with a temperature other than 1,
where vLLM cannot report that. Completions of the two back-ends differ for the same seed (different RNGs).

Beside a trainer on one CUDA GPU (``shares_gpu``) the engine starts before the trainer loads where it can
(:meth:`VLLMGeneration.start`), with a share of the memory fitted to what is free
(:func:`rl.backends.vllm.settings.memory_share`); it sleeps at level 2 (weights and KV cache discarded: nothing is
copied to host memory, since the refit that follows overwrites every weight) when the trainer is about to compute
(:meth:`VLLMGeneration.release_memory`), and its wake for the next refit first hands the trainer's cached blocks back
to the driver (``torch.cuda.empty_cache``). While it sleeps the bytes it takes back at its wake are left out of the
trainer's micro-batch budget (:func:`rl.backends.micro_batch.set_engine_reserve`). A ``generate`` after a level-2
sleep with no refit since raises instead of sampling from discarded weights. Process-wide settings the engine
changes (torch's math flags, the default dtype, the SDPA switches, the environment) are put back after its start,
every refit and every ``generate`` (:mod:`rl.backends.vllm.process_state`). What only a GPU shows: the memory
figures themselves, and that vLLM's level-2 wake followed by a full reload samples what the trainer holds.

A refit never logs vLLM's ``<Layer>: Failed to load weights`` for layers that hold nothing a checkpoint has (the
rotary embedding's cos/sin cache, computed from the config: vLLM rightly keeps it); for any other layer it is an
error (:class:`RuntimeError`), since vLLM would keep that layer's old weights.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import math
import os
import random
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rl.backends.interfaces import Generated, GenerationBackend, PolicyVersion
from rl.backends.micro_batch import parameter_count, set_engine_reserve
from rl.backends.vllm.process_state import settings_kept
from rl.backends.vllm.settings import SLEEP_LEVEL, EnginePlan, engine_plan, memory_share
from rl.config import GRPOConfig
from rl.lengths import check_fits, context_limit, model_max_len
from rl.model import model_construction
from rl.precision import resolve

SLEEP_TAGS = ("weights", "kv_cache")
"""What a sleep releases (the weights, the KV cache): the tags ``LLM.wake_up`` takes back, weights first."""

MIN_KV_CACHE_BYTES = 1 << 30
"""KV cache an engine beside a trainer needs at least, besides its weights, for its start to be worth it."""

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's in-place reload (``reload/layerwise.py``), which reports layers it was given no weights for."""


def request_seed(seed: int, index: int) -> int:
    """Seed of request ``index`` of a call seeded ``seed``: a 62-bit hash, so the per-completion seeds vLLM derives
    from it (seed + completion index) never collide across requests or calls."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{index}".encode()).digest()[:8], "big") >> 2


def release_cached_memory(device: str) -> None:
    """Hand this process's cached but unused CUDA blocks (the trainer's freed activations) back to the driver, so that
    a vLLM engine's start or wake, which allocates outside torch's caching allocator, finds them free. A no-op on the
    CPU."""
    if device == "cuda":
        torch.cuda.empty_cache()


def wake_failure(step: int | None, free_bytes: int, reserve_bytes: int, share: float) -> str:
    """The message of a failed wake: what the engine asked back, what was free, and the fixes.

    Example:
        >>> print(wake_failure(3, 10 << 30, 24 << 30, 0.3))  # doctest: +NORMALIZE_WHITESPACE
        the sleeping vLLM engine (last at weight version 3) could not take back its 24.0 GiB (gpu_memory_utilization
        0.3) with 10.0 GiB free beside the trainer in this process: lower generation.vllm_cfg.gpu_memory_utilization,
        or the trainer's memory (optim.train_max_tokens_per_micro_batch, logprob_max_tokens_per_micro_batch), or use
        resources.steps_per_task 1 so that rollouts run on a GPU of their own
    """
    gib = 1 << 30
    return (
        f"the sleeping vLLM engine (last at weight version {step}) could not take back its {reserve_bytes / gib:.1f} "
        f"GiB (gpu_memory_utilization {share}) with {free_bytes / gib:.1f} GiB free beside the trainer in this "
        "process: lower generation.vllm_cfg.gpu_memory_utilization, or the trainer's memory "
        "(optim.train_max_tokens_per_micro_batch, logprob_max_tokens_per_micro_batch), or use "
        "resources.steps_per_task 1 so that rollouts run on a GPU of their own"
    )


def engine_min_bytes(folder: str, dtype: str) -> int:
    """The least device memory an engine of the HF model in ``folder`` runs in: its weights in ``dtype``
    (:func:`rl.backends.micro_batch.parameter_count` of its ``config.json``) plus :data:`MIN_KV_CACHE_BYTES`."""
    config = SimpleNamespace(**json.loads((Path(folder) / "config.json").read_text()))
    return parameter_count(config) * (2 if dtype == "bfloat16" else 4) + MIN_KV_CACHE_BYTES


def waves(needs: list[int], capacity: int) -> list[list[int]]:
    """Split requests into consecutive waves whose summed KV-cache need fits ``capacity`` (tokens).

    vLLM preempts running sequences when its KV cache fills, and a seeded request cannot be preempted on CPU (the
    engine dies with ``CPU Generator does not use offset``); submitting waves that fit means it never has to.

    Args:
        needs: per request, the KV-cache tokens it can occupy at most (G * (prompt + max_new_tokens) + slack).
        capacity: tokens the engine's KV cache holds.

    Returns:
        lists of request indices, in order.

    Raises:
        ValueError: one request alone needs more than ``capacity``.
    """
    out: list[list[int]] = []
    used = capacity + 1
    for i, need in enumerate(needs):
        if need > capacity:
            msg = (
                f"one prompt's group needs {need} KV-cache tokens but the vLLM engine holds {capacity}; raise "
                "generation.vllm_cfg.cpu_kv_cache_gib, or lower "
                "grpo.num_generations_per_prompt or generation.max_new_tokens"
            )
            raise ValueError(msg)
        if used + need > capacity:
            out.append([])
            used = 0
        out[-1].append(i)
        used += need
    return out


class VLLMGeneration(GenerationBackend):
    """Generation with vLLM's ``LLM`` engine, in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine process
    to spawn, so no ``__main__`` guard is needed and the weights can be updated without pickling them).

    Args:
        cfg: the run's config (``generation`` sampling and ``vllm_cfg`` engine settings, ``model.precision``,
            ``optim.deterministic``).
        tokenizer: the model's tokenizer (its eos id ends completions, as in the transformers back-end).
        model_path: the base model folder: the engine a warm :meth:`refit` starts from.
        shares_gpu: a trainer in this process computes on the same GPU (a local run, or steps run together in one
            task; not a cluster's rollout pod): on CUDA the engine then starts with a share fitted to the free memory,
            sleeps at level 2 when :meth:`release_memory` is called (before the trainer computes), and wakes for the
            next refit, so that the trainer has the GPU's memory meanwhile. Ignored on the CPU.
    """

    name = "vllm"

    def __init__(self, cfg: GRPOConfig, *, tokenizer: Any, model_path: str, shares_gpu: bool = False) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._model_path = model_path
        self._shares_gpu = shares_gpu
        self._llm: Any = None
        self._plan: EnginePlan | None = None
        self._version: int | None = None
        self._sleeping: set[str] = set()
        self._discarded = False  # the weights are gone (a level-2 sleep): only a whole refit brings them back
        self._reserve_bytes = 0  # device bytes the engine holds awake (its share of the GPU); 0 on the CPU
        self._derived_layers: frozenset[str] | None = None
        self._context: tuple[int, str] = (1 << 30, "")  # (tokens, what sets them) once the engine has started
        self._lock = threading.RLock()  # one caller at a time (a collector thread beside the main thread)

    @property
    def weight_version(self) -> int | None:
        """The policy step whose weights the engine holds; None before the first refit and while a level-2 sleep has
        discarded them (a caller then refits, even to the same step)."""
        return None if self._discarded else self._version

    @property
    def plan(self) -> EnginePlan | None:
        """The settings the running engine was started with (None before the first load)."""
        return self._plan

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps (while the trainer beside it computes)."""
        return bool(self._sleeping)

    @property
    def discarded(self) -> bool:
        """Whether the engine's weights were discarded (a level-2 sleep, or a refit that failed after one)."""
        return self._discarded

    # ------------------------------------------------------------------------------------------ engine
    @staticmethod
    def _device() -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _serving_dtype(self) -> str | None:
        """``"bfloat16"`` where the engine computes in it: a checkpoint's bf16 copy is then what a cold load reads."""
        return "bfloat16" if resolve(self._cfg.model.precision, self._device()) == "bfloat16" else None

    def _start(self, folder: str) -> None:
        device = self._device()
        self._context = context_limit(self._cfg, model_max_len(folder))
        share, total = None, 0
        if device == "cuda":
            release_cached_memory(device)  # the trainer's cached blocks count as free for vLLM's start check
            free, total = torch.cuda.mem_get_info()
            dtype = engine_plan(self._cfg, device, model_max_len=self._context[0]).dtype
            share = memory_share(
                self._cfg,
                shares_gpu=self._shares_gpu,
                free_bytes=free,
                total_bytes=total,
                min_bytes=engine_min_bytes(folder, dtype),
            )
        plan = engine_plan(
            self._cfg,
            device,
            model_max_len=self._context[0],
            shares_gpu=self._shares_gpu,
            gpu_memory_utilization=share,
        )
        os.environ.update(plan.env)
        for key, value in plan.env_defaults.items():
            os.environ.setdefault(key, value)
        # the engine builds its model with the process's default dtype switched: no other load beside it; what
        # importing vLLM sets in the environment (cv2's LD_LIBRARY_PATH, inductor and Triton variables) is undone too
        with model_construction(), _rng_kept(), settings_kept(), _werkzeug_proxies_hidden():
            from vllm import LLM

            self._llm = LLM(model=folder, **plan.engine)
        self._plan, self._sleeping, self._discarded, self._derived_layers = plan, set(), False, None
        # vLLM's own request: ceil(total x share) (``vllm/v1/worker/utils.py`` ``request_memory``)
        self._reserve_bytes = math.ceil(total * share) if share is not None else 0

    def start(self) -> bool:
        """Start the engine now, on the base model, and put it to sleep, where it will share a CUDA GPU with a trainer
        in this process and has not started yet: called before the trainer loads, so that the engine's start finds
        its share free (vLLM's start fails unless ``gpu_memory_utilization`` x the GPU's memory is free). The next
        refit loads the weights. Returns whether it started the engine (False: the CPU, a GPU of its own, or
        started already)."""
        with self._lock:
            if self._llm is not None or not self._shares_gpu or self._device() != "cuda":
                return False
            self._start(self._model_path)
            self.release_memory()
            return True

    def kv_cache_tokens(self) -> int:
        """Tokens the engine's KV cache holds."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks) * int(cache.block_size)

    def kv_tokens_needed(self, prompts: list[list[int]], group_size: int) -> list[int]:
        """Per prompt, the most KV-cache tokens its group can hold: G sequences of prompt + max_new_tokens, each
        rounded up to whole blocks (an upper bound: the G completions share the prompt's full blocks)."""
        block = int(self._llm.llm_engine.vllm_config.cache_config.block_size)
        longest = self._cfg.generation.max_new_tokens
        return [group_size * -(-(len(p) + longest) // block) * block for p in prompts]

    def _wake(self, *tags: str) -> None:
        """Take back what a sleep released: ``tags`` of :data:`SLEEP_TAGS` (all when none are named), after handing
        the trainer's cached CUDA blocks back to the driver (vLLM's wake allocates outside torch's allocator).

        Raises:
            RuntimeError: the wake failed for want of memory (:func:`wake_failure`; vLLM's error is the cause).
        """
        wanted = [t for t in (tags or SLEEP_TAGS) if t in self._sleeping]
        if not wanted:
            return
        device = self._plan.device if self._plan is not None else "cpu"
        release_cached_memory(device)
        try:
            self._llm.wake_up(tags=wanted)
        except (RuntimeError, torch.OutOfMemoryError) as err:
            free = torch.cuda.mem_get_info()[0] if device == "cuda" else 0
            share = float(self._plan.engine.get("gpu_memory_utilization", 0.0)) if self._plan is not None else 0.0
            raise RuntimeError(wake_failure(self._version, free, self._reserve_bytes, share)) from err
        self._sleeping.difference_update(wanted)
        if not self._sleeping:
            set_engine_reserve(device, self._owner, 0)  # awake: what it holds is no longer free

    @property
    def _owner(self) -> str:
        return f"vllm-{id(self)}"

    def release_memory(self) -> bool:
        """Sleep at :data:`rl.backends.vllm.settings.SLEEP_LEVEL` (2: weights and KV cache discarded, nothing copied
        to host memory) where the plan shares its GPU with a trainer and the engine is awake: call it before the
        trainer computes. The weights are gone afterwards: :attr:`weight_version` is None and the next refit must
        give every weight (:meth:`generate` raises until then). The bytes the engine takes back at its wake are
        recorded for the trainer's micro-batch budget (:func:`rl.backends.micro_batch.set_engine_reserve`).

        Returns:
            whether the engine went to sleep (False: no engine, already asleep, or a plan that never sleeps).
        """
        with self._lock:
            if self._llm is None or self._plan is None or not self._plan.sleeps or self._sleeping:
                return False
            self._llm.sleep(level=SLEEP_LEVEL)
            self._sleeping, self._discarded = set(SLEEP_TAGS), SLEEP_LEVEL >= 2
            set_engine_reserve(self._plan.device, self._owner, self._reserve_bytes)
            return True

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """vLLM's in-place reload (``Worker.reload_weights``: layer by layer, re-running each layer's post-load
        processing, so weights a CPU kernel repacked are repacked again) of ``weights`` cast to the engine's dtype,
        then drop the prefix cache, whose prompt KV was computed with the old weights. A sleeping engine wakes its
        weights first and its KV cache after, so the refit's buffers and the KV cache are never resident together
        (NeMo-RL's and verl's order). After a level-2 sleep the woken weights hold garbage until this reload.

        Raises:
            RuntimeError: ``weights`` left out every tensor of a layer that holds trained weights (vLLM would keep
                its old ones, or garbage after a level-2 sleep: the engine then counts as discarded).
        """
        if self._derived_layers is None:  # before any reload: afterwards vLLM has re-registered the buffers
            self._derived_layers = frozenset(self._llm.apply_model(_derived_only_layers)[0])
        self._wake("weights")
        dtype = self._plan.dtype if self._plan is not None else None
        with _layers_left_unloaded() as unloaded, settings_kept(guard=model_construction):
            self._llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": _in_dtype(weights, dtype), "is_checkpoint_format": True}
            )
        self._wake()
        self._llm.reset_prefix_cache()
        stale = sorted(set(unloaded) - self._derived_layers)
        if stale:
            msg = (
                f"vLLM refit to step {step}: no weights were given for the {', '.join(stale)} layer(s), so the engine "
                "kept their previous values; a refit must give every tensor of the model under its HF name (a tied "
                "LM head as lm_head.weight too)"
            )
            raise RuntimeError(msg)
        self._discarded = False

    # --------------------------------------------------------------------------------------- interface
    def refit(self, version: PolicyVersion, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        with self._lock:
            self._refit(version, weights)

    def _refit(self, version: PolicyVersion, weights: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        from rl.checkpoint import local_copy, local_folder

        if weights is None:
            so = self._cfg.dataplane.storage_options
            # the checkpoint's copy in the engine's dtype where it has one; never the trainer state
            part = {"require_complete": version.step > 0, "weights_only": True, "dtype": self._serving_dtype()}
            adapter = self._cfg.policy.lora is not None and version.step > 0  # a LoRA checkpoint holds the adapter
            if (
                self._llm is None and not adapter
            ):  # the engine keeps reading its model folder: a remote one's copy stays
                self._start(local_copy(version.path, so, **part))
            else:
                if self._llm is None:  # the engine starts on the base model, then takes the merged weights
                    self._start(self._model_path)
                with local_folder(version.path, so, **part) as folder:
                    self._reload(_folder_weights(folder, self._model_path), version.step)
        else:
            if self._llm is None:
                self._start(self._model_path)
            self._reload(list(weights), version.step)  # the (name, tensor) pairs now; each cast as vLLM loads it
        self._version = version.step

    def generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        seed: int,
        greedy: bool = False,
        stop_strings: list[list[str] | None] | None = None,
    ) -> Generated:
        """See :meth:`GenerationBackend.generate`; the engine stays awake afterwards (:meth:`release_memory` puts it
        to sleep). A prompt with stop strings gets vLLM's own ``stop`` (``include_stop_str_in_output``; its output is
        detokenized for the check).

        Raises:
            RuntimeError: no refit yet, or the weights were discarded by a level-2 sleep (or a failed refit after
                one) and no refit has loaded them since.
        """
        with self._lock:
            return self._generate(prompts, group_size=group_size, seed=seed, greedy=greedy, stop_strings=stop_strings)

    def _generate(
        self,
        prompts: list[list[int]],
        *,
        group_size: int,
        seed: int,
        greedy: bool,
        stop_strings: list[list[str] | None] | None,
    ) -> Generated:
        if self._llm is None or self._plan is None:
            msg = "the vLLM generation back-end holds no weights yet: call refit(version) first"
            raise RuntimeError(msg)
        if self._discarded:
            msg = (
                f"the vLLM engine discarded its weights (weight version {self._version}) when it slept at level "
                f"{SLEEP_LEVEL} beside the trainer, and no refit has loaded them since: call refit(version) before "
                "generate (runtime.generation does, since weight_version is None meanwhile)"
            )
            raise RuntimeError(msg)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        g, plan = self._cfg.generation, self._plan
        check_fits([len(p) for p in prompts], g.max_new_tokens, *self._context)  # vLLM would stop them at max_model_len
        eos = int(self._tokenizer.eos_token_id)
        stops = [[x for x in s or () if x] for s in stop_strings or [None] * len(prompts)]
        params = [
            SamplingParams(
                n=group_size,
                temperature=0.0 if greedy else g.temperature,
                top_p=1.0 if greedy else g.top_p,
                max_tokens=g.max_new_tokens,
                seed=request_seed(seed, b) if plan.seeded else None,
                logprobs=0,  # the sampled token's logprob only
                ignore_eos=True,  # end on the tokenizer's eos alone, as the transformers back-end does
                stop_token_ids=[eos],
                stop=stops[b] or None,
                include_stop_str_in_output=True,
                detokenize=bool(stops[b]),  # vLLM matches stop strings in the detokenized text
            )
            for b in range(len(prompts))
        ]
        batches = (
            waves(self.kv_tokens_needed(prompts, group_size), self.kv_cache_tokens())
            if plan.waves
            else [list(range(len(prompts)))]
        )
        self._wake()
        outputs: list[Any] = []
        with settings_kept(guard=model_construction):  # a load in another thread is never undone half-way
            for batch in batches:
                outputs += self._llm.generate(
                    [TokensPrompt(prompt_token_ids=prompts[b]) for b in batch],
                    [params[b] for b in batch],
                    use_tqdm=False,
                )
        rows_prompt, rows_response, rows_lp, rows_finished = [], [], [], []
        for prompt, out in zip(prompts, outputs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                rows_prompt.append(prompt)
                rows_response.append(ids)
                rows_lp.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)])
                rows_finished.append((bool(ids) and ids[-1] == eos) or isinstance(getattr(c, "stop_reason", None), str))
        return Generated.from_rows(rows_prompt, rows_response, rows_lp, rows_finished)

    def shutdown(self) -> bool:
        with self._lock:
            if self._plan is not None:
                set_engine_reserve(self._plan.device, self._owner, 0)
            if self._llm is not None:
                self._llm = None
                gc.collect()
                _destroy_parallel_state()
            self._version, self._plan, self._sleeping, self._derived_layers = None, None, set(), None
            self._discarded, self._reserve_bytes = False, 0
            return True


@contextlib.contextmanager
def _werkzeug_proxies_hidden() -> Iterator[None]:
    """Take modules that hold werkzeug ``LocalProxy`` objects out of ``sys.modules`` while an engine starts.

    vLLM's CPU platform rebinds kernels by scanning the globals of every module in ``sys.modules`` with
    ``hasattr``; an unbound proxy (``flask.current_app`` once Flask is imported, e.g. by moto's S3 server in the
    tests) raises ``RuntimeError`` there instead of ``AttributeError`` and kills the engine start. The modules stay
    alive and usable (their importers hold them); they are put back right after.
    """
    local = sys.modules.get("werkzeug.local")
    proxy = getattr(local, "LocalProxy", None)
    hidden = {}
    if proxy is not None:
        for name, module in list(sys.modules.items()):
            if any(type(v) is proxy for v in list(getattr(module, "__dict__", {}).values())):
                hidden[name] = sys.modules.pop(name)
    try:
        yield
    finally:
        sys.modules.update(hidden)


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Undo the reseeding of torch's, Python's and NumPy's global RNGs that starting an in-process engine does (the
    other process-wide settings it changes: :func:`rl.backends.vllm.process_state.settings_kept`)."""
    import numpy as np

    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


def _in_dtype(weights: Iterable[tuple[str, torch.Tensor]], dtype: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every floating-point tensor cast to ``dtype`` (``"bfloat16"``, ``"float32"``; None: as given),
    one tensor at a time as vLLM consumes them, on the tensor's own device.

    vLLM casts whatever it is given into its parameters (``copy_``, round to nearest even, as ``Tensor.to``), so the
    engine's weights are bit for bit the same either way; cast here, the tensors that vLLM's layer-by-layer reload
    buffers until a layer is complete, and any host-to-device copy, are half the bytes of a float32 master's.
    """
    target = getattr(torch, dtype) if dtype is not None else None
    for name, tensor in weights:
        if target is not None and tensor.is_floating_point() and tensor.dtype != target:
            tensor = tensor.detach().to(target)
        yield name, tensor


def _derived_only_layers(model: torch.nn.Module) -> list[str]:
    """Class names of ``model``'s modules whose own tensors are all non-persistent buffers, computed when the module is
    built (vLLM's rotary embeddings: the cos/sin cache of the config's RoPE settings). No checkpoint holds them, so
    vLLM's in-place reload never finds weights for them and keeps them as they are, which is right."""
    found = set()
    for module in model.modules():
        params = [p for p in module._parameters.values() if p is not None]
        buffers = {name for name, b in module._buffers.items() if b is not None}
        if not params and buffers and buffers <= set(module._non_persistent_buffers_set):
            found.add(type(module).__name__)
    return sorted(found)


@contextlib.contextmanager
def _layers_left_unloaded() -> Iterator[list[str]]:
    """Collect, instead of logging, the layer class names of vLLM's reload warning ``<Layer>: Failed to load weights``
    (``reload/layerwise.py``: a layer none of whose weights were given; vLLM puts its previous tensors back)."""
    found: list[str] = []

    def take(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.endswith(": Failed to load weights"):
            found.append(message.rsplit(":", 1)[0])
            return False
        return True

    logger = logging.getLogger(_LAYERWISE_LOGGER)
    logger.addFilter(take)
    try:
        yield found
    finally:
        logger.removeFilter(take)


def _folder_weights(folder: str, base_folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the checkpoint folder ``folder``: its own weights (:func:`_checkpoint_weights`), or, where it
    holds a LoRA adapter (`rl.lora`), the base model of ``base_folder`` with the adapter merged in."""
    from rl.lora import is_adapter_folder, merged_weights, saved_adapter

    if is_adapter_folder(folder):
        return merged_weights(saved_adapter(base_folder, folder, device="cpu"))
    return _checkpoint_weights(folder)


def _checkpoint_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of an HF folder's ``*.safetensors``, with ``lm_head.weight`` spelled out for a tied model.

    A folder of a tied model (SmolLM2) stores only the embedding, and after one in-place reload vLLM's LM head is a
    tensor of its own: reloading without it would leave the head at the previous weights.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        msg = f"no *.safetensors weights in {folder}: not a Hugging Face model folder"
        raise FileNotFoundError(msg)
    names: set[str] = set()
    embedding = None
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = f.get_tensor(name)
                names.add(name)
                if name.endswith("embed_tokens.weight"):
                    embedding = tensor
                yield name, tensor
    tied = json.loads((Path(folder) / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in names and embedding is not None:
        yield "lm_head.weight", embedding


def _destroy_parallel_state() -> None:
    """vLLM's process-global model-parallel and distributed state, torn down so a later engine can start."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
