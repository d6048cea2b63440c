"""What the tests share; no tests live here. Import from the modules:

    config             REPO, the tiny configuration (TINY, tiny_argv), load_tool
    training           in-process helpers: the exact-resume check
    launch             free ports, torchrun / deepspeed launcher commands, running `pretrain_gpt.py` (BASE, run)
    logs               values read from a run's log (the loss regexes)
    run_noise          bounds from the runs' own rounding noise
    upstream_commands  Megatron-DeepSpeed users' launch commands
    fake_hpu           stand-ins for Gaudi's FP8 ops
    index_reference    the former index construction, the reference of the chunked one
    collective_guard   the collective guard for the whole session

Kept free of imports: bench/bench_index_build.py's child process imports this package (through
tests/index_reference.py) under a tight address-space limit.
"""
