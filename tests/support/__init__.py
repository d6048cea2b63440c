"""What the tests share (tests/unit: in-process; tests/e2e: launches processes); no tests live here. Import from
the modules:

    config             REPO, the tiny configuration (TINY, tiny_argv), load_tool, load_bench, the tests' ZeRO-3 JSON
    flags              flag sets and run sizes that a unit module and its e2e counterpart both use
    training           in-process helpers: the exact-resume check, a checkpoint written directly
    launch             free ports, torchrun / deepspeed launcher commands, running `pretrain_gpt.py` (BASE, run)
    forkserver         launches forked from one preloaded interpreter per session (what `launch` runs on)
    logs               values read from a run's log (the loss regexes)
    processes          worker processes: gloo process groups over TCP, a PID that no process holds
    run_noise          bounds from the runs' own rounding noise, relative errors
    data               data fixtures: indexed pairs (write_builder, write_indexed, by hand), data_argv, VOCAB, NULL
    fp8_reference      an independent float64 FP8 reference, a tiny stand-in GPT
    fp8_traced         traced FP8 layers against eager ones, bit for bit
    tensor_parallel    TP = 1 and TP = 2 models trained side by side in a worker
    model_construction the 1B construction worker (`torchrun -m tests.support.model_construction MODE`)
    reshard            the resharding runs and their state comparison
    upstream_commands  Megatron-DeepSpeed users' launch commands
    fake_hpu           stand-ins for Gaudi's FP8 ops
    index_reference    the former index construction, the reference of the chunked one
    collective_guard   the collective guard for the whole session

Kept free of imports: `python -m tests.support.model_construction` and bench/bench_index_build.py's child
process (through tests/index_reference.py, under a tight address-space limit) import this package.
"""
