"""bench/decode_calls.py's even-handed protocol on fake decoders and a fake clock: every side warmed once at the timed
prompts, then ``calls`` timed rounds on them with the order rotated, then ``calls`` rounds each on prompts of its
own; a variant that fails is left out and named, while ``generate`` or ``ours`` failing stops the comparison."""

from __future__ import annotations

import pytest

from bench.decode_calls import compare

WARM = [[1, 2]]
COLD = [[[10 + i]] for i in range(9)]


class Clock:
    """One second between two reads."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t - 1.0


def test_sides_are_warmed_alike_then_timed_in_rotated_rounds_warm_then_cold():
    log = []

    def side(name, tokens):
        def call(prompts, seed):
            log.append((name, prompts, seed))
            return tokens + seed % 10  # a different count per call

        return call

    out = compare(
        {"generate": side("generate", 100), "ours": side("ours", 200), "ours[cudnn]": side("ours[cudnn]", 50)},
        warm_prompts=WARM,
        cold_prompts=COLD,
        calls=3,
        now=Clock(),
        progress=lambda _: None,
    )
    names = [n for n, _, _ in log]
    assert names[:3] == ["generate", "ours", "ours[cudnn]"] and all(p == WARM for _, p, _ in log[:3])  # warm-ups
    assert names[3:12] == [
        "generate", "ours", "ours[cudnn]", "ours", "ours[cudnn]", "generate", "ours[cudnn]", "generate", "ours"
    ]  # fmt: skip
    assert all(p == WARM for _, p, _ in log[3:12])
    cold = [p for _, p, _ in log[12:]]
    assert cold == COLD  # every cold call has prompts no side saw before
    assert out["ours"]["warm"]["calls"] == [200.0, 201.0, 202.0]  # tokens / 1 s, seeds 2000, 2001, 2002
    assert out["ours"]["warm"]["tok_per_s"] == 201.0 and out["ours"]["warm"]["min"] == 200.0
    assert out["generate"]["cold"]["tokens"] == [100, 101, 102]  # seeds 3000 ..


def test_a_failing_variant_is_left_out_but_generate_or_ours_failing_raises():
    def broken(prompts, seed):
        if seed >= 2001:
            raise RuntimeError("cuDNN graph capture is not supported")
        return 5

    sides = {"generate": lambda p, s: 10, "ours": lambda p, s: 20, "ours[cudnn]": broken}
    out = compare(sides, warm_prompts=WARM, cold_prompts=COLD, calls=3, now=Clock(), progress=lambda _: None)
    assert out["ours[cudnn]"] == {"error": "RuntimeError: cuDNN graph capture is not supported"}
    assert out["ours"]["cold"]["tok_per_s"] == 20.0
    sides["ours"] = broken
    with pytest.raises(RuntimeError, match="capture"):
        compare(sides, warm_prompts=WARM, cold_prompts=COLD, calls=3, now=Clock(), progress=lambda _: None)


def test_too_few_calls_or_cold_prompt_sets_are_refused():
    sides = {"generate": lambda p, s: 1, "ours": lambda p, s: 1}
    with pytest.raises(ValueError, match="time at least one call per side"):
        compare(sides, warm_prompts=WARM, cold_prompts=COLD, calls=0, now=Clock())
    with pytest.raises(ValueError, match="2 cold prompt sets for 3 calls of 2 sides: give 6"):
        compare(sides, warm_prompts=WARM, cold_prompts=COLD[:2], calls=3, now=Clock())
