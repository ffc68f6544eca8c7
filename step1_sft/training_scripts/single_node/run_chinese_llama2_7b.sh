#!/usr/bin/env bash
# Stage 1, full fine-tuning of Chinese-LLaMA-2-7B on one node (8 x 80 GB by default; NUM_GPUS to change).
# ZeRO-3 with gradient checkpointing; DeepSpeed-Chat's step-1 settings for LLaMA-2-7B (lr 9.65e-6, 4 epochs).
#
#   step1_sft/training_scripts/single_node/run_chinese_llama2_7b.sh [OUTPUT_DIR] --data my_sft.jsonl ...
#
# The model must be on disk or in the HF cache (`dschat` does not download here when HF_HUB_OFFLINE=1).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUTPUT="${1:-output/step1_sft_llama2_7b}"
shift $(( $# > 0 ? 1 : 0 ))
STEP=1 NUM_GPUS="${NUM_GPUS:-8}" exec "$HERE/../../../launch/single_node.sh" \
  --model chinese-llama-2-7b --data-split 2,4,4 --max-seq-len 512 \
  --per-device-train-batch-size 4 --gradient-accumulation-steps 1 --num-train-epochs 4 \
  --learning-rate 9.65e-6 --weight-decay 0 --lr-scheduler-type cosine --num-warmup-steps 0 \
  --zero-stage 3 --gradient-checkpointing --dtype bf16 --save-interval 500 --output-dir "$OUTPUT" "$@"
