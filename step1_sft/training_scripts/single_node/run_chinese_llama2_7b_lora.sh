#!/usr/bin/env bash
# Stage 1 with LoRA (PEFT) on Chinese-LLaMA-2-7B: rank 128 on every attention and MLP projection, base weights
# frozen, ZeRO-2 (the frozen base needs no optimizer state). Fits 8 x 24-40 GB; saved merged into a plain folder
# plus the adapter alone in model/adapter/.
#
#   step1_sft/training_scripts/single_node/run_chinese_llama2_7b_lora.sh [OUTPUT_DIR] --data my_sft.jsonl ...
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT="${1:-output/step1_sft_llama2_7b_lora}"
shift $(( $# > 0 ? 1 : 0 ))
STEP=1 NUM_GPUS="${NUM_GPUS:-8}" exec "$HERE/../../../launch/single_node.sh" \
  --model chinese-llama-2-7b --data-split 2,4,4 --max-seq-len 512 \
  --per-device-train-batch-size 8 --num-train-epochs 2 --learning-rate 9.65e-6 \
  --lora-dim 128 --lora-alpha 256 --lora-module-name all-linear --only-optimize-lora --lora-learning-rate 2e-4 \
  --save-adapter --zero-stage 2 --gradient-checkpointing --dtype bf16 --save-interval 500 \
  --output-dir "$OUTPUT" "$@"
