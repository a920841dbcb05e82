"""CPU driver image: setup, advantages, validation bookkeeping, finish (and the whole run on CPU)."""

from flytekit import ImageSpec

from images import COMMON_PACKAGES

cpu_image = ImageSpec(
    name="grpoflow-cpu",
    python_version="3.11",
    packages=["torch==2.13.0", "transformers==5.19.0", "gguf==0.19.0", "accelerate==1.15.0", "matplotlib", *COMMON_PACKAGES],
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    source_root=".",
)
