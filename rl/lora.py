"""LoRA adapters through peft (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): a frozen base weight W plus a trained low-rank update, ``W' = W + (alpha / r) B A`` with
``A: [r, in]`` (Kaiming-uniform at start) and ``B: [out, r]`` (zeros at start, so step 0 is the base model exactly).

The transformers policy back-end computes on the base model with peft's LoRA layers injected in place
(``PeftModel.get_base_model()``): every forward it runs on a plain Hugging Face model runs unchanged, the reference
policy is the same weights with the adapter disabled (:func:`adapter_disabled`), and a checkpoint holds the adapter
only (peft's ``save_pretrained``: ``adapter_config.json`` and ``adapter_model.safetensors``), loaded on top of the
base model (:func:`load_policy`). Generation engines take the merged weights W' under the base model's names
(:func:`merged_weights`, :func:`merged_model`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config file: a checkpoint folder with it holds an adapter, not a whole model."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter weights file."""
ADAPTER_NAME = "default"
"""peft's name of the one adapter a policy trains."""


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether the local folder ``folder`` holds a peft adapter (an ``adapter_config.json``) rather than a model."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def peft_config(settings: Any) -> Any:
    """peft's ``LoraConfig`` of the run's ``policy.lora`` (`rl.config.sections.LoRASettings`): ``r`` = rank,
    ``lora_alpha`` = alpha, ``lora_dropout`` = dropout, ``target_modules``; bias untouched."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.peft_target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, settings: Any, *, seed: int) -> Any:
    """``model`` with a new LoRA adapter injected (peft's ``get_peft_model``; ``model`` itself is changed in place and
    frozen), its A matrices drawn from a generator seeded with ``seed`` without touching the global RNG's state, so
    that every process that starts the same run builds the same adapter.

    Returns:
        peft.PeftModel: the wrapper (``get_base_model()`` is ``model``); only the adapter requires grad.

    Raises:
        ValueError: the model has none of the target modules, or peft cannot wrap its layers; the message names the
            model's linear layers and ``policy.lora.target_modules``.
    """
    import torch
    from peft import get_peft_model

    devices = [model.device] if model.device.type == "cuda" else []  # fork_rng forks the CPU generator always
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, peft_config(settings), autocast_adapter_dtype=True)
        except ValueError as err:
            names = sorted(linear_module_names(model))
            msg = (
                f"policy.lora: peft cannot put a LoRA adapter on {type(model).__name__} with target_modules "
                f"{settings.peft_target_modules!r} ({err}); its linear layers are named {names}: list some of them "
                "in policy.lora.target_modules, or use 'all-linear'"
            )
            raise ValueError(msg) from None


def check_targets(model_folder: str | Path, settings: Any) -> None:
    """Fail early (a run's start, before any task loads weights) where ``policy.lora`` cannot wrap the model of
    ``model_folder``: the adapter is injected into the model's skeleton on the meta device (no weights read, no
    memory), exactly as :func:`wrap` injects it later.

    Raises:
        ValueError: :func:`wrap`'s message (the target modules the model lacks, with its linear layers' names).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_folder))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    wrap(skeleton, settings, seed=0)


def linear_module_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every ``torch.nn.Linear`` of ``model`` (``q_proj``, ``down_proj``, ...): what
    ``target_modules`` may list."""
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def load_policy(base: torch.nn.Module, folder: str | Path | None, settings: Any, *, seed: int) -> Any:
    """The trainable LoRA policy on ``base``: a new adapter (:func:`wrap`) when ``folder`` is None or holds no
    adapter (step 0: the base model's folder), else the adapter saved in ``folder``, its weights copied exactly.

    Raises:
        ValueError: the saved adapter's rank, alpha or target modules differ from ``settings`` (a checkpoint of
            another config), or :func:`wrap`'s errors.
        KeyError: the saved adapter lacks a tensor of the new one, or has one it lacks.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    model = wrap(base, settings, seed=seed)
    if folder is None or not is_adapter_folder(folder):
        return model
    saved = json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    want = model.peft_config[ADAPTER_NAME]
    for key, ours in (("r", want.r), ("lora_alpha", want.lora_alpha), ("target_modules", want.target_modules)):
        theirs = saved.get(key)
        if key == "target_modules" and isinstance(theirs, list):
            theirs = set(theirs)
        if theirs != ours:
            msg = (
                f"the adapter in {folder} has {key}={saved.get(key)!r} but policy.lora asks for {ours!r}: resume with "
                "the config the run started with"
            )
            raise ValueError(msg)
    weights = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    result = set_peft_model_state_dict(model, weights, adapter_name=ADAPTER_NAME)
    unexpected = [k for k in result.unexpected_keys if "lora_" in k]
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or unexpected:
        msg = f"the adapter in {folder} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        raise KeyError(msg)
    return model


@contextlib.contextmanager
def adapter_disabled(peft_model: Any) -> Iterator[None]:
    """Inside this block ``peft_model`` (and its base model, which shares the layers) computes as the base model:
    peft's ``disable_adapter``. The reference policy of a LoRA run."""
    with peft_model.disable_adapter():
        yield


def merged_weights(peft_model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of the base model under its own Hugging Face name, with each adapted weight
    merged: ``W + (alpha / r) B A`` (peft's ``get_delta_weight``, in float32, then the base's dtype). Nothing is
    changed in place (peft's ``merge_adapter`` would add and later subtract the update, which drifts the base weight
    by rounding). What ``GenerationBackend.refit(weights=)`` takes.

    Tensors are yielded one at a time, detached; a merged one is a new tensor, the others are the model's own.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for name, value in base.state_dict().items():  # no grad mode is held across a yield: the caller's stays its own
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, value
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        if leaf == "weight" and owner in layers:
            with torch.no_grad():
                merged = (value.float() + layers[owner].get_delta_weight(ADAPTER_NAME).float()).to(value.dtype)
            yield f"{owner}.{leaf}", merged
        else:
            yield f"{owner}.{leaf}", value


def saved_adapter(base_folder: str | Path, adapter_folder: str | Path, *, device: Any = None) -> Any:
    """The float32 base model of ``base_folder`` on the CPU with the saved adapter of ``adapter_folder`` (peft's
    ``PeftModel.from_pretrained``) on ``device`` (None: the GPU when CUDA is present, else the CPU), for merging:
    :func:`merged_weights` of it, or :func:`merged_model`.

    Raises:
        FileNotFoundError, ValueError: either folder is missing its files (transformers', peft's errors).
    """
    import torch
    from peft import PeftModel

    from rl.backends.hf.model import load_model

    base = load_model(str(base_folder), dtype=torch.float32, device=device)
    return PeftModel.from_pretrained(base, str(adapter_folder))


def merged_model(base_folder: str | Path, adapter_folder: str | Path, *, dtype: Any = None, device: Any = None) -> Any:
    """The Hugging Face model of ``base_folder`` with the adapter of ``adapter_folder`` merged into its weights in
    float32 (peft's ``merge_and_unload``: the same sums as :func:`merged_weights`), then cast to ``dtype`` (None:
    float32) and moved to ``device`` (None: the GPU when CUDA is present, else the CPU): a plain model, no peft
    layers, in eval mode.

    Raises:
        what :func:`saved_adapter` raises.
    """
    import torch

    model = saved_adapter(base_folder, adapter_folder, device=device).merge_and_unload()
    return model.to(dtype=dtype or torch.float32).eval()
