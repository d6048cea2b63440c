#!/usr/bin/env bash
# The main job: installs what it needs into .venv, prepares the bundled demo corpus, trains the same model
# in BF16 and in FP8 on the same tokens, and prints the comparison. `--quick`: a smoke run of a tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,demo,bench,deepspeed"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec .venv/bin/python tools/demo.py "$@"
