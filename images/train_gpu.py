"""GPU train image: logprob and train tasks with transformers or Megatron-core on CUDA."""

from flytekit import ImageSpec

from images import REGISTRY, COMMON_PACKAGES, MEGATRON_CORE, MODEL_WHEEL_COMMANDS, PYTHON_VERSION, TORCH

train_gpu_image = ImageSpec(
    name="grpoflow-train-gpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    cuda="12.8",
    packages=[TORCH, MEGATRON_CORE, *COMMON_PACKAGES],
    commands=MODEL_WHEEL_COMMANDS,
    source_root=".",
)
