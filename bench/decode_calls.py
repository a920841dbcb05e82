"""Decode throughput of several generators side by side in one process, warmed alike: ``bench/step.py``'s comparison
of our decode loop (under each SDPA pin) with plain transformers ``model.generate``.

Protocol (:func:`compare`), for sides S_1 .. S_k, each a function ``(prompts, seed) -> generated tokens``:

1. warm: every side decodes the timed prompts once, untimed (the warm-up at the timed shape: cuDNN plans, CUDA
   graphs, allocator growth), then ``calls`` rounds in which every side decodes the same prompts again, timed, the
   order of the sides rotated each round;
2. cold: ``calls`` further rounds in which every side decodes prompts no side has decoded before (a prompt set of
   its own per side and round), as each step of a real run brings new prompts and so new shapes.

tok/s = generated tokens (eos included) / seconds of the call, the clock read after ``torch.cuda.synchronize()`` on
CUDA. Reported per side and phase: every call's tok/s, their median, min and max.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Side = Callable[[list[list[int]], int], int]
"""``(prompts, seed) -> generated tokens``: one decode of every prompt ``group`` times (the side knows G)."""


def compare(
    sides: dict[str, Side],
    *,
    warm_prompts: list[list[int]],
    cold_prompts: list[list[list[int]]],
    calls: int,
    now: Callable[[], float],
    progress: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Run the module's protocol.

    Args:
        sides: name -> :data:`Side`, in the order of the first round.
        warm_prompts: the timed prompts (token ids, each once: a side repeats them G times).
        cold_prompts: at least ``calls * len(sides)`` prompt sets that no side decoded before.
        calls: timed calls per side and phase (>= 1).
        now: a clock that waits for the device.
        progress: where a line per call goes.

    Returns:
        ``{side: {"warm": stats, "cold": stats}}``, stats = ``{"tok_per_s": median, "min", "max", "calls": [..],
        "tokens": [..]}``; ``{side: {"error": text}}`` for a side other than ``generate`` and ``ours`` that raised a
        ``RuntimeError`` (it is left out of the later calls).

    Raises:
        ValueError: ``calls`` < 1, or fewer cold prompt sets than ``calls * len(sides)``.
        RuntimeError: ``generate`` or ``ours`` failed.
    """
    names = list(sides)
    if calls < 1:
        msg = f"calls is {calls}: time at least one call per side"
        raise ValueError(msg)
    if len(cold_prompts) < calls * len(names):
        msg = f"{len(cold_prompts)} cold prompt sets for {calls} calls of {len(names)} sides: give {calls * len(names)}"
        raise ValueError(msg)
    rates: dict[str, dict[str, list[float]]] = {n: {"warm": [], "cold": []} for n in names}
    tokens: dict[str, dict[str, list[int]]] = {n: {"warm": [], "cold": []} for n in names}

    failed: dict[str, str] = {}

    def timed(name: str, phase: str, prompts: list[list[int]], seed: int) -> None:
        if name in failed:
            return
        t0 = now()
        try:
            n = sides[name](prompts, seed)
        except RuntimeError as err:  # a variant a GPU cannot run (a kernel, a capture): the others go on
            if name in ("generate", "ours"):
                raise
            failed[name] = f"{type(err).__name__}: {err}"[:300]
            progress(f"[bench.step] {name} failed, left out: {failed[name]}")
            return
        seconds = now() - t0
        rates[name][phase].append(n / seconds)
        tokens[name][phase].append(n)
        progress(f"[bench.step] {phase} {name}: {n:,} tokens in {seconds:.3f} s = {n / seconds:,.0f} tok/s")

    for name in names:  # the warm-up at the timed shape, untimed
        try:
            sides[name](warm_prompts, 1000)
        except RuntimeError as err:
            if name in ("generate", "ours"):
                raise
            failed[name] = f"{type(err).__name__}: {err}"[:300]
            progress(f"[bench.step] {name} failed, left out: {failed[name]}")
    for r in range(calls):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            timed(name, "warm", warm_prompts, 2000 + r)
    sets = iter(cold_prompts)
    for r in range(calls):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            timed(name, "cold", next(sets), 3000 + r)
    return {
        n: {"error": failed[n]} if n in failed else {p: stats(rates[n][p], tokens[n][p]) for p in ("warm", "cold")}
        for n in names
    }


def stats(rates: list[float], tokens: list[int]) -> dict[str, Any]:
    """Median, min and max of ``rates`` (tok/s), with every call's rate and token count."""
    return {
        "tok_per_s": statistics.median(rates),
        "min": min(rates),
        "max": max(rates),
        "calls": rates,
        "tokens": tokens,
    }


def generate_side(
    path: str, *, group: int, max_new_tokens: int, cuda: bool, bf16: bool
) -> tuple[Side, Callable[[], None]]:
    """Plain transformers ``model.generate`` on the model at ``path``: loaded with bf16 weights where ``bf16`` (else
    float32) and ``attn_implementation="sdpa"``, torch's SDPA kernels as torch picks them; the prompts repeated
    ``group`` times and left-padded, ``do_sample=True, top_k=0, top_p=1.0``, temperature 1; its tokens are those after
    the prompt up to and including the first eos.

    Returns:
        ``(side, close)``: the :data:`Side`, and a function that frees the model.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from rl.model import load_tokenizer

    tok = load_tokenizer(path)  # left padding
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16 if bf16 else torch.float32, attn_implementation="sdpa"
    )
    held = {"model": model.to("cuda" if cuda else "cpu").eval()}
    sampling = {"do_sample": True, "top_k": 0, "top_p": 1.0, "temperature": 1.0, "max_new_tokens": max_new_tokens}

    def side(prompts: list[list[int]], seed: int) -> int:
        m = held["model"]
        batch = tok.pad({"input_ids": [p for p in prompts for _ in range(group)]}, padding=True, return_tensors="pt")
        batch = batch.to(m.device)
        width = batch["input_ids"].shape[1]  # P, the padded prompt width
        torch.manual_seed(seed)
        with torch.no_grad():
            out = m.generate(**batch, **sampling, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        is_eos = out[:, width:].cpu() == tok.eos_token_id  # [N, T']
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, is_eos.shape[1])  # [N], eos included
        return int(lengths.sum())

    def close() -> None:
        held.clear()
        if cuda:
            torch.cuda.empty_cache()

    return side, close


def ours_side(gen: Any, cfg: Any, *, group: int, pin: str | None = None) -> Side:
    """Our decode through the generation back-end ``gen`` (``GenerationBackend.generate``, each call seeded). With
    ``pin`` (the transformers back-end only) our loop runs directly (`rl.backends.hf.decode.generate`, with the
    back-end's model, loop and settings) under that SDPA pin (`rl.backends.hf.sdpa.PINS`) instead of the back-end's."""
    if pin is None:
        return lambda prompts, seed: int(gen.generate(prompts, group_size=group, seed=seed).response_lengths.sum())

    from rl.backends.hf.decode import generate
    from rl.precision import device_generator, device_of

    g = cfg.generation

    def side(prompts: list[list[int]], seed: int) -> int:
        model = gen._model
        out = generate(
            model,
            gen._tokenizer,
            [p for p in prompts for _ in range(group)],
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            batch_size=g.batch_size,
            precision=cfg.model.precision,
            generator=device_generator(device_of(model), seed),
            loop=gen._loop(),
            sdpa_pin=pin,
        )
        return int(out.response_lengths.sum())

    return side
