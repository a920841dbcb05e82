"""The vLLM generation back-end: vLLM's offline engine in this process, ``n = G`` per prompt (the G completions
share their prompt's KV cache), the sampled tokens' logprobs in float32, and weights refitted in place (no engine
restart, no disk round trip when a trainer in this process holds them), handed to vLLM in the engine's dtype.

What the engine gets on each device (chunked prefill, KV-cache waves, ``max_num_seqs``, ``gpu_memory_utilization``,
dtype, CUDA graphs, sleep mode, seeds per request, logprobs mode) is decided in :mod:`rl.backends.vllm.settings`.

``generation_logprobs`` mean what the transformers back-end's and the training forward's do: log softmax(logits /
temperature) of the sampled token over the whole vocabulary, before top-p truncation
(:func:`rl.backends.vllm.settings.logprobs_mode`); the config refuses ``top_p < 1`` with a temperature other than 1,
where vLLM cannot report that. Completions of the two back-ends differ for the same seed (different RNGs).

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
import os
import random
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rl.backends.interfaces import Generated, GenerationBackend, PolicyVersion
from rl.backends.vllm.settings import EnginePlan, engine_plan
from rl.config import GRPOConfig
from rl.lengths import check_fits, context_limit, model_max_len
from rl.model import model_construction
from rl.precision import resolve

SLEEP_TAGS = ("weights", "kv_cache")
"""What a level-1 sleep releases (weights to host memory, KV cache dropped): the tags ``LLM.wake_up`` takes back."""

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM's in-place reload (``reload/layerwise.py``), which reports layers it was given no weights for."""


def request_seed(seed: int, index: int) -> int:
    """Seed of request ``index`` of a call seeded ``seed``: a 62-bit hash, so the per-completion seeds vLLM derives
    from it (seed + completion index) never collide across requests or calls."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{index}".encode()).digest()[:8], "big") >> 2


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
            task; not a cluster's rollout pod): on CUDA the engine then sleeps after every :meth:`generate` (weights
            to host memory, KV cache freed) and wakes for the next refit or call, so that the trainer has the GPU's
            memory meanwhile. Ignored on the CPU.
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
        self._derived_layers: frozenset[str] | None = None
        self._context: tuple[int, str] = (1 << 30, "")  # (tokens, what sets them) once the engine has started

    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def plan(self) -> EnginePlan | None:
        """The settings the running engine was started with (None before the first load)."""
        return self._plan

    @property
    def asleep(self) -> bool:
        """Whether the engine sleeps (between calls, when it shares its GPU with a trainer)."""
        return bool(self._sleeping)

    # ------------------------------------------------------------------------------------------ engine
    @staticmethod
    def _device() -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _serving_dtype(self) -> str | None:
        """``"bfloat16"`` where the engine computes in it: a checkpoint's bf16 copy is then what a cold load reads."""
        return "bfloat16" if resolve(self._cfg.model.precision, self._device()) == "bfloat16" else None

    def _start(self, folder: str) -> None:
        self._context = context_limit(self._cfg, model_max_len(folder))
        plan = engine_plan(self._cfg, self._device(), model_max_len=self._context[0], shares_gpu=self._shares_gpu)
        os.environ.update(plan.env)
        for key, value in plan.env_defaults.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        # the engine builds its model with the process's default dtype switched: no other load beside it
        with model_construction(), _process_state_kept(), _werkzeug_proxies_hidden():
            self._llm = LLM(model=folder, **plan.engine)
        self._plan, self._sleeping, self._derived_layers = plan, set(), None

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
        """Take back what a sleep released: ``tags`` of :data:`SLEEP_TAGS` (all when none are named)."""
        wanted = [t for t in (tags or SLEEP_TAGS) if t in self._sleeping]
        if wanted:
            self._llm.wake_up(tags=wanted)
            self._sleeping.difference_update(wanted)

    def _sleep(self) -> None:
        """Level-1 sleep (weights to host memory, KV cache and prefix cache dropped) where the plan asks for it."""
        if self._plan is not None and self._plan.sleeps and not self._sleeping:
            self._llm.sleep(level=1)
            self._sleeping = set(SLEEP_TAGS)

    def _reload(self, weights: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """vLLM's in-place reload (``Worker.reload_weights``: layer by layer, re-running each layer's post-load
        processing, so weights a CPU kernel repacked are repacked again) of ``weights`` cast to the engine's dtype,
        then drop the prefix cache, whose prompt KV was computed with the old weights. A sleeping engine wakes its
        weights first and its KV cache after, so the refit's buffers and the KV cache are never resident together.

        Raises:
            RuntimeError: ``weights`` left out every tensor of a layer that holds trained weights (vLLM would keep
                its old ones).
        """
        if self._derived_layers is None:  # before any reload: afterwards vLLM has re-registered the buffers
            self._derived_layers = frozenset(self._llm.apply_model(_derived_only_layers)[0])
        self._wake("weights")
        dtype = self._plan.dtype if self._plan is not None else None
        with _layers_left_unloaded() as unloaded:
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

    # --------------------------------------------------------------------------------------- interface
    def refit(self, version: PolicyVersion, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        from rl.checkpoint import local_copy, local_folder

        if weights is None:
            so = self._cfg.dataplane.storage_options
            # the checkpoint's copy in the engine's dtype where it has one; never the trainer state
            part = {"require_complete": version.step > 0, "weights_only": True, "dtype": self._serving_dtype()}
            if self._llm is None:  # the engine keeps reading its model folder: a copy of a remote one stays
                self._start(local_copy(version.path, so, **part))
            else:
                with local_folder(version.path, so, **part) as folder:
                    self._reload(_checkpoint_weights(folder), version.step)
        else:
            if self._llm is None:
                self._start(self._model_path)
            self._reload(list(weights), version.step)  # the (name, tensor) pairs now; each cast as vLLM loads it
        self._version = version.step

    def generate(self, prompts: list[list[int]], *, group_size: int, seed: int, greedy: bool = False) -> Generated:
        if self._llm is None or self._plan is None:
            msg = "the vLLM generation back-end holds no weights yet: call refit(version) first"
            raise RuntimeError(msg)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        g, plan = self._cfg.generation, self._plan
        check_fits([len(p) for p in prompts], g.max_new_tokens, *self._context)  # vLLM would stop them at max_model_len
        eos = int(self._tokenizer.eos_token_id)
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
                detokenize=False,
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
        try:
            for batch in batches:
                outputs += self._llm.generate(
                    [TokensPrompt(prompt_token_ids=prompts[b]) for b in batch],
                    [params[b] for b in batch],
                    use_tqdm=False,
                )
        finally:
            self._sleep()
        rows_prompt, rows_response, rows_lp, rows_finished = [], [], [], []
        for prompt, out in zip(prompts, outputs, strict=True):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                rows_prompt.append(prompt)
                rows_response.append(ids)
                rows_lp.append([float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)])
                rows_finished.append(bool(ids) and ids[-1] == eos)
        return Generated.from_rows(rows_prompt, rows_response, rows_lp, rows_finished)

    def shutdown(self) -> bool:
        if self._llm is not None:
            self._llm = None
            gc.collect()
            _destroy_parallel_state()
        self._version, self._plan, self._sleeping, self._derived_layers = None, None, set(), None
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
def _process_state_kept() -> Iterator[None]:
    """Undo what starting an in-process engine does to the rest of the process: it reseeds torch's, Python's and
    NumPy's global RNGs, turns ``torch.set_num_threads`` into a no-op (its CPU worker's guard), and points
    ``LD_PRELOAD`` at torch's libgomp for every subprocess started later."""
    import numpy as np

    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    set_threads, preload = torch.set_num_threads, os.environ.get("LD_PRELOAD")
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])
        torch.set_num_threads = set_threads
        if preload is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = preload


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
