#!/usr/bin/env bash
# The test command: installs what the suite needs into .venv (torch pinned to the local CPU build),
# then runs pytest. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k fp8`.
#
# Two passes: the default suite, then the tests marked `isa_sensitive` (comparisons of two computations whose
# rounding depends on the CPU's kernels) again with AVX2 kernels forced, so that a tolerance that only holds
# for this machine's AVX-512 summation order fails here rather than on someone else's CPU. Where the CPU's own
# ISA is AVX2 (or lower) already, the second pass would repeat the first and is skipped. The second pass keeps
# the extra arguments (`-k`, paths); its own `-m isa_sensitive` replaces a `-m` among them. When they select no
# such test, pytest exits with 5 ("no tests collected"), which is not a failure here.
# pytest prints the 20 slowest tests of each pass (--durations=20, pytest.ini); docs/testing.md has the budget.
#
# Both passes run in parallel over the CPUs (pytest-xdist): one worker per CPU, at most 4
# (MEGATRON_TEST_WORKERS=N overrides; 1 runs in one process), each with CPUs/workers OpenMP threads. A test
# file runs whole in one worker, and files that compare against one shared run stay together (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_env.sh "test,eval,demo,bench,deepspeed,parquet,wandb"
cpus=$(.venv/bin/python -c "import os; print(len(os.sched_getaffinity(0)))")
workers="${MEGATRON_TEST_WORKERS:-$(( cpus < 4 ? cpus : 4 ))}"
parallel=()
if [ "$workers" -gt 1 ]; then
    parallel=(-n "$workers" --dist loadfile)
fi
threads=$(( cpus / workers ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}"
echo "== ${workers} worker(s), ${OMP_NUM_THREADS} OpenMP thread(s) each, on ${cpus} CPU(s)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"

status=0
pass_start=$SECONDS
.venv/bin/python -m pytest -q "${parallel[@]}" "$@" || status=$?
echo "== default pass: $((SECONDS - pass_start)) s"

native_isa=$(env -u ATEN_CPU_CAPABILITY .venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
avx2=0
if [[ "$native_isa" == AVX512* ]]; then
    echo "== second pass: isa_sensitive tests with AVX2 kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL)"
    pass_start=$SECONDS
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
        .venv/bin/python -m pytest -q "${parallel[@]}" "$@" -m isa_sensitive || avx2=$?
    if [ "$avx2" -eq 5 ]; then
        avx2=0
    fi
    echo "== second pass: $((SECONDS - pass_start)) s"
else
    echo "== second pass skipped: this CPU's own kernels are ${native_isa} already (the first pass ran them)"
fi
echo "== test command: $((SECONDS - start)) s in all (setup included)"
if [ "$status" -ne 0 ]; then
    exit "$status"
fi
exit "$avx2"
