#!/usr/bin/env bash
# A tiny Llama-style GPT trained on CPU in about a minute on synthetic tokens (--mock-data).
# Extra arguments are appended, e.g. `--save runs/tiny --save-interval 50` or `--tensorboard-dir runs/tb`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" pretrain_gpt.py \
  --num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-key-value-heads 2 --seq-length 64 \
  --swiglu --normalization RMSNorm --use-rotary-position-embeddings \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
  --mock-data --vocab-size 256 --log-interval 20 --eval-interval 100 --eval-iters 4 --bf16 "$@"
