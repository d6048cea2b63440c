"""Five upstream launch commands of Megatron-DeepSpeed and the FP8 paper, as their scripts pass them (shell
variables expanded with the scripts' defaults), for tests/unit/test_upstream_scripts.py. Only paths are parameters;
the values are facts read from the scripts:

* Microsoft Megatron-DeepSpeed examples_deepspeed/pretrain_llama2_distributed.sh (activation_checkpoint
  false / true);
* HabanaAI/Megatron-DeepSpeed scripts/run_llama.sh (1.19.0) with HL_LLAMA_VER=2, HL_LLAMA_MODEL_SIZE=7 and 70;
* the FP8 paper's reference (Anonymous1252022/Megatron-DeepSpeed) scripts/run_llama2_7b_fp8.sh, which exports
  HL_* variables and runs that repository's scripts/run_llama.sh, plus the FP8 environment recipe it sets.

Each function returns (argv, world_size, env): world_size is what the launcher would start.
"""
from __future__ import annotations


def microsoft_llama2(data: str, tokenizer: str, save: str, ds_config: str,
                     activation_checkpoint: bool) -> tuple[list[str], int, dict]:
    tp, pp, zero = 2, 2, 0
    ds_args = [f"--zero-stage={zero}", f"--deepspeed_config={ds_config}", "--deepspeed"]
    if activation_checkpoint:
        ds_args = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                   "--deepspeed-activation-checkpointing"] + ds_args
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5504",
            "--num-attention-heads", "16", "--micro-batch-size", "4", "--global-batch-size", "32",
            "--seq-length", "2048", "--max-position-embeddings", "2048", "--train-iters", "250000",
            "--save", save, "--load", save, "--data-path", "1", data, "--data-impl", "mmap",
            "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tokenizer,
            "--split", "949,50,1", "--distributed-backend", "nccl", "--lr", "3e-4", "--lr-decay-style", "cosine",
            "--min-lr", "3e-5", "--weight-decay", "0.1", "--clip-grad", "1", "--lr-warmup-iters", "2000",
            "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "1",
            "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10", "--bf16",
            "--no-query-key-layer-scaling", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights", "--swiglu",
            "--normalization", "rmsnorm", "--disable-bias-linear", "--num-key-value-heads", "4"] + ds_args
    return argv, 8, {}


def habana_llama2(size: int, data_dir: str, tokenizer: str, out: str, reference: bool = False,
                  hl: dict | None = None) -> tuple[list[str], int, dict]:
    """run_llama.sh with LLAMA_VER=2. `reference`: the paper repository's older run_llama.sh (no compiled-autograd
    flags, no rotary theta flag, FP8 recipe variables on the command). `hl`: HL_* overrides (as the caller's
    environment would set them)."""
    hl = hl or {}
    get = lambda name, default: str(hl.get(name, default))  # noqa: E731  (the script's ${HL_X:-default})
    dp, tp, pp = int(get("HL_DP", 2)), int(get("HL_TP", 2)), int(get("HL_PP", 2))
    micro, log_interval = get("HL_MICRO_BATCH", 1), get("HL_LOG_INTERVAL", 10)
    global_batch, seq_len, train_iters = get("HL_GBS", 1024), get("HL_SEQ_LEN", 4096), get("HL_TRAIN_ITERS", 500000)
    if size == 70:
        layers, hidden, heads, ffn, lr, min_lr = get("HL_NUM_LAYERS", 80), 8192, 64, 28672, "1.5e-4", "1.5e-5"
        kv_heads = heads // 8
    else:
        layers, heads, ffn, lr, min_lr = get("HL_NUM_LAYERS", 32), int(get("HL_NUM_HEADS", 32)), 11008, "3e-4", "3e-5"
        hidden = 128 * heads if reference else 4096
        kv_heads = heads
    dropout = get("HL_DROPOUT", "0.0")
    checkpoints, tensorboard = f"{out}/checkpoints", f"{out}/tensorboard"
    argv = ["--deepspeed", "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(layers), "--hidden-size", str(hidden), "--ffn-hidden-size", str(ffn),
            "--num-attention-heads", str(heads), "--seq-length", seq_len, "--micro-batch-size", micro,
            "--global-batch-size", global_batch, "--train-iters", train_iters, "--log-interval", log_interval,
            "--eval-iters", get("HL_EVAL_ITERS", 100), "--eval-interval", get("HL_EVAL_INTERVAL", 1000),
            "--data-path", f"{data_dir}/{get('HL_DATA_FILE_PREFIX', 'redpajama')}",
            "--optimizer", get("HL_OPTIMIZER", "fusedadamw"), "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8", "--lr", lr, "--min-lr", min_lr, "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2000", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--tensorboard-dir", tensorboard, "--log-validation-ppl-to-tensorboard",
            "--log-batch-size-to-tensorboard", "--log-timers-to-tensorboard", "--load", checkpoints,
            f"--deepspeed_config={out}/ds_config.json", f"--use-torch-compile={get('HL_USE_TORCH_COMPILE', 0)}"]
    if not reference:
        argv += [f"--use-torch-compiled-autograd={get('HL_USE_TORCH_COMPILED_AUTOGRAD', 0)}",
                 f"--compiled-autograd-fallback-mode={get('HL_COMPILED_AUTOGRAD_FALLBACK_MODE', 'nothing')}"]
    argv += [f"--zero-stage={get('HL_ZERO_STAGE', 0)}", "--exit-interval", get("HL_EXIT_INTERVAL", 0),
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-gradient-accumulation-fusion", "--bf16", "--max-position-embeddings", seq_len,
             "--untie-embeddings-and-output-weights", "--swiglu", "--normalization", "rmsnorm",
             "--disable-bias-linear", "--no-query-key-layer-scaling", "--attention-dropout", dropout,
             "--hidden-dropout", dropout, "--use-fused-sdpa", get("HL_USE_FUSED_SDPA", 1),
             "--use-fused-sdpa-with-recompute", get("HL_USE_FUSED_SDPA_WITH_RECOMPUTE", 0),
             "--use-fused-rmsnorm", get("HL_USE_FUSED_RMSNORM", 1), "--use-rotary-position-embeddings"]
    if not reference:
        argv += ["--rotary-position-embeddings-theta", "10000"]
    argv += ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", tokenizer]
    if heads != kv_heads:
        argv += ["--num-key-value-heads", str(kv_heads)]
    if hl.get("HL_DATA_CACHE_DIR"):
        argv += ["--data-cache-path", hl["HL_DATA_CACHE_DIR"]]
    if int(get("HL_SEQ_PARALLEL", 1)) == 1:
        argv += ["--sequence-parallel"]
    if int(get("HL_USE_FAST_SOFTMAX", 0)) == 1:
        argv += ["--use-fast-softmax"]
    if int(get("HL_SAVE", 1)) == 1:
        argv += ["--save", checkpoints, "--save-interval", get("HL_SAVE_INTERVAL", 2000), "--verify-checkpoint",
                 "--verify-checkpoint-model-type", "LLAMA"]
    ckp_act = int(get("HL_CKP_ACT", 0))
    if ckp_act == 1:
        argv += ["--deepspeed-activation-checkpointing", "--recompute-granularity=full", "--recompute-method",
                 "uniform"]
    elif ckp_act == 2:
        argv += ["--deepspeed-activation-checkpointing", "--recompute-granularity=selective"]
    return argv, dp * tp * pp, {}


# scripts/run_llama2_7b_fp8.sh of the reference repository: its exports (paths left out), then run_llama.sh.
REFERENCE_FP8_HL = {
    "HL_DEVICES_PER_NODE": 8, "HL_DP": 8, "HL_TP": 1, "HL_PP": 1, "HL_MICRO_BATCH": 1, "HL_EXIT_INTERVAL": 0,
    "HL_SAVE_INTERVAL": 1000, "HL_CKP_ACT": 2, "HL_LLAMA_VER": 2, "HL_LLAMA_MODEL_SIZE": 7, "HL_DROPOUT": 0,
    "HL_SEQ_PARALLEL": 0, "HL_USE_FUSED_RMSNORM": 1, "HL_OPTIMIZER": "fusedadamw", "HL_EVAL_ITERS": 100,
    "HL_EVAL_INTERVAL": 3000, "HL_SAVE": 0, "HL_NUM_LAYERS": 32, "HL_NUM_HEADS": 32, "HL_LOG_INTERVAL": 1,
    "HL_UNIV_CP": 0, "HL_USE_FAST_SOFTMAX": 1,
}
# The FP8 recipe run_llama.sh puts on the command line from those exports (HL_FP8_LINEAR=true, ...).
REFERENCE_FP8_ENV = {
    "FP8_LINEAR": "true", "DISABLE_FP8": "false", "DISABLE_FP8_MLP_LINEAR2": "false", "SCALED_SWIGLU": "true",
    "DETACH_SCALED_SWIGLU": "true", "DELAYED_SCALED_SWIGLU": "false", "FP8_OPTIMIZER": "true",
    "MW_DTYPE": "fp16_pts", "M1_DTYPE": "fp8_e4m3", "M2_DTYPE": "fp8_e5m2", "SFTZ": "false",
}


def reference_fp8(data_dir: str, tokenizer: str, out: str, data_cache: str) -> tuple[list[str], int, dict]:
    hl = dict(REFERENCE_FP8_HL, HL_DATA_CACHE_DIR=data_cache)
    argv, world, _ = habana_llama2(7, data_dir, tokenizer, out, reference=True, hl=hl)
    return argv, world, dict(REFERENCE_FP8_ENV)
