#!/usr/bin/env bash
# The test command: installs what the suite needs into .venv (torch pinned to the local CPU build),
# then runs pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k fp8`.
#
# Two passes: the default suite, then the tests marked `isa_sensitive` (comparisons of two computations whose
# rounding depends on the CPU's kernels) again with AVX2 kernels forced, so that a tolerance that only holds
# for this machine's AVX-512 summation order fails here rather than on someone else's CPU. The second pass
# keeps the extra arguments (`-k`, paths); its own `-m isa_sensitive` replaces a `-m` among them. When they
# select no such test, pytest exits with 5 ("no tests collected"), which is not a failure here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,eval,demo,bench,deepspeed"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

status=0
.venv/bin/python -m pytest -q "$@" || status=$?

echo "== second pass: isa_sensitive tests with AVX2 kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL)"
avx2=0
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    .venv/bin/python -m pytest -q "$@" -m isa_sensitive || avx2=$?
if [ "$avx2" -eq 5 ]; then
    avx2=0
fi
if [ "$status" -ne 0 ]; then
    exit "$status"
fi
exit "$avx2"
