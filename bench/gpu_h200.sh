#!/usr/bin/env bash
# One H200, under 8 minutes: serve the bundled model with SGLang (no speculation, EAGLE static,
# --speculative-adaptive, ENTMTP), check greedy equality with the no-speculation server, and print
# tokens/s and mean accepted length for each (bench/results/sglang_gpu.{jsonl,md}).
#
#   bash bench/gpu_h200.sh            # on the device machine, from the repository root
#
# Install: uses .venv if it already has sglang; else creates it and installs sglang 0.5.23 with its CUDA
# dependencies (pip install sglang==0.5.23) and this package. If wheels were carried in ./wheels, pip
# installs from there first (--find-links), so no registry is needed.
# What runs on the GPU: SGLang's own CUDA kernels for the target and draft models; ENTMTP's tree verify and
# fixed-tree draft use the entmtp_torch attention backend (torch SDPA on CUDA tensors). FlashInfer
# custom-mask verify and per-tree CUDA graphs for ENTMTP are not implemented yet (README, "GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if ! $PY -c "import sglang" 2>/dev/null; then
  python3 -m venv .venv
  FL=(); [ -d wheels ] && FL=(--find-links wheels)
  .venv/bin/pip install -q "${FL[@]}" "sglang==0.5.23"
  .venv/bin/pip install -q "${FL[@]}" --no-deps -e .
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 450 $PY - <<'PY'
import time
from pathlib import Path
from entmtp_sglang.sglang import serve
from entmtp_sglang.sglang.benchmark import DEFAULT_SYSTEMS, run, to_markdown, write

def gpu_args(speculative, **kw):
    args = serve.cpu_args(speculative, **kw)
    i = args.index("--device"); args[i + 1] = "cuda"
    i = args.index("--disable-cuda-graph"); del args[i]
    return args

serve.cpu_args = gpu_args            # same systems, on the GPU with CUDA graphs on
t0 = time.time()
rows = run(DEFAULT_SYSTEMS, batches=(1, 8), per_task=4, max_new=128, dtype="float32",
           log_dir=Path("runs/sglang-gpu"))
write(rows, Path("bench/results"), {"device": "cuda", "duration_s": round(time.time() - t0)})
Path("bench/results/sglang_cpu.md").rename("bench/results/sglang_gpu.md")
Path("bench/results/sglang_cpu.jsonl").rename("bench/results/sglang_gpu.jsonl")
print(to_markdown(rows)); print(f"duration {time.time() - t0:.0f} s")
PY
