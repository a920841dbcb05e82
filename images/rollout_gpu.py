"""GPU rollout image: vLLM generation (vLLM pins its own torch and transformers, so it gets its own image)."""

from flytekit import ImageSpec

from images import COMMON_PACKAGES

rollout_gpu_image = ImageSpec(
    name="grpoflow-rollout-gpu",
    python_version="3.12",
    cuda="12.8",
    packages=["vllm==0.33.0", *COMMON_PACKAGES],
    source_root=".",
)
