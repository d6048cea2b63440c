#!/usr/bin/env bash
# Llama2-70B with FP8 linears on PyTorch FSDP2: 8 nodes x 8 H100/H200 (64 devices) through torchrun.
#
#   bash examples/llama2_70b_fsdp2.sh        (on every node, NODE_RANK set; or RDZV_ID for a c10d rendezvous)
#
# Tensor parallelism 2 with sequence parallelism (--tensor-model-parallel-size 2 --sequence-parallel, within a node)
# and FSDP2 (--use-torch-fsdp2) on a 2-D layout: FSDP2 shards each TP rank's pieces of every parameter, gradient and
# Adam moment over its 32 data-parallel ranks; each transformer block is gathered for its forward and again for its
# backward (docs/distributed.md): the FP8 layers' weights as FP8 bytes cast on the shards (--fp8-param-gather; fc2,
# whose columns Smooth-SwiGLU scales per call, and the norms in BF16). FP8 = delayed hybrid scaling (E4M3 forward,
# E5M2 gradients, power-of-two scales) + Smooth-SwiGLU, with AdamW's FP32 moments (Fp8AdamW runs under FSDP2, but
# its sharded checkpoints are not built with tensor parallelism yet). Checkpoints: each rank writes its shards (--ckpt-format torch_dist) in the background (--async-save), instead
# of gathering the whole model (about 280 GB in FP32 for 70B) into one rank's CPU memory; they load at another
# data-parallel size as they are, and at another TP size through the full state. --torch-compile auto (the default)
# compiles each transformer block on CUDA, its FP8 layers taking the gathered FP8 weights as they are.
# DRY_RUN=1 resolves and validates the configuration for the 64 ranks without launching anything (synthetic
# data), and prints the memory estimate per device and the projected step time (PROJECT_ON=h200 by default):
# tests/e2e/test_examples.py runs it. PRINT_LAUNCH=1 prints the launch command instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."

NNODES="${NNODES:-8}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-node-0}"
MASTER_PORT="${MASTER_PORT:-29500}"
NODE_RANK="${NODE_RANK:-0}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
RDZV_ID="${RDZV_ID:-}"
DATA_PATH="${DATA_PATH:-/data/redpajama/redpajama_text_document}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-/data/llama2/tokenizer.model}"
RUN_DIR="${RUN_DIR:-runs/llama2_70b_fsdp2_fp8}"
GLOBAL_BATCH=1024                               # x 4096 tokens = 4.2M tokens per step
TRAIN_ITERS=476837                              # 2T tokens
PY="${PYTHON:-python}"

TRAIN_ARGS=(
  # Llama2-70B: 80 layers, hidden 8192, FFN 28672, 64 heads in 8 key-value groups, RoPE, RMSNorm, SwiGLU
  --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-key-value-heads 8
  --seq-length 4096 --max-position-embeddings 4096
  --swiglu --normalization RMSNorm --norm-epsilon 1e-5
  --use-rotary-position-embeddings --rotary-position-embeddings-theta 10000
  --untie-embeddings-and-output-weights --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
  --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0
  --bf16 --micro-batch-size 8 --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
  --lr-decay-iters "$TRAIN_ITERS"
  # a block's input is all it keeps for backward: 80 layers of full activations would not fit. Micro-batches of 8
  # (each TP rank keeps half of its tokens' inputs): the sharded weights are gathered for every micro-batch, 4 per step.
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --tensor-model-parallel-size 2 --sequence-parallel
  --use-torch-fsdp2 --fp8-param-gather
  --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 16 --fp8-amax-compute-algo max
  --fp8-power-of-two-scales --smooth-swiglu --smooth-swiglu-granularity channel --fp8-backend scaled_mm
  --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 500
  --ckpt-format torch_dist --async-save
  --tensorboard-dir "$RUN_DIR/tensorboard" --log-interval 10 --eval-interval 1000 --eval-iters 10
  --exit-signal-handler
)
DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 --tokenizer-type GPTSentencePieceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --data-cache-path "$RUN_DIR/index-cache")

if [ "${DRY_RUN:-0}" = 1 ]; then
  PROJECT_ON="${PROJECT_ON-h200}"
  WORLD_SIZE=$((NNODES * GPUS_PER_NODE)) exec "$PY" pretrain_gpt.py "${TRAIN_ARGS[@]}" \
    --mock-data --vocab-size 32000 --dry-run ${PROJECT_ON:+--project-on "$PROJECT_ON"}
fi

if [ -n "$RDZV_ID" ]; then  # every node runs the same command; the rendezvous assigns the node ranks
  LAUNCH=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
          --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
          --max-restarts "$MAX_RESTARTS")
else
  LAUNCH=("$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" --node_rank "$NODE_RANK"
          --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS")
fi
COMMAND=("${LAUNCH[@]}" pretrain_gpt.py "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}" --device cuda)
if [ "${PRINT_LAUNCH:-0}" = 1 ]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi
mkdir -p "$RUN_DIR"
exec "${COMMAND[@]}"
