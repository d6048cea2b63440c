"""Flag sets and run sizes that a unit module and its e2e counterpart both use; each is named here after what it
is, and the test modules import it under their own short name (FP8, COMMON, ...)."""

# test_torch_compile: fp32 (no --bf16): compiled kernels reorder fp32 arithmetic, which is the kind of difference
# the control run (another micro-batch split) measures. One layer keeps the compilation short.
COMPILE_RUN = dict(num_layers=1, micro_batch_size=4, global_batch_size=4, train_iters=12, eval_interval=1000,
                   eval_iters=0, log_interval=1)
FP8_HYBRID = ("--fp8-format", "hybrid")
