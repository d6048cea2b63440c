#!/usr/bin/env bash
# One-command GPU check (see scripts/gpu_check.py): the FP8 vs BF16 block-stack bench, GPU tests, FP8 training
# through NCCL. Uses the machine's own python with its preinstalled torch (PYTHON=... overrides); wheels carried
# in wheels/gpu/ (scripts/fetch_gpu_wheels.sh: torchao, DeepSpeed) are installed into .gpu_site first, without
# network and without their dependencies, replacing an earlier install (a second run prints no warnings).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if [[ "${1:-}" != "--dry-run" ]] && compgen -G "wheels/gpu/*.whl" > /dev/null; then
    "$py" -m pip install -q --upgrade --no-deps --no-index --target .gpu_site wheels/gpu/*.whl \
        && export PYTHONPATH="$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}" \
        || echo "gpu_check: installing wheels/gpu/*.whl failed; the check runs without them" >&2
fi
exec "$py" scripts/gpu_check.py "$@"
