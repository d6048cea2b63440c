"""The former index construction now lives in tests/support/index_reference.py. This module stays for
bench/bench_index_build.py, which imports `index_reference` with tests/ on sys.path; once that script imports
it from tests/support, delete this file."""
from support.index_reference import *  # noqa: F401,F403
