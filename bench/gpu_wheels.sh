#!/usr/bin/env bash
# Fetch, here (with a package index), the wheels bench/gpu_check.sh installs on the offline GPU machine.
#
#   bash bench/gpu_wheels.sh [DIR]        # default DIR: wheels (git-ignored; name it in the run's carry)
#
# flashinfer-python 0.5.0 (6.9 MB, no compiled kernels: it builds them with the image's nvcc at first use;
# 0.7.x is ~100 MB, over what a run may carry) and, of its requirements (Requires-Dist), the one the GPU
# image lacks: apache-tvm-ffi (<0.2; 0.1.11, the version requirements/sglang-cpu.txt pins). The image already
# has torch, numpy, ninja, requests, click, einops, tabulate, tqdm, packaging, nvidia-ml-py and cuda-bindings;
# nvidia-cudnn-frontend and nvidia-cutlass-dsl are imported only by FlashInfer's cuDNN and CuTe-DSL paths,
# which the check does not take. Its Python is 3.12 on x86-64 (../shared/DATA.md).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DIR" flashinfer-python==0.5.0 apache-tvm-ffi==0.1.11
ls -l "$DIR"/*.whl
du -ch "$DIR"/*.whl | tail -n 1
