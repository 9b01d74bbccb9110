#!/usr/bin/env bash
# The GPU check: one prepared script for the offline H200 lent for checks (no package index there; torch,
# Triton, transformers and nvcc in its image, no FlashInfer or SGLang). Under 8 minutes, from the repository
# root, with only the wheels that bench/gpu_wheels.sh puts in ./wheels (git-ignored: carry it with the run).
#
#   bash bench/gpu_check.sh OUTDIR                   # on the GPU machine
#   bash bench/gpu_check.sh --dry-run OUTDIR         # anywhere: arguments, wheel install, cost-table writer
#
# Options: --wheels DIR (default: wheels), --python PY (default: python3), --dry-run.
# Steps, each under its own timeout inside a 470 s deadline; every step's output goes to OUTDIR:
#   1. install  the wheels of DIR and this package into a temporary --target folder (pip, --no-index)
#   2. kernels  tests/test_kernels.py on CUDA (Triton compiled for real; float32/bfloat16/float16; the slow
#               sweeps too) and tests/test_tree_attention.py (FlashInfer's custom mask against torch, the
#               lower-triangular = causal metamorphic test, the mask packing)      -> kernels.log
#   3. costs    bench/gpu_costs.py: target pass over trees of 1..256 nodes at batch 1/8/32 with 1k context,
#               one drafter level; the bundled model's, SmolLM2-135M's and Llama-3.1-8B's shapes
#                                                                                    -> gpu_costs.json, costs.log
#   4. engine   the reference engine with its target on CUDA: greedy equality with plain decoding on the
#               bundled model (torch SDPA float32, FlashInfer float16) and the sampled chi-square test
#               (tests/test_bundled.py -m gpu)                                       -> engine.log
# plus env.txt (device, driver, versions) and summary.txt (each step: ok / FAILED / timed out, seconds).
# The dry run (no GPU needed) installs the wheels it is given, collects the GPU tests without running them,
# and runs the cost-table writer on CPU tensors with a tiny shape. Exit status: the number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash bench/gpu_check.sh [--dry-run] [--wheels DIR] [--python PY] OUTDIR" >&2; exit 2; }
DRY=0; WHEELS=wheels; PY=python3; OUTDIR=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --wheels) [ $# -ge 2 ] || usage; WHEELS=$2; shift ;;
    --python) [ $# -ge 2 ] || usage; PY=$2; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    -*) echo "gpu_check: unknown option $1" >&2; usage ;;
    *) [ -z "$OUTDIR" ] || usage; OUTDIR=$1 ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || usage
[ -d "$WHEELS" ] || { echo "gpu_check: no wheel folder $WHEELS (run bench/gpu_wheels.sh $WHEELS first)" >&2; exit 2; }
command -v "$PY" >/dev/null || { echo "gpu_check: no python at $PY" >&2; exit 2; }
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
SITE=$TMP/site
START=$(date +%s)
DEADLINE=470                      # seconds for all steps; the whole check stays under 8 minutes
FAILED=0
: >"$OUTDIR/summary.txt"

# step NAME CAP LOG CMD...: run CMD with timeout min(CAP, time left), output to LOG and the terminal
step() {
  local name=$1 cap=$2 log=$3; shift 3
  local left=$((DEADLINE - ($(date +%s) - START)))
  local limit=$(( cap < left ? cap : left ))
  local t0 rc status
  t0=$(date +%s)
  if [ "$limit" -le 5 ]; then
    status="skipped (no time left)"; rc=1
  else
    echo "== $name (timeout ${limit}s)" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    case $rc in 0) status=ok ;; 124|137) status="timed out after ${limit}s" ;; *) status="FAILED (exit $rc)" ;; esac
  fi
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
  printf '%-8s %-28s %4ss\n' "$name" "$status" "$(( $(date +%s) - t0 ))" | tee -a "$OUTDIR/summary.txt"
}

install() {
  mkdir -p "$SITE"
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
      --target "$SITE" "${wheels[@]}" || return
  fi
  echo "installed ${#wheels[@]} wheel(s) from $WHEELS into $SITE: ${wheels[*]##*/}"
  # this package: kernels/ and trees/ install inside it (pyproject's package-dir); if the image cannot build
  # it without build isolation, lay the same package out with links to the checkout
  if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
       --disable-pip-version-check --target "$SITE" . ; then
    echo "pip could not build the package here; linking the checkout in its installed layout instead"
    mkdir -p "$SITE/entmtp_sglang"
    for f in entmtp_sglang/*; do ln -sfn "$PWD/$f" "$SITE/entmtp_sglang/"; done
    ln -sfn "$PWD/kernels" "$SITE/entmtp_sglang/kernels"
    ln -sfn "$PWD/trees" "$SITE/entmtp_sglang/trees"
  fi
  PYTHONPATH=$SITE "$PY" -P -c "import entmtp_sglang.kernels, entmtp_sglang.trees as t; \
print('entmtp_sglang from', t.__path__[0].rsplit('/', 1)[0])"
}

environment() {
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')   dry run: $DRY"
  echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo none)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo none)"
  "$PY" -P - <<'PY'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
import os
brought = [w.split("-")[0].replace("_", "-") for w in os.environ.get("WHEEL_FILES", "").split()]
for pkg in dict.fromkeys(["triton", "transformers", *brought, "entmtp-sglang"]):
    try:
        print(f"{pkg} {md.version(pkg)}" + (" (brought as a wheel)" if pkg in brought else ""))
    except md.PackageNotFoundError:
        print(f"{pkg} not installed")
PY
}

PYTEST=("$PY" -P -m pytest -p no:cacheprovider -q -rfEs)
KERNEL_TESTS=(tests/test_kernels.py tests/test_tree_attention.py)
ENGINE_TESTS=(tests/test_bundled.py)
export PYTHONUNBUFFERED=1

export -f install
export PY WHEELS SITE
step install 120 "$OUTDIR/install.log" bash -c install
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
WHEEL_FILES=$(cd "$WHEELS" && ls -- *.whl 2>/dev/null | tr '\n' ' ') environment >"$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

if [ "$DRY" -eq 1 ]; then
  # the same selections, collected only: they must import from the installed package and not be empty
  step kernels 120 "$OUTDIR/kernels.log" "${PYTEST[@]}" --collect-only -m "" "${KERNEL_TESTS[@]}"
  step costs 120 "$OUTDIR/costs.log" "$PY" -P bench/gpu_costs.py --out "$OUTDIR/gpu_costs.json" --device cpu \
       --shapes tiny --batches 1,2 --nodes 1,2,4 --context 16 --warmup 1 --repeats 2
  step engine 120 "$OUTDIR/engine.log" "${PYTEST[@]}" --collect-only -m gpu "${ENGINE_TESTS[@]}"
else
  "$PY" -P -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device')" || exit 2
  # FlashInfer must import, or its tests would only be skipped: a failed step of its own
  step flashinfer 60 "$OUTDIR/install.log" "$PY" -P -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
  # -m "": every test of these files, the slow sweeps included; on CUDA the kernels run compiled
  step kernels 240 "$OUTDIR/kernels.log" "${PYTEST[@]}" -m "" "${KERNEL_TESTS[@]}"
  step costs 150 "$OUTDIR/costs.log" "$PY" -P bench/gpu_costs.py --out "$OUTDIR/gpu_costs.json" --budget-s 120
  step engine 200 "$OUTDIR/engine.log" "${PYTEST[@]}" -s -m gpu "${ENGINE_TESTS[@]}"
fi
echo "== $(( $(date +%s) - START )) s in all, $FAILED step(s) failed" | tee -a "$OUTDIR/summary.txt"
exit "$FAILED"
