"""The process-wide settings an in-process vLLM engine may change for the trainer beside it, snapshotted and put
back: torch's math flags (TF32 for matmuls and cuDNN, reduced-precision reductions, ``float32_matmul_precision``,
which vLLM's GPU worker sets from ``VLLM_FLOAT32_MATMUL_PRECISION``; cuDNN's ``enabled``/``benchmark``/
``deterministic``; deterministic algorithms), the default dtype, the scaled-dot-product-attention back-end switches,
torch's intra-op thread count, and the environment (vLLM's CPU build points ``LD_PRELOAD`` at torch's libgomp and
sets OpenMP variables, for every subprocess started later).

Pure torch and ``os``: no vLLM import. ``tests/unit/rl/backends/test_vllm_gpu_sharing.py`` checks that starting the
real CPU build leaves every one of them as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

_matmul = torch.backends.cuda.matmul
_cudnn = torch.backends.cudnn
_cuda = torch.backends.cuda


def _set_attr(obj: Any, name: str) -> Callable[[Any], None]:
    return lambda value: setattr(obj, name, value)


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


FLAGS: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    # float32_matmul_precision first: it sets the matmul TF32 flag too, which is then put back on its own
    "float32_matmul_precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "cuda.matmul.allow_tf32": (lambda: _matmul.allow_tf32, _set_attr(_matmul, "allow_tf32")),
    "cuda.matmul.allow_fp16_reduced_precision_reduction": (
        lambda: _matmul.allow_fp16_reduced_precision_reduction,
        _set_attr(_matmul, "allow_fp16_reduced_precision_reduction"),
    ),
    "cuda.matmul.allow_bf16_reduced_precision_reduction": (
        lambda: _matmul.allow_bf16_reduced_precision_reduction,
        _set_attr(_matmul, "allow_bf16_reduced_precision_reduction"),
    ),
    "cudnn.allow_tf32": (lambda: _cudnn.allow_tf32, _set_attr(_cudnn, "allow_tf32")),
    "cudnn.enabled": (lambda: _cudnn.enabled, _set_attr(_cudnn, "enabled")),
    "cudnn.benchmark": (lambda: _cudnn.benchmark, _set_attr(_cudnn, "benchmark")),
    "cudnn.deterministic": (lambda: _cudnn.deterministic, _set_attr(_cudnn, "deterministic")),
    "deterministic_algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _set_deterministic,
    ),
    "default_dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "sdp.flash": (_cuda.flash_sdp_enabled, _cuda.enable_flash_sdp),
    "sdp.mem_efficient": (_cuda.mem_efficient_sdp_enabled, _cuda.enable_mem_efficient_sdp),
    "sdp.math": (_cuda.math_sdp_enabled, _cuda.enable_math_sdp),
    "sdp.cudnn": (_cuda.cudnn_sdp_enabled, _cuda.enable_cudnn_sdp),
    "num_threads": (torch.get_num_threads, torch.set_num_threads),
}
"""name -> (getter, setter) of every process-wide torch setting kept. The TF32 flags are read and put back through
torch's legacy API (``allow_tf32``), which the trainer reads (``rl.backends.engine``): putting them back that way
also undoes a change vLLM made through the newer ``fp32_precision`` API, which would otherwise make every later read
of ``allow_tf32`` raise (torch refuses a mix of the two)."""


UNREADABLE = object()
"""What :meth:`ProcessSettings.take` records for a legacy TF32 flag that torch refuses to read (the newer
``fp32_precision`` API set it): it always counts as changed."""


def _read(get: Callable[[], Any]) -> Any:
    try:
        return get()
    except RuntimeError as err:  # torch: "... you have used mix of the legacy and new APIs to set the TF32 ..."
        if "TF32" not in str(err):
            raise
        return UNREADABLE


@dataclass(frozen=True)
class ProcessSettings:
    """A snapshot of the process-wide settings (:data:`FLAGS` values and ``os.environ``)."""

    flags: dict[str, Any]
    environ: dict[str, str]

    @classmethod
    def take(cls) -> ProcessSettings:
        """The settings now."""
        return cls({name: _read(get) for name, (get, _) in FLAGS.items()}, dict(os.environ))

    def differences(self, other: ProcessSettings) -> dict[str, tuple[Any, Any]]:
        """name -> (this value, ``other``'s value) of every flag and environment variable (``env:NAME``; None where
        unset) that differs."""
        out = {
            k: (v, other.flags.get(k))
            for k, v in self.flags.items()
            if v is UNREADABLE or other.flags.get(k) is UNREADABLE or other.flags.get(k) != v
        }
        for key in sorted(set(self.environ) | set(other.environ)):
            if self.environ.get(key) != other.environ.get(key):
                out[f"env:{key}"] = (self.environ.get(key), other.environ.get(key))
        return out

    def restore(self, *, keep_env: Iterable[str] = ()) -> list[str]:
        """Put back every setting that differs now (a flag torch refuses to read counts as differing: it is set
        again through the legacy API, which makes it readable); ``keep_env``: environment variables left as they are
        now. Settings that are as in the snapshot are not touched, so a change another thread makes meanwhile and
        undoes itself (a model load's default dtype) is not interfered with.

        Returns:
            the names put back (:meth:`differences` keys), sorted.
        """
        changed = self.differences(ProcessSettings.take())
        for name, (_, setter) in FLAGS.items():
            if name in changed and self.flags[name] is not UNREADABLE:
                setter(self.flags[name])
        kept = {f"env:{k}" for k in keep_env}
        for key in [k for k in changed if k.startswith("env:")]:
            name = key[4:]
            if key in kept:
                del changed[key]
            elif name in self.environ:
                os.environ[name] = self.environ[name]
            else:
                os.environ.pop(name, None)
        return sorted(changed)


@contextlib.contextmanager
def settings_kept(
    *, keep_env: Iterable[str] = (), guard: Callable[[], AbstractContextManager] = nullcontext
) -> Iterator[ProcessSettings]:
    """Run a block (an engine start, a reload, a generate) and put back every process-wide setting it changed,
    ``keep_env`` excepted (variables the caller set for the engine on purpose). Also put back: ``torch.set_num_threads``
    itself, which vLLM's CPU worker replaces with a no-op while it runs (so the thread count can be restored).

    ``guard`` is held while the snapshot is taken and while it is put back, not during the block: with
    :func:`rl.model.model_construction`, a model load in another thread (which switches the default dtype for its
    duration) is never snapshotted half-way nor has its switch undone.
    """
    set_threads = torch.set_num_threads
    with guard():
        before = ProcessSettings.take()
    try:
        yield before
    finally:
        torch.set_num_threads = set_threads
        with guard():
            before.restore(keep_env=keep_env)
