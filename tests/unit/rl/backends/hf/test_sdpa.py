"""The SDPA pin around the decode loops (`rl.backends.hf.sdpa`): what it enables, that torch's flags come back, and
that it does nothing off CUDA. (Which kernel torch then picks, and how fast, needs a GPU: ``tests/gpu`` and
``bench/step.py``.)"""

from __future__ import annotations

import pytest
import torch

from rl.backends.hf.sdpa import DECODE_PIN, PINS, check_pin, cudnn_version, decode_choice, pinned

CUDA = torch.device("cuda")


def flags() -> dict[str, bool]:
    b = torch.backends.cuda
    return {
        "cudnn": b.cudnn_sdp_enabled(),
        "efficient": b.mem_efficient_sdp_enabled(),
        "flash": b.flash_sdp_enabled(),
        "math": b.math_sdp_enabled(),
    }


def test_the_no_cudnn_pin_turns_cudnn_off_inside_and_restores_every_flag_after():
    """Torch's flags are process-wide, so they are set on a CPU build too: the pin is checked on the flags alone."""
    before = flags()
    assert before["cudnn"]  # torch's default
    with pinned(CUDA, "no_cudnn"):
        assert flags() == {"cudnn": False, "efficient": True, "flash": True, "math": True}
    assert flags() == before
    with pytest.raises(RuntimeError, match="boom"), pinned(CUDA, "cudnn"):
        assert flags() == {"cudnn": True, "efficient": True, "flash": True, "math": True}
        raise RuntimeError("boom")
    assert flags() == before


def test_off_cuda_and_under_torchs_own_choice_nothing_changes():
    torch.backends.cuda.enable_cudnn_sdp(True)
    for device, name in ((torch.device("cpu"), "no_cudnn"), (torch.device("meta"), "no_cudnn"), (CUDA, "torch")):
        with pinned(device, name):
            assert flags()["cudnn"]
    assert decode_choice(torch.device("cpu"), rows=4, heads=2, head_dim=8, keys=16, dtype=torch.float32) == "n/a"


def test_an_unknown_pin_is_refused_naming_the_choices():
    assert DECODE_PIN in PINS and PINS["torch"] is None
    with pytest.raises(ValueError, match=r"unknown SDPA pin 'cudnn_off': use one of \['cudnn', 'no_cudnn', 'torch'\]"):
        check_pin("cudnn_off")
    with pytest.raises(ValueError, match="unknown SDPA pin"), pinned(CUDA, "fast"):
        pass


def test_the_cudnn_version_is_an_int_or_none():
    v = cudnn_version()
    assert v is None or (isinstance(v, int) and v > 0)
