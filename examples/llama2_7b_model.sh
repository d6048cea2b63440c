#!/usr/bin/env bash
# Llama2-7B model configuration (32 layers, hidden 4096, 32 heads, FFN 11008, seq 4096, RoPE, RMSNorm,
# SwiGLU, no biases, untied embeddings, vocab 32000) and the paper's optimizer settings.
# Source this file to get LLAMA2_7B_ARGS, or run it to print the dry-run summary (nothing is trained).
LLAMA2_7B_ARGS=(
  --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
  --seq-length 4096 --max-position-embeddings 4096
  --swiglu --normalization RMSNorm --norm-epsilon 1e-5
  --use-rotary-position-embeddings --rotary-position-embeddings-theta 10000
  --untie-embeddings-and-output-weights --disable-bias-linear
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --weight-decay 0.1 --clip-grad 1.0
  --bf16
)
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  set -euo pipefail
  cd "$(dirname "$0")/.."
  PY="${PYTHON:-.venv/bin/python}"
  exec "$PY" pretrain_gpt.py "${LLAMA2_7B_ARGS[@]}" --micro-batch-size 1 --global-batch-size 1024 \
    --train-iters 476837 --mock-data --vocab-size 32000 --recompute-activations --dry-run "$@"
fi
