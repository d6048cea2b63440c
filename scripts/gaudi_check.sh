#!/usr/bin/env bash
# One-command Gaudi check (see scripts/gaudi_check.py): probes of the ops the HPU path relies on, the HPU layer and
# Fp8AdamW against emulation, a short FP8 training run. Uses the machine's own python with Habana's torch
# (PYTHON=... overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gaudi_check.py "$@"
