"""Loading models from two threads at once (as an async run does after a resume) leaves no weight on the meta device.

transformers 5.19 builds a model inside process-wide swaps (``initialization.no_tie_weights()`` replaces the class
attribute ``PreTrainedModel.tie_weights`` with a no-op; ``local_torch_dtype()`` calls ``torch.set_default_dtype``).
An async local run loads beside itself: the trajectory collector's generation copy on its thread, the reference or
policy on the main thread. A load whose weights are tied while the other thread is inside those swaps ties nothing:
its ``lm_head.weight`` (tied to the embedding, so absent from the checkpoint) stays on the meta device. These tests
force that interleaving, and load many times from two threads, through :func:`rl.backends.hf.model.load_model`
(serialised by :func:`rl.model.model_construction`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from dataplane import fields as F
from rl.backends.hf.generation import HFGeneration
from rl.backends.hf.model import load_model
from rl.backends.hf.policy import HFPolicy
from rl.backends.interfaces import PolicyVersion
from rl.model import load_tokenizer
from tests.helpers import small_config

LOADS_PER_THREAD = 50
"""Two threads x 50 loads each = 100 concurrent loads per run of the stress test."""


@pytest.fixture
def tie_weights_guard() -> Iterator[None]:
    """Restore ``PreTrainedModel.tie_weights`` and the default dtype after the test: without the lock a racing load
    leaves the no-op patched in for the rest of the process, which would break every later test."""
    from transformers import PreTrainedModel

    original, dtype = PreTrainedModel.tie_weights, torch.get_default_dtype()
    yield
    leaked = PreTrainedModel.tie_weights is not original
    PreTrainedModel.tie_weights = original
    torch.set_default_dtype(dtype)
    assert not leaked, "a load left PreTrainedModel.tie_weights replaced by transformers' no-op"


def _problems(model: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """What is wrong with a loaded tiny model: a tensor on the meta device, an untied LM head, a wrong dtype."""
    out = [
        f"{n} on meta"
        for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        if t.is_meta
    ]
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        out.append("lm_head.weight is not tied to model.embed_tokens.weight")
    out += [f"{n} is {p.dtype}, not {dtype}" for n, p in model.named_parameters() if p.dtype != dtype]
    return out


def test_a_load_while_another_thread_builds_a_model_is_whole(tiny_model_dir, monkeypatch, tie_weights_guard):
    """Thread B stops inside transformers' model-init context (right after ``cls(config)``, where
    ``PreTrainedModel.tie_weights`` is the no-op) while thread A loads the same model. Without the lock A finishes in
    that window and its LM head stays on meta (``Module.to`` then fails: ``Cannot copy out of meta tensor``); with it,
    A waits for B. Both models must come out whole."""
    import transformers.modeling_utils as mu

    inside, release = threading.Event(), threading.Event()
    original = mu.patch_output_recorders

    def paused(model):  # called inside ``with ContextManagers(model_init_context)``
        if threading.current_thread().name == "B":
            inside.set()
            release.wait(30)
        return original(model)

    monkeypatch.setattr(mu, "patch_output_recorders", paused)
    results: dict[str, object] = {}

    def load(name: str) -> None:
        try:
            results[name] = load_model(tiny_model_dir)
        except Exception as err:  # noqa: BLE001 - reported by the assertions below
            results[name] = err

    b = threading.Thread(target=load, args=("B",), name="B")
    a = threading.Thread(target=load, args=("A",), name="A")
    b.start()
    assert inside.wait(30), "thread B never reached the model-init context"
    a.start()
    a.join(2.0)  # unlocked, A's whole load (~50 ms) happens inside B's context; locked, it waits for B
    release.set()
    a.join(60)
    b.join(60)
    for name in ("A", "B"):
        got = results[name]
        assert isinstance(got, torch.nn.Module), f"thread {name}: {type(got).__name__}: {got}"
        assert _problems(got, torch.float32) == [], name


def test_many_concurrent_loads_in_two_dtypes_are_all_whole(tiny_model_dir, tie_weights_guard):
    """100 loads, two threads at once (one float32 as the trainer and reference load, one bfloat16 as a GPU generation
    copy): every model has its weights tied, nothing on meta, its own dtype; torch's default dtype is float32 after."""

    bad: list[str] = []
    start = threading.Barrier(2)

    def loads(dtype: torch.dtype) -> None:
        start.wait()
        for i in range(LOADS_PER_THREAD):
            try:
                model = load_model(tiny_model_dir, dtype=dtype)
            except Exception as err:  # noqa: BLE001 - collected
                bad.append(f"{dtype} load {i}: {type(err).__name__}: {str(err)[:80]}")
                continue
            bad.extend(f"{dtype} load {i}: {p}" for p in _problems(model, dtype))

    threads = [threading.Thread(target=loads, args=(d,)) for d in (torch.float32, torch.bfloat16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert bad == [], f"{len(bad)} problems in {2 * LOADS_PER_THREAD} loads, e.g. {bad[:3]}"
    assert torch.get_default_dtype() == torch.float32


def test_reference_logprobs_beside_a_generation_refit_from_disk(tiny_model_dir, tmp_path, tie_weights_guard):
    """The resume path, 20 times: the main thread loads the reference policy and computes its logprobs while the
    collector's thread refits a generation back-end from a folder (as after a resume); both must succeed, with the
    reference logprobs equal every time."""

    cfg = small_config(tmp_path, tiny_model_dir)
    tok = load_tokenizer(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    batch = {
        F.INPUT_IDS: torch.randint(3, 1000, (4, 12), generator=g),
        F.INPUT_LENGTHS: torch.full((4,), 12),
        F.TOKEN_MASK: torch.ones(4, 12),
    }
    first = None
    for trial in range(20):
        policy = HFPolicy(cfg, tokenizer=tok, reference_path=tiny_model_dir)
        generation = HFGeneration(cfg, tokenizer=tok, model_path=tiny_model_dir)
        errors: list[BaseException] = []

        def refit(gen=generation, errs=errors) -> None:
            try:
                gen.refit(PolicyVersion(step=0, path=tiny_model_dir))
            except Exception as err:  # noqa: BLE001 - asserted below
                errs.append(err)

        t = threading.Thread(target=refit)
        t.start()
        logprobs = policy.get_reference_policy_logprobs(batch)
        t.join(60)
        assert errors == [], f"trial {trial}: the generation refit failed: {errors[0]!r}"
        assert generation.weight_version == 0
        first = logprobs if first is None else first
        assert torch.equal(logprobs, first), trial
