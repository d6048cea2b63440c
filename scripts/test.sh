#!/usr/bin/env bash
# The test command: installs what the suite needs into .venv (torch pinned to the local CPU build),
# then runs pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k fp8`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,demo,bench,deepspeed"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec .venv/bin/python -m pytest -q "$@"
