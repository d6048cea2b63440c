#!/usr/bin/env bash
# One-command GPU check (see scripts/gpu_check.py): GPU tests, FP8 training through NCCL, FP8 benchmarks.
# Uses the machine's own python with its preinstalled torch (no installs, no network): PYTHON=... overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
