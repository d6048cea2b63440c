"""Flag sets and run sizes that a unit module and its e2e counterpart both use; each is named here after what it
is, and the test modules import it under their own short name (FP8, COMMON, ...)."""

# test_torch_compile: fp32 (no --bf16): compiled kernels reorder fp32 arithmetic, which is the kind of difference
# the control run (another micro-batch split) measures. One layer keeps the compilation short.
COMPILE_RUN = dict(num_layers=1, micro_batch_size=4, global_batch_size=4, train_iters=12, eval_interval=1000,
                   eval_iters=0, log_interval=1)
FP8_HYBRID = ("--fp8-format", "hybrid")

# test_deepspeed_tp: 4 iterations of 8 samples, validation at 2 and 4.
DEEPSPEED_TP_RUN = dict(micro_batch_size=2, global_batch_size=8, train_iters=4, eval_iters=1, eval_interval=2,
                        lr_warmup_iters=0, log_interval=1)
TP2 = ("--tensor-model-parallel-size", "2")
SP = ("--sequence-parallel",)
PP2 = ("--pipeline-model-parallel-size", "2")

# test_fp8_recipes: the fine-grained recipes.
FINE_RECIPES = ("rowwise", "blockwise", "mxfp8")

# test_main_params: FP8 linears + Fp8AdamW, and Megatron's layout (--params-dtype bf16). Fp8AdamW eager here: the
# compiled kernel is tested in test_fp8_adam_compiled.py, and compiling costs seconds.
MAIN_PARAMS_FP8 = ("--bf16", "--fp8-format", "hybrid", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128",
                   "--no-fp8-optimizer-compile")
PARAMS_BF16 = ("--params-dtype", "bf16")

# Fp8AdamW eager, for the reference and control runs that a compiled-kernel run is compared with (compiling costs
# each process 4-10 s). The two kernels evaluate the same fp32 expressions; fusion can flip an FP8 rounding of a
# moment with probability <= 2^-16 per element and step (tests/unit/test_fp8_adam.py::test_compiled_matches_eager),
# far rarer than the flips a control's reordering makes, so the comparisons' bounds hold as they did.
EAGER_FP8ADAM = ("--no-fp8-optimizer-compile",)

# test_zero3_bf16_params: Megatron's layout with FP8 linears and Fp8AdamW.
ZERO3_BF16_PARAMS = ("--bf16", "--params-dtype", "bf16", "--fp8-format", "hybrid", "--optimizer", "fp8adam",
                     "--fp8-optimizer-block-size", "128")

# test_zero3_fp8: FP8 linears and Fp8AdamW.
ZERO3_FP8 = ("--fp8-format", "hybrid", "--optimizer", "fp8adam", "--fp8-optimizer-block-size", "128")
