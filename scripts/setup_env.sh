#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install megatron-fp8 into it.
# Usage: bash scripts/setup_env.sh [EXTRAS]   e.g. EXTRAS="test,demo"
# torch is pinned to 2.13.0 here: on the development/CI machines its CPU build installs from local disk,
# while an unpinned requirement would pull a multi-GB CUDA build. The package itself only asks torch>=2.4.
# With the deepspeed extra, DeepSpeed's CPU communication op (deepspeed_shm_comm, a JIT-built C++ extension)
# is built here, once, into .venv/torch_extensions: scripts/test.sh points TORCH_EXTENSIONS_DIR there, so no
# test pays the build. Prints its own time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
EXTRAS="${1:-test}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# One stamp per installed set of extras and setup.py: a request covered by an earlier install (scripts/demo.sh after
# scripts/test.sh) installs nothing.
HASH="$(sha1sum setup.py | cut -c1-12)"
STAMP=".venv/.installed-$(echo "$EXTRAS" | tr ',' '\n' | sort | tr '\n' '-')$HASH"
covered=0
for done in .venv/.installed-*-"$HASH"; do
  [ -f "$done" ] || continue
  have="$(basename "$done" | sed "s/^\.installed-//; s/-$HASH\$//" | tr '-' '\n')"
  missing="$(echo "$EXTRAS" | tr ',' '\n' | grep -vxF -f <(echo "$have") || true)"
  [ -z "$missing" ] && covered=1 && break
done
if [ "$covered" = 0 ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/python -m pip install -q -e ".[${EXTRAS}]"
  touch "$STAMP"
fi
if [[ ",$EXTRAS," == *",deepspeed,"* ]]; then
  TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions" .venv/bin/python -c '
from deepspeed.accelerator import get_accelerator
if get_accelerator().device_name() == "cpu":
    get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
' >/dev/null 2>&1 || echo "setup: DeepSpeed's CPU communication op did not build here; DeepSpeed will try again at its first use"
fi
echo "setup: .venv ready (extras ${EXTRAS}) in $((SECONDS - start)) s"
