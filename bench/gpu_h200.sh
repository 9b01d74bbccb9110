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
# What runs on the GPU: SGLang's own CUDA kernels; target attention, including ENTMTP's tree verify, on
# SGLang's FlashInfer backend with its custom mask; ENTMTP's fixed-tree draft on entmtp_torch (torch SDPA on
# CUDA tensors, --speculative-draft-attention-backend) without CUDA graphs: per-tree CUDA graphs are not
# built (README, "GPU"). Never run yet: no GPU has been lent to this project's sessions.
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

cpu_args = serve.cpu_args               # the original, before it is replaced below

def gpu_args(speculative, **kw):
    """The CPU command line, moved to CUDA: target attention (prefill, decode, tree verify with SGLang's
    custom mask) on FlashInfer with CUDA graphs; ENTMTP drafts its fixed trees with entmtp_torch as the
    draft backend and runs eagerly (one CUDA graph per tree is not built)."""
    args = cpu_args(speculative, **kw)
    args[args.index("--device") + 1] = "cuda"
    args[args.index("--attention-backend") + 1] = "flashinfer"
    if speculative == "ENTMTP":
        args += ["--speculative-draft-attention-backend", "entmtp_torch"]
    else:
        del args[args.index("--disable-cuda-graph")]
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
