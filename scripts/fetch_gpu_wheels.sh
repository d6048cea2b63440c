#!/usr/bin/env bash
# The wheels the GPU check installs on a GPU machine without network (scripts/gpu_check.sh): torchao (the float8
# peer of bench/bench_block_stack.py) and DeepSpeed. Run it where PyPI is reachable; they land in wheels/gpu/
# (ignored by git), which travels with the working tree to the GPU machine (the device tool's `carry`).
#
#   bash scripts/fetch_gpu_wheels.sh        # GPU_PYTHON=3.12 TORCHAO_VERSION=0.17.0 DEEPSPEED_VERSION=0.19.8
#
# torchao's float8 training is Python over torch._scaled_mm; its wheel's C++ kernels are built for one torch and
# are not needed (torchao warns and goes on when they do not load). DeepSpeed has no wheel on PyPI: its source
# is built here into a pure-Python wheel (no C++ ops; it JIT-builds them where it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=wheels/gpu
mkdir -p "$dest"
py="${PYTHON:-.venv/bin/python}"
"$py" -m pip download --no-deps --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" \
    --platform manylinux_2_28_x86_64 -d "$dest" "torchao==${TORCHAO_VERSION:-0.17.0}"
DS_BUILD_OPS=0 "$py" -m pip wheel --no-deps --no-build-isolation -w "$dest" "deepspeed==${DEEPSPEED_VERSION:-0.19.8}"
ls -l "$dest"
