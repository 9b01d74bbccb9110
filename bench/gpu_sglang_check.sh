#!/usr/bin/env bash
# ENTMTP inside SGLang on a CUDA host: plain SGLang, SGLang's static EAGLE (steps 3, top-k 1, 4 draft tokens) and
# ENTMTP, each with SGLang's default flags, on SmolLM2-135M-Instruct and its EAGLE drafter; greedy outputs compared
# with plain decoding's, tokens/s at batch 1, 8 and 32 (bench/gpu_sglang_check.py does the requests). Needs a GPU,
# SGLang 0.5.23 built for it, and this package installed; prepares the model on first use.
#
#   bash bench/gpu_sglang_check.sh OUTDIR             # on the GPU host: OUTDIR/gpu_sglang_check.{md,jsonl}, logs
#   bash bench/gpu_sglang_check.sh --dry-run OUTDIR   # anywhere: prerequisites checked, commands printed
#
# Options: --python PY (default: python3), --model ALIAS (default: smollm2), --dry-run. Arguments after -- go to
# bench/gpu_sglang_check.py (--batches 1,8,32, --prompts 32, --max-new-tokens 64, --dtype, --strict).
# Exit status: 0 when all three servers ran and ENTMTP's outputs equal plain's at least as often as EAGLE's.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash bench/gpu_sglang_check.sh [--dry-run] [--python PY] [--model ALIAS] OUTDIR [-- ARGS]" >&2
          exit 2; }
DRY=(); PY=python3; ALIAS=smollm2; OUTDIR=; PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=(--dry-run) ;;
    --python) [ $# -ge 2 ] || usage; PY=$2; shift ;;
    --model) [ $# -ge 2 ] || usage; ALIAS=$2; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    --) shift; PASS=("$@"); break ;;
    -*) echo "gpu_sglang_check: unknown option $1" >&2; usage ;;
    *) [ -z "$OUTDIR" ] || usage; OUTDIR=$1 ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || usage
command -v "$PY" >/dev/null || { echo "gpu_sglang_check: no python at $PY" >&2; exit 2; }
"$PY" -m py_compile bench/gpu_sglang_check.py
"$PY" -m entmtp_sglang.cli model token-map --help >/dev/null

if [ ${#DRY[@]} -eq 1 ]; then
  echo "would run: $PY -m entmtp_sglang.cli model path $ALIAS; $PY -m entmtp_sglang.cli model token-map $ALIAS"
  MODEL=$("$PY" -c "import sys; from entmtp_sglang.model.prepare import prepared_dir; print(prepared_dir(sys.argv[1]))" \
          "$ALIAS")
  MAP=$MODEL/eagle/draft_vocab.pt
  "$PY" -c "import sglang" 2>/dev/null && echo "sglang: importable" || echo "sglang: not importable here (the GPU host needs it)"
else
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_sglang_check: no CUDA device')"
  "$PY" -c "import sglang, entmtp_sglang.sglang.plugin" \
    || { echo "gpu_sglang_check: needs sglang 0.5.23 and this package (pip install -e .)" >&2; exit 2; }
  MODEL=$("$PY" -m entmtp_sglang.cli model path "$ALIAS")
  MAP=$("$PY" -m entmtp_sglang.cli model token-map "$ALIAS")
fi
exec "$PY" bench/gpu_sglang_check.py --model-dir "$MODEL" --token-map "$MAP" --out "$OUTDIR" "${DRY[@]}" "${PASS[@]}"
