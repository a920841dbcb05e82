"""The vLLM generation back-end: vLLM's offline engine in this process, ``n = G`` per prompt (the G completions
share their prompt's KV cache), one seed per request, the sampled tokens' logprobs of the temperature-scaled
distribution in float32, and weights refitted in place (no engine restart, no disk round trip when a trainer in
this process holds them).

Deviations from the transformers back-end: with ``top_p < 1`` vLLM reports the logprob renormalized over the
nucleus (ours: before truncation); completions of the two back-ends differ for the same seed (different RNGs).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rl.backends.interfaces import GenerationBackend, Generated, PolicyVersion
from rl.config import GRPOConfig

CPU_BATCH_SIZE = 64
"""``max_num_seqs`` of the CPU build when ``generation.batch_size`` is not set (the transformers loop's CPU default)."""


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
                "generation.vllm_cfg.cpu_kv_cache_gib (CPU) or gpu_memory_utilization (GPU), or lower "
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
        cfg: the run's config (``generation`` sampling and ``vllm_cfg`` engine settings, ``model.precision``).
        tokenizer: the model's tokenizer (its eos id ends completions, as in the transformers back-end).
        model_path: the base model folder: the engine a warm :meth:`refit` starts from.
    """

    name = "vllm"

    def __init__(self, cfg: GRPOConfig, *, tokenizer: Any, model_path: str) -> None:
        self._cfg = cfg
        self._tokenizer = tokenizer
        self._model_path = model_path
        self._llm: Any = None
        self._version: int | None = None

    @property
    def weight_version(self) -> int | None:
        return self._version

    # ------------------------------------------------------------------------------------------ engine
    def _start(self, folder: str) -> None:
        v = self._cfg.generation.vllm_cfg
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{v.cpu_kv_cache_gib:g}")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import LLM

        from rl.precision import resolve

        cuda = torch.cuda.is_available()
        dtype = resolve(self._cfg.model.precision, "cuda" if cuda else "cpu")
        kwargs: dict[str, Any] = {"gpu_memory_utilization": v.gpu_memory_utilization} if cuda else {}
        batch_size = self._cfg.generation.batch_size or (None if cuda else CPU_BATCH_SIZE)
        if batch_size is not None:  # None on a GPU: vLLM's own default
            kwargs["max_num_seqs"] = batch_size
        max_len = min(v.max_model_len, _model_max_len(folder))
        with _process_state_kept(), _werkzeug_proxies_hidden():
            self._llm = LLM(
                model=folder,
                dtype=dtype,
                seed=self._cfg.grpo.seed,
                enforce_eager=v.enforce_eager or not cuda,
                max_model_len=max_len,
                enable_prefix_caching=True,
                # a seeded request whose prefill is split across steps kills the CPU engine ("CPU Generator does
                # not use offset"): prefills are scheduled whole, as many as fit this many tokens per step
                enable_chunked_prefill=False,
                max_num_batched_tokens=max(max_len, 4096),
                logprobs_mode="processed_logprobs",  # log softmax(logits / temperature), as the training forward computes
                **kwargs,
            )

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

    def _reload(self, **source: Any) -> None:
        """vLLM's in-place reload (``Worker.reload_weights``: layer by layer, re-running each layer's post-load
        processing, so weights a CPU kernel repacked are repacked again), then drop the prefix cache, whose prompt
        KV was computed with the old weights."""
        self._llm.collective_rpc("reload_weights", kwargs={**source, "is_checkpoint_format": True})
        self._llm.reset_prefix_cache()

    # --------------------------------------------------------------------------------------- interface
    def refit(self, version: PolicyVersion, *, weights: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        from rl.checkpoint import local_copy, local_folder

        if weights is None:
            so = self._cfg.dataplane.storage_options
            if self._llm is None:  # the engine keeps reading its model folder: a copy of a remote one stays
                self._start(local_copy(version.path, so, require_complete=version.step > 0))
            else:
                with local_folder(version.path, so, require_complete=version.step > 0) as folder:
                    self._reload(weights_iterator=_checkpoint_weights(folder))
        else:
            if self._llm is None:
                self._start(self._model_path)
            self._reload(weights_iterator=iter(list(weights)))
        self._version = version.step

    def generate(self, prompts: list[list[int]], *, group_size: int, seed: int, greedy: bool = False) -> Generated:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            msg = "the vLLM generation back-end holds no weights yet: call refit(version) first"
            raise RuntimeError(msg)
        g = self._cfg.generation
        eos = int(self._tokenizer.eos_token_id)
        params = [
            SamplingParams(
                n=group_size,
                temperature=0.0 if greedy else g.temperature,
                top_p=1.0 if greedy else g.top_p,
                max_tokens=g.max_new_tokens,
                seed=request_seed(seed, b),
                logprobs=0,  # the sampled token's logprob only
                ignore_eos=True,  # end on the tokenizer's eos alone, as the transformers back-end does
                stop_token_ids=[eos],
                detokenize=False,
            )
            for b in range(len(prompts))
        ]
        outputs: list[Any] = []
        for wave in waves(self.kv_tokens_needed(prompts, group_size), self.kv_cache_tokens()):
            outputs += self._llm.generate(
                [TokensPrompt(prompt_token_ids=prompts[b]) for b in wave], [params[b] for b in wave], use_tqdm=False
            )
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
        self._version = None
        return True


def _model_max_len(folder: str) -> int:
    """The model's own context limit (``max_position_embeddings`` of its config.json)."""
    import json
    from pathlib import Path

    config = json.loads((Path(folder) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 1 << 30)


@contextlib.contextmanager
def _werkzeug_proxies_hidden() -> Iterator[None]:
    """Take modules that hold werkzeug ``LocalProxy`` objects out of ``sys.modules`` while an engine starts.

    vLLM's CPU platform rebinds kernels by scanning the globals of every module in ``sys.modules`` with
    ``hasattr``; an unbound proxy (``flask.current_app`` once Flask is imported, e.g. by moto's S3 server in the
    tests) raises ``RuntimeError`` there instead of ``AttributeError`` and kills the engine start. The modules stay
    alive and usable (their importers hold them); they are put back right after.
    """
    import sys

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
    import random

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


def _checkpoint_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of an HF folder's ``*.safetensors``, with ``lm_head.weight`` spelled out for a tied model.

    A folder of a tied model (SmolLM2) stores only the embedding, and after one in-place reload vLLM's LM head is a
    tensor of its own: reloading without it would leave the head at the previous weights.
    """
    import json
    from pathlib import Path

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
