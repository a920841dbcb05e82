"""GPU train image: logprob and train tasks with transformers or Megatron-core on CUDA."""

from flytekit import ImageSpec

from images import COMMON_PACKAGES

train_gpu_image = ImageSpec(
    name="grpoflow-train-gpu",
    python_version="3.11",
    cuda="12.8",
    packages=["torch==2.13.0", "megatron-core==0.16.0", "transformers==5.19.0", *COMMON_PACKAGES],
    source_root=".",
)
