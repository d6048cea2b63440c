#!/usr/bin/env bash
# Llama2-7B on 2T tokens: the paper's FP8 reproduction and its BF16 baseline, multi-node.
#
#   PRECISION=fp8|bf16  PLATFORM=gaudi2|cuda  bash examples/llama2_7b_2t.sh
#
# gaudi2: 32 nodes x 8 Gaudi2 through the deepspeed launcher and a hostfile (the reference setup).
# cuda:   H100/H200 nodes through torchrun (run this script on every node with NODE_RANK set) or,
#         with LAUNCHER=deepspeed, through the deepspeed launcher and a hostfile.
# Slurm:  sbatch examples/llama2_7b_2t.sbatch runs this script on every node (torchrun's c10d rendezvous, RDZV_ID).
# torchrun restarts a failed attempt MAX_RESTARTS times (default 3); each attempt resumes from the newest intact
# checkpoint (--load = --save). The deepspeed launcher has no restarts: docs/reliability.md says how to wrap it.
# PRINT_LAUNCH=1 prints the launch command instead of running it.
# FP8 = delayed hybrid scaling (E4M3 forward, E5M2 gradients, per-tensor, power-of-two scales, amax over
# all micro-batches of a step) + Smooth-SwiGLU + Fp8AdamW (m E4M3, v E5M2); docs/guides/launch.md.
# DRY_RUN=1 resolves and validates the whole configuration for the real world size without launching
# anything (synthetic data, so no corpus or tokenizer is needed): tests/e2e/test_examples.py runs it.
# SMOKE=1 (PLATFORM=cuda) runs these very flags for 2 iterations on a model shrunk to 2 layers, with synthetic
# data, on 2 local CPU processes (the scaled_mm FP8 backend runs there too), and saves a checkpoint:
# tests/e2e/test_checkpoint_layouts.py exports it to Hugging Face.
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/llama2_7b_model.sh

# ---- paths and sizes: edit these ------------------------------------------------------------------
PRECISION="${PRECISION:-fp8}"                  # fp8 | bf16
PLATFORM="${PLATFORM:-gaudi2}"                 # gaudi2 | cuda
LAUNCHER="${LAUNCHER:-$([ "$PLATFORM" = gaudi2 ] && echo deepspeed || echo torchrun)}"
NNODES="${NNODES:-32}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
HOSTFILE="${HOSTFILE:-examples/hostfile.example}"
MASTER_ADDR="${MASTER_ADDR:-node-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
RDZV_ID="${RDZV_ID:-}"                          # set (the Slurm job id): c10d rendezvous at MASTER_ADDR:MASTER_PORT
DATA_PATH="${DATA_PATH:-/data/redpajama/redpajama_text_document}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-/data/llama2/tokenizer.model}"
RUN_DIR="${RUN_DIR:-runs/llama2_7b_2t_${PRECISION}_${PLATFORM}}"
# The reference ran ZeRO 0 with DeepSpeed's BF16 weights; we keep FP32 master weights under BF16 autocast,
# so ZeRO 1 (optimizer states sharded over the data-parallel ranks) is what fits 7B in device memory.
ZERO_STAGE="${ZERO_STAGE:-1}"
# Megatron-DeepSpeed's layout: BF16 weights, FP32 master weights and moments in ZeRO's shards (6 bytes of persistent
# state per parameter at this scale instead of 8 with --params-dtype fp32). PARAMS_DTYPE=fp32 keeps FP32 weights;
# with pipeline stages (PP > 1) FP32 weights are the default, since BF16 weights are not supported there yet.
# Pipeline stages (DeepSpeed PipelineModule; ZeRO 0/1, must divide the 32 layers). 1 = the reference setup.
PP="${PP:-1}"
PARAMS_DTYPE="${PARAMS_DTYPE:-$([ "$PP" = 1 ] && echo bf16 || echo fp32)}"
GLOBAL_BATCH=1024                               # x 4096 tokens = 4.2M tokens per step
TRAIN_ITERS=476837                              # 2T tokens
PY="${PYTHON:-python}"
# The FP8 controller (--fp8-autoheal: more margin, then current scaling, then BF16 for a tensor that keeps clipping;
# docs/stability.md). Off by default, as in pretrain_gpt.py: this script reproduces the paper's recipe. This run
# records the FP8 statistics anyway (--log-fp8-stats), so the controller adds only its decision per log iteration.
AUTOHEAL="${AUTOHEAL:-0}"                      # 1: turn it on

TRAIN_ARGS=(
  "${LLAMA2_7B_ARGS[@]}"
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr-decay-iters "$TRAIN_ITERS" --recompute-activations
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size "$PP"
  --deepspeed --zero-stage "$ZERO_STAGE" --params-dtype "$PARAMS_DTYPE"
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000
  --tensorboard-dir "$RUN_DIR/tensorboard" --log-interval 10 --eval-interval 1000 --eval-iters 10
  --exit-signal-handler
)
if [ "$PRECISION" = fp8 ]; then
  TRAIN_ARGS+=(--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max
               --fp8-power-of-two-scales --smooth-swiglu --smooth-swiglu-granularity channel
               --optimizer fp8adam --fp8-optimizer-block-size 128 --log-fp8-stats)
  [ "$AUTOHEAL" = 1 ] && TRAIN_ARGS+=(--fp8-autoheal)
  [ "$PLATFORM" = gaudi2 ] && TRAIN_ARGS+=(--fp8-backend hpu)
  [ "$PLATFORM" = cuda ] && TRAIN_ARGS+=(--fp8-backend scaled_mm)
fi
DEVICE_ARGS=(--device "$([ "$PLATFORM" = gaudi2 ] && echo hpu || echo cuda)")
# Gaudi: lazy mode, as in Habana's reference setup (current Gaudi software defaults to eager); the trainer asks the
# bridge which mode runs (habana_frameworks.torch.utils.internal.is_lazy). PT_ENABLE_INT64_SUPPORT=1 is set by the
# trainer itself (the FP8 statistics count elements in 64-bit integers; docs/gaudi.md).
[ "$PLATFORM" = gaudi2 ] && export PT_HPU_LAZY_MODE="${PT_HPU_LAZY_MODE:-1}"
DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type GPTSentencePieceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --data-cache-path "$RUN_DIR/index-cache")

if [ "${SMOKE:-0}" = 1 ]; then
  if [ "$PLATFORM" != cuda ]; then
    echo "SMOKE=1 needs PLATFORM=cuda (its FP8 backend, scaled_mm, also runs on the CPU); Gaudi's does not" >&2
    exit 2
  fi
  # Appended last, so these win over the 7B values (argparse keeps the last occurrence).
  TRAIN_ARGS+=(--num-layers 2 --hidden-size 64 --ffn-hidden-size 176 --num-attention-heads 4 --seq-length 32
               --max-position-embeddings 32 --global-batch-size 4 --train-iters 2 --lr-decay-iters 2
               --lr-warmup-iters 0 --save-interval 2 --eval-interval 2 --eval-iters 1)
  DATA_ARGS=(--mock-data --vocab-size 128)
  DEVICE_ARGS=(--device cpu)
  NNODES=1 GPUS_PER_NODE=2 NODE_RANK=0 MASTER_ADDR=127.0.0.1 LAUNCHER=torchrun
fi

if [ "${DRY_RUN:-0}" = 1 ]; then
  # Resolve for the real world size, with synthetic data and no device, so any machine checks the flags.
  # It also projects the run and its BF16 twin on 256 Gaudi2 and 256 H200 (megatron/perf, docs/performance.md);
  # PROJECT_ON=h100,b200 picks other devices, PROJECT_ON= none.
  PROJECT_ON="${PROJECT_ON-gaudi2,h200}"
  WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec "$PY" pretrain_gpt.py "${TRAIN_ARGS[@]}" \
    --mock-data --vocab-size 32000 --dry-run ${PROJECT_ON:+--project-on "$PROJECT_ON"}
fi

if [ "$LAUNCHER" = deepspeed ]; then
  LAUNCH=(deepspeed --hostfile "$HOSTFILE" --num_nodes "$NNODES" --num_gpus "$GPUS_PER_NODE"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
elif [ -n "$RDZV_ID" ]; then  # every node runs the same command; the rendezvous assigns the node ranks
  LAUNCH=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
          --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
          --max-restarts "$MAX_RESTARTS")
else
  LAUNCH=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --node_rank "$NODE_RANK"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS")
fi
COMMAND=("${LAUNCH[@]}" pretrain_gpt.py "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" "${DEVICE_ARGS[@]}")
if [ "${PRINT_LAUNCH:-0}" = 1 ]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi
mkdir -p "$RUN_DIR"
exec "${COMMAND[@]}"
